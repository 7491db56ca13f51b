"""The order of a loop's inputs and outputs, kept in one place.

Every While loop scan builds takes three groups of inputs, in this order:
carries (threaded from step to step), sliced inputs (`[length, ...]`, one
slice per step) and invariants (the same every step); and gives two groups of
outputs: carries, then stacked outputs (one slice written per step). A
`Signature` knows the sizes of those groups and splits flat lists into them
(as JAX's `split_list`); a `Slot` names one place in them; `CallLayout` maps a
scan call's own (carry, xs, captures) and (carry, ys) onto a loop's groups
and back.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, Sequence


def split_list(items: Sequence, sizes: Sequence[int]) -> list[list]:
    """`items` cut into consecutive groups of `sizes`, then the rest:
    split_list("abcdef", [1, 2]) == [["a"], ["b", "c"], ["d", "e", "f"]]."""
    items, groups, start = list(items), [], 0
    for size in sizes:
        groups.append(items[start:start + size])
        start += size
    groups.append(items[start:])
    return groups


class SlotKind(enum.Enum):
    # Places of a step's inputs.
    CARRY = "carry"
    SLICED = "sliced"          # one slice per step of a [length, ...] input
    INVARIANT = "invariant"
    SEED = "seed"              # the step's slice of the loop's random seeds
    # Places of a step's outputs (CARRY replaces a carry).
    ACCUMULATE = "accumulate"  # added to a carry (a gradient accumulator)
    STACKED = "stacked"        # written into one slice of a stacked output


class Slot(NamedTuple):
    kind: SlotKind
    index: int


@dataclasses.dataclass(frozen=True)
class Signature:
    """The sizes of a loop's groups of inputs and outputs."""
    carries: int
    sliced: int
    invariants: int
    stacked: int = 0

    def split_inputs(self, flat: Sequence) -> list[list]:
        """[carries, sliced, invariants] of a flat list of inputs."""
        return split_list(flat, [self.carries, self.sliced])

    def split_outputs(self, flat: Sequence) -> list[list]:
        """[carries, stacked] of a flat list of outputs."""
        return split_list(flat, [self.carries])

    def input_slots(self, carries: Sequence, sliced: Sequence, invariants: Sequence) -> dict:
        """{id(t): (t, its Slot)} for stand-ins of the inputs, in their groups."""
        slots = {}
        for kind, tensors in ((SlotKind.CARRY, carries), (SlotKind.SLICED, sliced),
                              (SlotKind.INVARIANT, invariants)):
            for index, tensor in enumerate(tensors):
                if tensor is not None:  # None: an input fn overwrote without reading it
                    slots[id(tensor)] = (tensor, Slot(kind, index))
        return slots

    def output_slots(self, accumulated: int = 0) -> list[Slot]:
        """The Slot of each output: the carries (the last `accumulated` of them
        summed into their carry), then the stacked outputs."""
        replaced = self.carries - accumulated
        return ([Slot(SlotKind.CARRY, i) for i in range(replaced)]
                + [Slot(SlotKind.ACCUMULATE, i) for i in range(replaced, self.carries)]
                + [Slot(SlotKind.STACKED, i) for i in range(self.stacked)])


def pick(values: Sequence, indices: Sequence[int]) -> list:
    return [values[i] for i in indices]


