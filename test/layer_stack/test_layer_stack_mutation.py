"""Layers that update buffers in place (BatchNorm in training mode, a layer's
own key cache written at each decoding step) in a LayerStack or scan_layers
end with each layer's state the ModuleList loop leaves, and the same outputs
and gradients."""
import copy

import torch
import torch_xla
from torch import nn

import torch_xla_ext as tx
from tolerances import ACCUMULATED, close, close_by_name

DEV = torch_xla.device()


def make_layers(count=3, width=4):
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh())
        for _ in range(count)).to(DEV)


def run_loop(layers, hidden, *args):
    for layer in layers:
        hidden = layer(hidden, *args)
    return hidden


def test_layer_stack_of_batchnorm_layers_keeps_each_layers_statistics():
    layers = make_layers()
    reference = copy.deepcopy(layers)
    stack = tx.LayerStack(layers)
    stack_optimizer = torch.optim.SGD(stack.parameters(), lr=0.1)
    loop_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):  # the second step reuses the trace and reads the updated stats
        # Drawn on the CPU after make_layers' seed: the XLA generator's state
        # depends on what ran before in the process.
        hidden = torch.randn(5, 4).to(DEV).requires_grad_()
        out = stack(hidden)
        out.pow(2).sum().backward()
        stack_hidden_grad, hidden.grad = hidden.grad, None
        loop_out = run_loop(reference, hidden)
        loop_out.pow(2).sum().backward()
        torch_xla.sync()  # one execution for what is compared below
        close(out, loop_out, ACCUMULATED, f"step {step} output")
        close(stack_hidden_grad, hidden.grad, ACCUMULATED, f"step {step} input gradient")
        for name, stacked in stack.stacked.named_parameters():
            per_layer = torch.stack([layer.get_parameter(name).grad for layer in reference])
            close(stacked.grad, per_layer, ACCUMULATED, f"step {step} gradient of {name}")
        stack_optimizer.step()
        loop_optimizer.step()
        stack_optimizer.zero_grad()
        loop_optimizer.zero_grad()
        torch_xla.sync()
    stacked_state = stack.state_dict()
    # '1.1.running_mean': layer 1's own
    close_by_name(stacked_state, reference.state_dict(), ACCUMULATED)
    assert [int(stacked_state[f"{i}.1.num_batches_tracked"]) for i in range(3)] == [2, 2, 2]
    # The layers' statistics differ: each layer updated its own slice.
    assert not torch.allclose(stacked_state["0.1.running_mean"].cpu(),
                              stacked_state["2.1.running_mean"].cpu())


def test_layer_stack_of_batchnorm_layers_in_eval_mode_reads_the_statistics():
    layers = make_layers()
    with torch.no_grad():
        for layer in layers:
            layer[1].running_mean.uniform_(-1, 1)
            layer[1].running_var.uniform_(0.5, 2)
    stack = tx.LayerStack(layers).eval()
    layers.eval()
    hidden = torch.randn(5, 4, device=DEV)
    before = {name: t.clone() for name, t in stack.state_dict().items()}
    with torch.no_grad():
        close(stack(hidden), run_loop(layers, hidden), ACCUMULATED, "eval output")
    for name, value in stack.state_dict().items():
        close(value, before[name], ACCUMULATED, f"{name} unchanged in eval mode")


def test_scan_layers_of_batchnorm_layers_updates_the_layers_own_buffers():
    layers = make_layers()
    reference = copy.deepcopy(layers)
    hidden = torch.randn(5, 4, device=DEV, requires_grad=True)
    out = tx.scan_layers(layers, hidden)
    out.sum().backward()
    loop_out = run_loop(reference, hidden)
    loop_out.sum().backward()
    torch_xla.sync()  # one execution for what is compared below
    close(out, loop_out, ACCUMULATED, "output")
    close_by_name(layers.state_dict(), reference.state_dict(), ACCUMULATED)
    close_by_name({name: param.grad for name, param in layers.named_parameters()},
                  {name: param.grad for name, param in reference.named_parameters()}, ACCUMULATED)


class CachedLayer(nn.Module):
    """Per-layer state the way a LayerStack keeps it: a buffer of the layer,
    written in place (here at the step's `position`) and read in the same call."""

    def __init__(self, width=8, max_len=6, batch=2):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("keys", torch.zeros(batch, max_len, width), persistent=False)

    def forward(self, x, position):
        self.keys.index_copy_(1, position, self.proj(x))
        return x + (x @ self.keys.transpose(1, 2)).softmax(-1) @ self.keys


def test_layer_stack_of_layers_with_a_cache_updates_each_layers_cache_in_place():
    torch.manual_seed(0)
    layers = nn.ModuleList(CachedLayer() for _ in range(3)).to(DEV)
    reference = copy.deepcopy(layers)
    stack = tx.LayerStack(layers)
    keys = stack.stacked.keys
    traces_before = tx.cache_info().misses
    with torch.no_grad():  # decoding: what goes into the caches is not differentiated
        for step in range(4):
            position = torch.tensor([step], device=DEV)
            x = torch.randn(2, 1, 8, device=DEV)
            close(stack(x, position), run_loop(reference, x, position), ACCUMULATED, f"step {step}")
    assert stack.stacked.keys is keys  # the stacked [3, 2, 6, 8] buffer itself, written
    for index, layer in enumerate(reference):
        close(stack.stacked.keys[index], layer.keys, ACCUMULATED, f"layer {index}'s cache")
        close(stack[index].keys, layer.keys, ACCUMULATED, f"layer {index}'s cache through stack[i]")
    assert tx.cache_info().misses - traces_before == 1  # one trace for every step
