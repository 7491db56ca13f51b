"""How a call's scans run: its executor, chosen once per call
(`executor_of_call`, the one place that asks torch how the call is traced),
behind one interface that the runners use (`Executor`):

* `LAZY_LOOP`, eager calls: a scan is `torch_xla_ext.scan`'s lazy XLA While
  loop, which runs on XLA devices only; what stands for the values the
  layers compute between the calls of a run, which the forward hands on,
  is a placeholder, kept for the kind of call;
* `EXPORTED_OPERATOR`, while `torch.export` traces (on fake tensors, on
  whatever device it is given: torch_xla exports on the CPU and lowers the
  exported program to StableHLO afterwards): a scan is one call of torch's
  scan operator, a node of the exported graph. Before the operator traces
  the step, the step runs once on fakes (`torch_scan.operator_call.rehearse`),
  where what the operator cannot take (a state written in place, as a
  key/value cache's stacked buffers are) is found: those calls run their
  layers one by one, saying why. The stand-ins are tensors of the export's
  trace (XLA tensors, which an export on the CPU cannot take), made afresh
  at every call since they belong to that trace. What `scan` takes that the
  operator has no place for (a stack's `partition_fn` and `unroll`) is the
  lowering's: `register_torch_scan`'s options where the exported program
  runs or lowers; a stack's own that differ from the defaults are warned of
  (`ExportWarning`);
* `DYNAMO_TRACE`, while Dynamo traces the forward: the owner's loop is
  Dynamo's traced loop (`dynamo`) where `trace_loops_in_dynamo` planned it,
  else the loop runs at a graph break, eagerly, as `LAZY_LOOP`.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from torch_xla_ext.diagnostics import Refusal, TorchXlaExtWarning
from torch_xla_ext.layer_stack.fakes import apart_from_trace
from torch_xla_ext.layer_stack.operands import Unscannable
from torch_xla_ext.placeholders import placeholder
from torch_xla_ext.policies import save_everything
from torch_xla_ext.scan import scan
from torch_xla_ext.torch_scan.operator_call import rehearse, scan_through_operator

__all__ = ["DYNAMO_TRACE", "EXPORTED_OPERATOR", "LAZY_LOOP", "ExportWarning", "Executor",
           "device_reason", "executor_of_call"]


class ExportWarning(TorchXlaExtWarning):
    """An option of a stack that an exported program does not hold (its
    `partition_fn`, its `unroll`): torch's scan operator has no place for
    them; `register_torch_scan`'s options apply where the program runs."""


class Executor:
    """How the scans of a call run (see the module docstring)."""
    name = "the lazy XLA loop"
    # Whether Dynamo traces the owner's loop (its traced drivers), rather
    # than the loop running at a graph break.
    traces_loops = False
    # Whether planning a kind of call also prepares the loops Dynamo would
    # trace for it (an exported call is planned for the export only).
    prepares_traced_loops = True

    def device_refusal(self, device: torch.device) -> str | None:
        """Why a scan cannot run on `device`, or None."""
        if device.type != "xla":
            return f"the layers run on {device.type}, and the scan is an XLA loop"
        return None

    def loop(self, partition_fn, is_fn_pure, unroll, step_cotangents=None) -> Callable:
        """`scan(step, init, xs) -> (carry, ys)` with a stack's options,
        raising Unscannable when the loop cannot take the step (found before
        anything is traced); `step_cotangents` as `scan`'s, for a backward."""
        return functools.partial(scan, partition_fn=partition_fn, is_fn_pure=is_fn_pure,
                                 unroll=unroll, step_cotangents=step_cotangents)

    def stand_in(self, shape: tuple, dtype: torch.dtype, device: torch.device,
                 requires_grad: bool = False) -> tuple[torch.Tensor, bool]:
        """A tensor of this shape and dtype with no data that stands for what
        a layer computes, and whether it may be kept for later calls."""
        return placeholder(shape, dtype, requires_grad=requires_grad), True

    def __repr__(self):
        return f"<executor: {self.name}>"


class _ExportedOperator(Executor):
    name = "torch's scan operator, under torch.export"
    prepares_traced_loops = False

    def device_refusal(self, device: torch.device) -> str | None:
        return None  # the exported program runs where it is lowered

    def loop(self, partition_fn, is_fn_pure, unroll, step_cotangents=None) -> Callable:
        # An export has no backward, so no step cotangents to give.
        def through_operator(step, init, xs):
            if partition_fn is not save_everything or unroll != 1:
                warnings.warn(
                    f"torch.export: the exported program's scan has no place for the layers' "
                    f"partition_fn={partition_fn!r} and unroll={unroll!r} (transformers' "
                    f"gradient checkpointing is save_nothing); pass them to "
                    f"register_torch_scan where the exported program runs or lowers",
                    ExportWarning, stacklevel=5)
            rehearsed = rehearse(step, init, xs)
            if isinstance(rehearsed, Refusal):
                raise Unscannable(rehearsed.reason)
            return scan_through_operator(step, init, xs, rehearsed)
        return through_operator

    def stand_in(self, shape: tuple, dtype: torch.dtype, device: torch.device,
                 requires_grad: bool = False) -> tuple[torch.Tensor, bool]:
        with apart_from_trace():  # no op of the exported graph
            made = torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)
        return made, False


class _DynamoTrace(Executor):
    name = "Dynamo's trace"
    traces_loops = True


LAZY_LOOP = Executor()
EXPORTED_OPERATOR = _ExportedOperator()
DYNAMO_TRACE = _DynamoTrace()


def executor_of_call() -> Executor:
    """The executor of the call under way, from torch's documented flags, read
    here only. Dynamo first: inside its trace both flags read True (constants
    of the trace), while a non-strict export sets only `is_exporting`."""
    if torch.compiler.is_dynamo_compiling():
        return DYNAMO_TRACE
    if torch.compiler.is_exporting():
        return EXPORTED_OPERATOR
    return LAZY_LOOP


def device_reason(device: torch.device) -> str | None:
    """Why layers on `device` run one by one in the call under way, or None:
    the lazy loop runs on XLA devices only (a model moved to the CPU to be
    saved still runs), torch's scan operator under export on any device."""
    return executor_of_call().device_refusal(device)
