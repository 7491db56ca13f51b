"""What differs while `torch.export` traces a forward of stacked layers: the
one decision (`exporting`) and what follows from it.

An export traces the forward on fake tensors, on whatever device it is
given (torch_xla exports on the CPU and lowers the exported program to
StableHLO afterwards). The plan of the call is made as for any call (the dry
run and the comparison of programs run on fakes of their own); what changes:

* a run's scan is one call of torch's scan operator, a node of the exported
  graph, instead of `scan`'s lazy-tensor loop (`scan_as_operator`). Before the
  operator traces the step, the step runs once on fakes
  (`torch_scan.operator_call.rehearse`), where a read of a per-layer
  attribute is caught as on the lazy path and what the operator cannot take
  (a state written in place, as a key/value cache's stacked buffers are) is
  found: those calls run their layers one by one, saying why;
* the stand-ins for the values the layers compute between the calls of a
  run, which the forward hands on, are tensors of the export's trace
  instead of placeholders (XLA tensors, which an export on the CPU cannot
  take), made afresh at every call since they belong to that trace
  (`stand_in`).

What `scan` takes that the operator has no place for (a stack's
`partition_fn` and `unroll`) is the lowering's: `register_torch_scan`'s
options when the exported program runs or lowers on XLA; a stack's own that
differ from the defaults are warned of (`ExportWarning`).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from torch_xla_ext.layer_stack.fakes import apart_from_trace
from torch_xla_ext.placeholders import placeholder
from torch_xla_ext.policies import save_everything
from torch_xla_ext.torch_scan.operator_call import rehearse, scan_through_operator
from torch_xla_ext.diagnostics import TorchXlaExtWarning

__all__ = ["ExportWarning", "exporting", "scan_as_operator", "stand_in"]


class ExportWarning(TorchXlaExtWarning):
    """An option of a stack that an exported program does not hold (its
    `partition_fn`, its `unroll`): torch's scan operator has no place for
    them; `register_torch_scan`'s options apply where the program runs."""


def exporting() -> bool:
    """Whether `torch.export` is tracing this call (torch's documented flag)."""
    return torch.compiler.is_exporting()


def scan_as_operator(step: Callable, init, xs, partition_fn, unroll):
    """`scan(step, init, xs)`'s `(carry, ys)` as one call of torch's scan
    operator, or why the operator cannot take `step` (a str), found by a run
    on fakes before anything is traced. A `partition_fn` or `unroll` other
    than the defaults is warned of (`ExportWarning`)."""
    if partition_fn is not save_everything or unroll != 1:
        warnings.warn(
            f"torch.export: the exported program's scan has no place for the layers' "
            f"partition_fn={partition_fn!r} and "
            f"unroll={unroll!r} (transformers' gradient checkpointing is save_nothing); pass "
            f"them to register_torch_scan where the exported program runs or lowers",
            ExportWarning, stacklevel=6)
    rehearsed = rehearse(step, init, xs)
    if isinstance(rehearsed, str):
        return rehearsed
    return scan_through_operator(step, init, xs, rehearsed)


def stand_in(shape: tuple, dtype: torch.dtype, device: torch.device,
             requires_grad: bool = False) -> tuple[torch.Tensor, bool]:
    """A tensor of this shape and dtype with no data that stands for what a
    layer computes, and whether it may be kept for later calls: a
    placeholder (kept), or under export an empty tensor of its trace on
    `device` (not kept: it belongs to this export)."""
    if exporting():
        with apart_from_trace():  # no op of the exported graph
            made = torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)
        return made, False
    return placeholder(shape, dtype, requires_grad=requires_grad), True
