"""Reading XLA's optimized HLO text (an `--xla_dump_to` dump): its
computations, while loops, and the copies they make of stacked buffers."""
import os
import re

from torch_xla_ext.metrics.hlo import callees, computations, entry_name

_ARRAY = r"(\w+)\[([\d,]*)\]"
_RESULT_SHAPE = re.compile(r"= \(?" + _ARRAY)
_OPCODE = re.compile(r"[\]}] ([\w\-]+)\(")


def dump_flags(directory) -> str:
    """XLA_FLAGS for a scenario whose optimized HLO a test reads: the suite's
    flags with a dump into `directory`, but XLA:CPU's own fusion emitters (the
    suite turns them off to compile faster, conftest.py): which ops XLA:CPU
    fuses depends on them, and the HLO read is the one a user's run makes."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_cpu_use_fusion_emitters")]
    return " ".join([*flags, f"--xla_dump_to={directory}", "--xla_dump_hlo_as_text"])


def entry_computation(hlo: str) -> list[str]:
    """The instruction lines of the module's entry computation."""
    return computations(hlo)[entry_name(hlo)]


def while_loops(hlo: str, length: int) -> list[tuple[str, set]]:
    """Per while loop: its body's name and the (dtype, dims) of its stacked
    buffers, the elements of its state whose leading dimension is `length`."""
    loops = []
    for instruction in (i for lines in computations(hlo).values() for i in lines):
        if " while(" not in instruction:
            continue
        state = instruction.split(" while(")[0]
        stacked = {(dtype, dims) for dtype, dims in re.findall(_ARRAY, state)
                   if dims.split(",")[0] == str(length)}
        body, = re.findall(r"\bbody=%([\w.\-]+)", instruction)
        loops.append((body, stacked))
    return loops


def stacked_results_in_loops(hlo: str, length: int) -> list[tuple[str, str, str]]:
    """(computation, opcode, instruction) of each instruction run by a while
    body (in it or in a computation it calls, such as a fusion) whose result
    has the shape of one of that loop's stacked buffers."""
    found = computations(hlo)
    results = []
    for body, stacked in while_loops(hlo, length):
        reached, pending = set(), [body]
        while pending:
            name = pending.pop()
            if name in reached:
                continue
            reached.add(name)
            for instruction in found[name]:
                pending += callees(instruction)
                shape = _RESULT_SHAPE.search(instruction)
                if shape and shape.groups() in stacked:
                    opcode = _OPCODE.search(instruction).group(1)
                    results.append((name, opcode, instruction))
    return results


def stacked_copies_in_loops(hlo: str, length: int) -> list[str]:
    """The copies run by a while body whose shape is one of that loop's
    stacked buffers."""
    return [f"{name}: {instruction}" for name, opcode, instruction
            in stacked_results_in_loops(hlo, length) if opcode in ("copy", "copy-start")]


def copies_of_initial_buffers(hlo: str, length: int) -> list[str]:
    """Whole [length, ...] copies of a broadcast: XLA merged the identical
    initial buffers of several stacked outputs and copies the one it kept."""
    return [line for lines in computations(hlo).values() for line in lines
            if re.search(rf"= \w+\[{length},[\d,]*\]\S* copy\(%broadcast", line)]


def loop_states(hlo: str) -> list[list[str]]:
    """Per while loop, the shapes of the arrays in its state ("f32[2,16]"),
    on one device in a partitioned module."""
    return [re.findall(r"\w+\[[\d,]*\]", line.split(" while(")[0])
            for lines in computations(hlo).values() for line in lines if " while(" in line]


def step_module(directory: str, looped: bool):
    """The largest module of an `--xla_dump_to` dump (a training step's) that
    runs while loops, or, with `looped` False, that runs none."""
    from torch_xla_ext.metrics.hlo import dumped_modules

    return max((module for module in dumped_modules(directory)
                if (" while(" in module.optimized_hlo) == looped),
               key=lambda module: len(module.optimized_hlo))
