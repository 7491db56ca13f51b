"""The executor of a call (layer_stack.executors): chosen once, from torch's
flags, for an eager call, an export and a Dynamo trace, each with what it
refuses and the stand-ins it makes."""
import pytest
import torch

from torch_xla_ext.layer_stack.executors import (
    DYNAMO_TRACE, EXPORTED_OPERATOR, LAZY_LOOP, executor_of_call)

class _ReportsItsExecutor(torch.nn.Module):
    def forward(self, x):
        executor = executor_of_call()  # by identity, which Dynamo traces
        return x * (1.0 if executor is LAZY_LOOP else 2.0 if executor is EXPORTED_OPERATOR
                    else 3.0 if executor is DYNAMO_TRACE else 0.0)


def test_an_eager_call_runs_the_lazy_loop_and_refuses_a_device_other_than_xla():
    assert torch.equal(_ReportsItsExecutor()(torch.ones(2)), torch.ones(2))
    assert not LAZY_LOOP.traces_loops and LAZY_LOOP.prepares_traced_loops
    assert LAZY_LOOP.device_refusal(torch.device("cpu")) == (
        "the layers run on cpu, and the scan is an XLA loop")


def test_an_export_runs_torch_scan_operator_on_any_device_with_stand_ins_it_does_not_keep():
    exported = torch.export.export(_ReportsItsExecutor(), (torch.ones(2),))
    assert torch.equal(exported.module()(torch.ones(2)), torch.full((2,), 2.0))
    assert EXPORTED_OPERATOR.device_refusal(torch.device("cpu")) is None
    made, kept = EXPORTED_OPERATOR.stand_in((2, 3), torch.bfloat16, torch.device("cpu"))
    assert (made.shape, made.dtype, kept) == ((2, 3), torch.bfloat16, False)


def test_a_dynamo_trace_traces_the_loops_though_torch_flags_it_exporting_inside_its_trace():
    compiled = torch.compile(_ReportsItsExecutor(), backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))
    assert DYNAMO_TRACE.traces_loops


@pytest.mark.parametrize("executor", [LAZY_LOOP, EXPORTED_OPERATOR, DYNAMO_TRACE])
def test_each_executor_says_what_it_is(executor):
    assert repr(executor).startswith("<executor: ") and executor.name in repr(executor)
