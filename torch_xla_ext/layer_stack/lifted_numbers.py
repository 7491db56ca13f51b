"""Python numbers that differ between layers, as per-layer operands of a scan.

A number that differs between a loop's steps is an operand of the step, not
a constant of its trace (as in JAX). Layers whose settings differ only in
numbers they compute with (a per-layer scale `0.8 - 0.6 * exp(-0.3 * i)`, a
residual weight `1 / sqrt(2 * (i + 1))`) trace to programs that differ in
those constants only; with the numbers as inputs of the trace, they are one
program, which one scan runs, each step given its layer's numbers.

What is lifted, at the level of torch's functions: a Python number (an int
or a float, not a bool) that is an operand of a floating-point tensor's
arithmetic (`+ - * /` as operators, torch functions or Tensor methods; not
a keyword option such as `alpha`). `Numbers`, a torch function mode, counts
those in call order (each one's ordinal), records each (`Number`: its value
and the tensor's dtype) and puts a tensor of the tensor's dtype in place of
the numbers of the ordinals it is given, so that type promotion gives what
the number gave.

* `kinds.program_of` traces a layer under it: the numbers the layer
  computed with are part of what it finds, and given `LiftedNumbers`, it
  traces those ordinals' numbers as 0-d inputs of the graph;
* `differing` (the call plan, `planner._lifted`): the ordinals whose
  numbers differ between the calls of a run, with each layer's numbers
  there; only those, so that numbers equal in every layer (an `eps`) stay
  constants of the trace;
* `substituting` (a scan's step, `scan_runner`): the step's layer call under
  the mode, each lifted ordinal's number replaced by the step's slice of
  the per-layer numbers (`LiftedNumbers.stacked`, which the scan takes
  with what it scans over), in every trace of the step (forward, backward,
  recomputation); `unmatched` says when the step's layer computed with
  other numbers than its trace for the plan did, which the scan then
  cannot stand for.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["LiftedNumbers", "Number", "Numbers", "differing", "substituting", "unmatched"]

# torch's arithmetic of two operands, as a torch function mode sees it called
# (`x + 0.5` arrives as Tensor.add, `1 - x` as Tensor.__rsub__).
_ARITHMETIC = frozenset(
    function for name in ("add", "sub", "mul", "div", "__add__", "__radd__", "__sub__",
                          "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__")
    for function in (getattr(torch.Tensor, name), getattr(torch._C.TensorBase, name, None),
                     getattr(torch, name, None))
    if function is not None)


@dataclasses.dataclass(frozen=True)
class Number:
    """A Python number that a layer's arithmetic took, with the dtype of the
    tensor it was an operand with."""
    value: int | float
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class LiftedNumbers:
    """The numbers of a run's layers that are per-layer operands of its scan:
    at each of `ordinals`, layer i of the run took `values[k][i]`. `numbers`
    is the run's first layer's whole sequence, which the template that runs
    every step (with that layer's settings) computes with."""
    ordinals: tuple[int, ...]
    values: tuple[tuple[int | float, ...], ...]  # per ordinal, per layer of the run
    numbers: tuple[Number, ...]

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.numbers[ordinal].dtype for ordinal in self.ordinals)

    def key(self) -> tuple:
        """What a scan step made for these numbers depends on (not their values)."""
        return self.ordinals, self.numbers

    def stacked(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per ordinal, the layers' numbers as a [layers] tensor on `device`."""
        return tuple(_uploaded(values, dtype, device)
                     for values, dtype in zip(self.values, self.dtypes))


@functools.lru_cache(maxsize=64)
def _uploaded(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The numbers on the device, uploaded once, not at every call."""
    return torch.tensor(values, dtype=dtype, device=device)


class Numbers(TorchFunctionMode):
    """Counts and records the Python numbers of floating-point arithmetic
    (see the module docstring) in `seen`, in call order, and puts
    `lifted[ordinal]` in place of the number at each ordinal it holds.
    `expected`, if given, is the sequence the layer computed with when its
    program was traced (`unmatched`)."""

    def __init__(self, lifted: dict[int, torch.Tensor], seen: list | None = None,
                 expected: tuple[Number, ...] = ()):
        super().__init__()
        self.lifted = lifted
        self.seen = [] if seen is None else seen
        self.expected = expected

    def __torch_function__(self, func, types, args=(), kwargs=None):
        position = _number_position(func, args)
        if position is not None:
            ordinal = len(self.seen)
            self.seen.append(Number(args[position], args[1 - position].dtype))
            if ordinal in self.lifted:
                args = (self.lifted[ordinal], args[1]) if position == 0 \
                    else (args[0], self.lifted[ordinal])
        return func(*args, **(kwargs or {}))


def _number_position(func, args: tuple) -> int | None:
    """Which of the two positional operands of an arithmetic call is a
    Python number, the other a floating-point tensor; None for any other call."""
    if func not in _ARITHMETIC or len(args) != 2:
        return None
    for position in (0, 1):
        number, tensor = args[position], args[1 - position]
        if (isinstance(number, (int, float)) and not isinstance(number, bool)
                and isinstance(tensor, torch.Tensor) and tensor.dtype.is_floating_point):
            return position
    return None


def differing(sequences: list[tuple[Number, ...] | None]) -> LiftedNumbers | None:
    """The ordinals whose numbers differ between the calls whose recorded
    sequences these are, with each call's numbers there; None where none
    differ, or where the calls computed with numbers of another count or
    dtypes (other code ran: lifting numbers cannot make them one program)."""
    if not sequences or any(each is None for each in sequences):
        return None
    first = sequences[0]
    if any(len(each) != len(first) or any(number.dtype != reference.dtype
                                          for number, reference in zip(each, first))
           for each in sequences):
        return None
    ordinals = tuple(ordinal for ordinal in range(len(first))
                     if len({(type(each[ordinal].value), each[ordinal].value)
                             for each in sequences}) > 1)
    if not ordinals:
        return None
    return LiftedNumbers(ordinals, tuple(tuple(each[ordinal].value for each in sequences)
                                         for ordinal in ordinals), first)


def substituting(lifted: LiftedNumbers | None, slices) -> Numbers | None:
    """The mode a scan step's layer call runs under: each lifted ordinal's
    number replaced by the step's slice of it (`slices`, in the order of
    `lifted.ordinals`); None where no number is lifted."""
    if lifted is None:
        return None
    return Numbers(dict(zip(lifted.ordinals, slices)), expected=lifted.numbers)


def unmatched(substitution: Numbers | None) -> str | None:
    """Why the numbers a step's layer call computed with (`substituting`'s
    mode, after the call) do not stand for its layers', or None: the layer
    computed with other numbers, or in another order, than when its program
    was traced for the plan, so the lifted ordinals may name other numbers.
    (The trace for the plan may have seen more: a recomputation in the
    layer's backward.)"""
    if substitution is None:
        return None
    seen, expected = tuple(substitution.seen), substitution.expected
    if seen == expected[:len(seen)]:
        return None
    where = next((ordinal for ordinal, (number, reference) in enumerate(zip(seen, expected))
                  if number != reference), min(len(seen), len(expected)))
    return (f"the layers differ in Python numbers they compute with, which the scan takes as "
            f"per-layer operands, and in the scan the layer computed with number {where} of its "
            f"arithmetic ({_described(seen, where)}) otherwise than when its program was traced "
            f"for the plan ({_described(expected, where)}), so the numbers cannot be matched")


def _described(numbers: tuple[Number, ...], ordinal: int) -> str:
    if ordinal >= len(numbers):
        return f"{len(numbers)} numbers in all"
    return f"{numbers[ordinal].value!r} with a {numbers[ordinal].dtype} tensor"
