"""torch's scan operator through torch.export and torch.compile on XLA: an
exported module lowers to StableHLO with one `stablehlo.while` (registered),
and `openxla_scan` trains as torch_xla's `openxla` would, with the operator a
While loop each way, the loop's values and gradients, and no compilation
after the first step."""
import glob

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch._higher_order_ops.scan import scan as torch_scan

import torch_xla_ext as tx
from torch_xla_ext.torch_scan import TorchScanWarning
from optimized_hlo import dump_flags, while_loops
from tolerances import ACCUMULATED, SAME_OPS, TRAINING, close

DEV = torch_xla.device()
STEPS = 5  # the scan's length, a size no other dimension below has


class Recurrence(torch.nn.Module):
    """h <- tanh(h @ w_t + b) over stacked weights, b captured by the step."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(STEPS, 4, 4) * 0.5)
        self.bias = torch.nn.Parameter(torch.randn(4))

    def step(self, c, w):
        new = torch.tanh(c @ w + self.bias)
        return new, new * 2

    def forward(self, h):
        return torch_scan(self.step, h, self.weights)

    def loop(self, h):
        ys = []
        for w in self.weights:
            h, y = self.step(h, w)
            ys.append(y)
        return h, torch.stack(ys)


@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_module_lowers_to_one_stablehlo_while(strict):
    from torch_xla.stablehlo import exported_program_to_stablehlo
    torch.manual_seed(0)
    module, h = Recurrence(), torch.randn(2, 4)
    # torch's scan() compiles itself with Dynamo, whose guards on the export's
    # shapes would be built in C++ by inductor, which first compiles programs to
    # learn the host's vector ISA (about 25 s once per process).
    with torch._dynamo.config.patch(enable_cpp_symbolic_shape_guards=False):
        exported = torch.export.export(module, (h,), strict=strict)
    assert [n.target for n in exported.graph.nodes].count(torch.ops.higher_order.scan) == 1
    texts = {}
    for registered in (False, True):
        if registered:
            with tx.register_torch_scan():
                lowered = exported_program_to_stablehlo(exported)
        else:
            lowered = exported_program_to_stablehlo(exported)
        texts[registered] = lowered.get_stablehlo_text()
        close(tuple(t.cpu() for t in lowered(h)), module(h), SAME_OPS)
    assert texts[False].count("stablehlo.while") == 0
    assert texts[True].count("stablehlo.while") == 1


def training_steps(model, step_count=3):
    """SGD steps of a Recurrence (compiled or not): each step's loss and
    gradients, and the number of XLA compilations of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    h = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(DEV)
    recorded, compilations = [], []
    for _ in range(step_count):
        before = met.counter_value("UncachedCompile") or 0
        carry, ys = model(h)
        loss = carry.sum() + ys.pow(2).sum()
        loss.backward()
        recorded.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        compilations.append((met.counter_value("UncachedCompile") or 0) - before)
    return recorded, compilations


class Looped(torch.nn.Module):
    def __init__(self, recurrence):
        super().__init__()
        self.recurrence = recurrence

    def forward(self, h):
        return self.recurrence.loop(h)


def test_openxla_scan_trains_as_the_loop_without_recompiling():
    torch.manual_seed(0)
    reference = Recurrence()
    compiled = Recurrence()
    compiled.load_state_dict(reference.state_dict())
    expected, _ = training_steps(Looped(reference.to(DEV)), 4)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, compilations = training_steps(
        torch.compile(compiled.to(DEV), backend=tx.openxla_scan), 4)
    close(got, expected, TRAINING)
    # The second step compiles two small graphs more, as torch_xla's openxla does
    # for a model without a scan: the bridge syncs a first call's pending inputs
    # (the outputs' gradients, which the loss computes outside the compiled
    # graph) inside its compilation, a later call's in a graph of their own.
    # Nothing compiles after it, and Dynamo compiled one graph.
    assert compilations[0] > 0 and compilations[2:] == [0, 0], compilations
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def compiled_training_scenario():
    """Two compiled training steps, registered or not, XLA's HLO dumped."""
    import torch
    import torch_xla
    import torch_xla_ext as tx
    from test_export_compile import Recurrence, training_steps
    model = Recurrence().to(torch_xla.device())
    training_steps(torch.compile(model, backend=tx.openxla_scan), 2)


def test_openxla_scan_runs_the_operator_as_a_while_loop_each_way(run_isolated, tmp_path):
    flags = dump_flags(tmp_path)
    result = run_isolated(compiled_training_scenario, env={"XLA_FLAGS": flags})
    assert result.returncode == 0, result.stderr[-3000:]
    dumps = [open(path).read() for path in glob.glob(f"{tmp_path}/*after_optimizations.txt")]
    loops = [loop for hlo in dumps for loop in while_loops(hlo, STEPS)]
    graphs_with_loops = [hlo for hlo in dumps if " while(" in hlo]
    # The forward graph's loop, and the backward graph's: one each.
    assert len(graphs_with_loops) == 2 and len(loops) == 2, loops


def test_openxla_scan_says_the_registration_policy_does_not_apply():
    torch._dynamo.reset()
    model = Recurrence().to(DEV)
    with tx.register_torch_scan("save_nothing"), pytest.warns(TorchScanWarning,
                                                               match="no effect"):
        carry, ys = torch.compile(model, backend=tx.openxla_scan)(torch.ones(2, 4, device=DEV))
    close((carry, ys), model.loop(torch.ones(2, 4, device=DEV)), SAME_OPS)


def test_torch_xlas_openxla_backend_rejects_the_operators_body():
    # Why openxla_scan exists: torch_xla 2.9's dynamo bridge passes the body
    # (a submodule) as an argument of the part of the graph it compiles.
    torch._dynamo.reset()
    model = Recurrence().to(DEV)
    with pytest.raises(Exception, match="should be either a number or tensor"):
        torch.compile(model, backend="openxla")(torch.ones(2, 4, device=DEV))


def test_aot_traces_of_a_carry_without_gradients_differentiate_through_it():
    # torch 2.9's own rule drops the gradient flowing through a carry whose init
    # does not require grad; registered, the traced call gets a carry that does.
    from functorch.compile import aot_function, make_boxed_func
    torch.manual_seed(0)
    module = Recurrence().to(DEV)
    h = torch.randn(2, 4, device=DEV)

    def loss(h, weights, bias):
        def step(c, w):
            new = torch.tanh(c @ w + bias)
            return new, new * 2
        c, ys = torch_scan(step, h, weights)
        return c.sum() + ys.sum()
    boxed = aot_function(loss, fw_compiler=lambda graph, _: make_boxed_func(graph))
    params = [module.weights, module.bias]
    with tx.register_torch_scan():
        got = torch.autograd.grad(boxed(h, *params), params)
    expected_carry, expected_ys = module.loop(h)
    expected = torch.autograd.grad(expected_carry.sum() + expected_ys.sum(), params)
    close(got, expected, ACCUMULATED)