def place(size: int, *groups: tuple[Sequence[int], Sequence]) -> list:
    """A list of `size` whose positions `indices` hold `values`, for each group."""
    placed: list[Any] = [None] * size
    for indices, values in groups:
        for i, value in zip(indices, values):
            placed[i] = value
    return placed


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """Where a scan call's leaves go in the loop that runs it, after the passes.

    The loop carries the carries fn changes, then the captures fn writes in
    place; it slices every xs leaf; its invariants are the read-only carries,
    then the other captures. It stacks the ys that are not xs passed through,
    then the x slices fn writes in place."""
    carry_count: int
    x_count: int
    capture_count: int
    y_sources: tuple  # per y: the index of the x leaf it is, or None (stacked)
    looped_carry: tuple
    read_only_carry: tuple
    written_captures: tuple
    invariant_captures: tuple
    written_x: tuple

    @classmethod
    def of(cls, read_only: Sequence[bool], capture_count: int, written_captures: Sequence[int],
           y_sources: Sequence[int | None], x_count: int, written_x: Sequence[int]):
        return cls(
            carry_count=len(read_only), x_count=x_count, capture_count=capture_count,
            y_sources=tuple(y_sources),
            looped_carry=tuple(i for i, ro in enumerate(read_only) if not ro),
            read_only_carry=tuple(i for i, ro in enumerate(read_only) if ro),
            written_captures=tuple(written_captures),
            invariant_captures=tuple(i for i in range(capture_count)
                                     if i not in written_captures),
            written_x=tuple(written_x))

    @property
    def stacked_y(self) -> list[int]:
        return [i for i, source in enumerate(self.y_sources) if source is None]

    def signature(self) -> Signature:
        """The sizes of the groups of the loop that runs the call."""
        return Signature(carries=len(self.looped_carry) + len(self.written_captures),
                         sliced=self.x_count,
                         invariants=len(self.read_only_carry) + len(self.invariant_captures),
                         stacked=len(self.stacked_y) + len(self.written_x))

    def loop_inputs(self, carry: Sequence, xs: Sequence, captures: Sequence,
                    written=lambda t: t) -> tuple[list, list, list]:
        """(carries, sliced, invariants) of the loop; `written` wraps each input fn writes."""
        carries = (pick(carry, self.looped_carry)
                   + [written(t) for t in pick(captures, self.written_captures)])
        sliced = [written(x) if i in self.written_x else x for i, x in enumerate(xs)]
        invariants = pick(carry, self.read_only_carry) + pick(captures, self.invariant_captures)
        return carries, sliced, invariants

    def call_inputs(self, carries: Sequence, sliced: Sequence, invariants: Sequence
                    ) -> tuple[list, list, list]:
        """(carry, xs, captures) of fn's call from the loop's inputs."""
        looped, written_captures = split_list(carries, [len(self.looped_carry)])
        read_only, invariant_captures = split_list(invariants, [len(self.read_only_carry)])
        carry = place(self.carry_count, (self.looped_carry, looped),
                       (self.read_only_carry, read_only))
        captures = place(self.capture_count, (self.written_captures, written_captures),
                          (self.invariant_captures, invariant_captures))
        return carry, list(sliced), captures

    def loop_outputs(self, carry_out: Sequence, captures: Sequence, y_out: Sequence,
                     x_slices: Sequence) -> tuple[list, list]:
        """(carries, stacked) that the loop's step gives, from fn's outputs and
        the captures and x slices it wrote."""
        carries = pick(carry_out, self.looped_carry) + pick(captures, self.written_captures)
        stacked = pick(y_out, self.stacked_y) + pick(x_slices, self.written_x)
        return carries, stacked

    def call_outputs(self, carry: Sequence, xs: Sequence, loop_carries: Sequence,
                     loop_stacked: Sequence) -> tuple[list, list, list]:
        """(carry, ys) of the call from what the loop gave, and the new values
        of the inputs fn writes (the written captures, then written xs)."""
        looped, captures_written = split_list(loop_carries, [len(self.looped_carry)])
        stacked_ys, xs_written = split_list(loop_stacked, [len(self.stacked_y)])
        carry_out = list(carry)
        for i, value in zip(self.looped_carry, looped):
            carry_out[i] = value
        stacked = iter(stacked_ys)
        ys = [next(stacked) if source is None else xs[source] for source in self.y_sources]
        return carry_out, ys, captures_written + xs_written

    def written_inputs(self, xs: Sequence, captures: Sequence) -> list:
        """The inputs fn writes in place, in `call_outputs`' order."""
        return pick(captures, self.written_captures) + pick(xs, self.written_x)
