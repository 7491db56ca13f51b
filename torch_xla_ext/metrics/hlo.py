"""Reading HLO module texts: the parameters of a module's ENTRY computation,
and, in XLA's optimized (partitioned) HLO and its buffer assignment, as an
`--xla_dump_to=DIR --xla_dump_hlo_as_text` dump writes them, what one device
holds and which collectives it runs. No torch needed."""
from __future__ import annotations

import re
from typing import NamedTuple

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                    "collective-permute")
# Bytes of one element of each HLO element type.
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                  "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_CALLEES = re.compile(r"\b(?:body|condition|calls|to_apply)=%([\w.\-]+)"
                      r"|\bbranch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")
# "%name = SHAPE opcode(": the shape is an array or a tuple of arrays.
_INSTRUCTION = re.compile(r"^(?:ROOT )?%[\w.\-]+ = (\(.*?\)|\S+) ([\w\-]+)\(")
_TOTAL_BYTES = re.compile(r"^Total bytes used: (\d+)", re.MULTILINE)


def hlo_parameter_count(hlo_text: str) -> int:
    """Parameters of the ENTRY computation of an HLO module's text: the data a
    computation reads from the device."""
    lines = iter(hlo_text.splitlines())
    for line in lines:
        if line.startswith("ENTRY "):
            break
    count = 0
    for line in lines:
        if line.startswith("}"):
            break
        count += " parameter(" in line
    return count


def computations(hlo_text: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text, by name."""
    found, current = {}, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = found[header.group(1)] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line.strip())
    return found


def entry_name(hlo_text: str) -> str:
    """The name of the module's ENTRY computation."""
    entry, = re.findall(r"^ENTRY %([\w.\-]+) ", hlo_text, re.MULTILINE)
    return entry


def callees(instruction: str) -> list[str]:
    """The computations an instruction calls (a while's body and condition, a
    fusion's, a reduction's, a conditional's branches)."""
    names = []
    for single, branches in _CALLEES.findall(instruction):
        names += [single] if single else [b.strip().lstrip("%") for b in branches.split(",")]
    return names


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape's arrays ("f32[8,64]{1,0}", or a tuple of arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _ELEMENT_BYTES:
            raise ValueError(f"shape_bytes: unknown HLO element type {dtype!r} in {shape!r}")
        elements = 1
        for size in filter(None, dims.split(",")):
            elements *= int(size)
        total += elements * _ELEMENT_BYTES[dtype]
    return total


def executions_per_run(hlo_text: str) -> dict[str, int]:
    """How many times one execution of the module runs each computation
    reachable from ENTRY: a while body as many times as its loop's known trip
    count (XLA's `known_trip_count`) times its caller's; every other callee
    as often as its caller (per instruction that calls it)."""
    found = computations(hlo_text)
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for instruction in found[name]:
            if " while(" in instruction:
                trips = _trip_count(instruction)
                body, = re.findall(r"\bbody=%([\w.\-]+)", instruction)
                condition, = re.findall(r"\bcondition=%([\w.\-]+)", instruction)
                visit(body, times * trips)
                visit(condition, times * (trips + 1))
            else:
                for callee in callees(instruction):
                    visit(callee, times)

    visit(entry_name(hlo_text), 1)
    return runs


def _trip_count(while_instruction: str) -> int:
    found = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', while_instruction)
    if found is None:
        raise ValueError(f"executions_per_run: a while loop without a known trip count, whose "
                         f"collectives cannot be counted per iteration: "
                         f"{while_instruction[:200]}")
    return int(found.group(1))


class Collective(NamedTuple):
    """A collective of a partitioned module: its kind (`COLLECTIVE_KINDS`),
    result shape and bytes on one device, the computation it is in, and how
    many times one execution of the module runs it."""
    kind: str
    shape: str
    bytes: int
    computation: str
    runs: int


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective one execution of a partitioned module runs (an
    asynchronous one counted at its `-done`, which has its result's shape)."""
    runs = executions_per_run(hlo_text)
    found = []
    for name, lines in computations(hlo_text).items():
        if name not in runs:
            continue
        for line in lines:
            instruction = _INSTRUCTION.match(line)
            if instruction is None:
                continue
            shape, opcode = instruction.groups()
            kind = opcode.removesuffix("-done")
            if kind in COLLECTIVE_KINDS:
                found.append(Collective(kind, shape, shape_bytes(shape), name, runs[name]))
    return found


def collective_totals(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per kind of collective (`COLLECTIVE_KINDS`, each present): how many run
    in one execution and the bytes of their results on one device."""
    totals = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVE_KINDS}
    for collective in collectives(hlo_text):
        totals[collective.kind]["count"] += collective.runs
        totals[collective.kind]["bytes"] += collective.runs * collective.bytes
    return totals


def total_bytes_used(buffer_assignment_text: str) -> int:
    """XLA's "Total bytes used" of a buffer assignment (a dump's
    `*after_optimizations-buffer-assignment.txt`): what one device holds
    while the module runs, parameters, outputs and temporaries."""
    found = _TOTAL_BYTES.search(buffer_assignment_text)
    if found is None:
        raise ValueError("total_bytes_used: the text has no 'Total bytes used:' line; pass "
                         "the *after_optimizations-buffer-assignment.txt file of an "
                         "--xla_dump_to dump")
    return int(found.group(1))



class DumpedModule(NamedTuple):
    """One module of an `--xla_dump_to=DIR --xla_dump_hlo_as_text` dump: its
    name (`module_0001.SyncTensorsGraph.1869`), optimized HLO text and XLA's
    total bytes used on one device."""
    name: str
    optimized_hlo: str
    bytes_used: int


def dumped_modules(directory: str) -> list[DumpedModule]:
    """The compiled modules of a dump, in the order they were compiled."""
    import glob
    import os

    found = []
    for path in sorted(glob.glob(os.path.join(directory, "*after_optimizations.txt"))):
        stem = path[:-len("after_optimizations.txt")]
        with open(path) as hlo, open(f"{stem}after_optimizations-buffer-assignment.txt") as used:
            name = os.path.basename(path).rsplit(".", 2)[0]
            found.append(DumpedModule(name, hlo.read(), total_bytes_used(used.read())))
    return found
