"""LayerStack and scan_layers against the plain `for layer in layers` loop."""
import copy
import functools
import gc
import io
import re
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met
from torch import nn

import torch_xla_ext as tx
from torch_xla_ext.layer_stack import LayerByLayerWarning, LayerStack, scan_layers
from torch_xla_ext.workloads import (DecoderBlock, RMSNorm, make_batch, make_decoder_stack,
                                     training_step)
from tolerances import THROUGH_LAYERS, close

HIDDEN, HEADS, SEQ, BATCH, LAYERS = 16, 2, 4, 2, 4


def decoder_models(device):
    """The same 4-layer decoder stack as a ModuleList for loop and as a LayerStack."""
    return (make_decoder_stack(LAYERS, HIDDEN, HEADS, "loop", device=device),
            make_decoder_stack(LAYERS, HIDDEN, HEADS, "scan", device=device))


def blocks(count=2, **kwargs):
    return [DecoderBlock(HIDDEN, HEADS, **kwargs) for _ in range(count)]


# ---------------------------------------------------------------------------
# Training parity with the for loop


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
def test_training_matches_for_loop(device, make_optimizer):
    loop_model, scan_model = decoder_models(device)
    optimizers = [make_optimizer(m.parameters()) for m in (loop_model, scan_model)]
    inputs, targets = make_batch(BATCH, SEQ, HIDDEN, device=device)
    for _ in range(3):
        losses = []
        for model, optimizer in zip((loop_model, scan_model), optimizers):
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(inputs), targets)
            loss.backward()
            losses.append(loss)
        torch_xla.sync()
        assert_same_losses_and_gradients(loop_model, scan_model, losses)
        # An infinite max_norm leaves the gradients as they are and returns the norm.
        norms = [nn.utils.clip_grad_norm_(m.parameters(), float("inf")) for m in
                 (loop_model, scan_model)]
        close(norms[1], norms[0], THROUGH_LAYERS)
        for optimizer in optimizers:
            optimizer.step()
        torch_xla.sync()
    loop_state, scan_state = loop_model.state_dict(), scan_model.state_dict()
    assert list(scan_state) == list(loop_state)
    for key, value in loop_state.items():
        close(scan_state[key], value, THROUGH_LAYERS)
    # Per-layer views see the optimizer's in-place updates.
    close(scan_model.layers[2].self_attn.q_proj.weight,
          loop_model.layers[2].self_attn.q_proj.weight, THROUGH_LAYERS)


def test_an_unrolled_stack_trains_as_the_for_loop(device):
    # 3 layers, 2 per iteration: the third runs after the loop, forward and backward.
    loop_model = make_decoder_stack(3, HIDDEN, HEADS, "loop", device=device)
    scan_model = make_decoder_stack(3, HIDDEN, HEADS, "scan", device=device, unroll=2)
    assert scan_model.layers.unroll == 2 and scan_model.layers.stack_options()["unroll"] == 2
    inputs, targets = make_batch(BATCH, SEQ, HIDDEN, device=device)
    losses = []
    for model in (loop_model, scan_model):
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        losses.append(loss)
    torch_xla.sync()
    assert_same_losses_and_gradients(loop_model, scan_model, losses)


def assert_same_losses_and_gradients(loop_model, scan_model, losses) -> None:
    """The loss of each (loop's, scan's), and each layer's gradients, alike."""
    close(losses[1], losses[0], THROUGH_LAYERS)
    for name, stacked in scan_model.layers.stacked.named_parameters():
        for index, layer in enumerate(loop_model.layers):
            close(stacked.grad[index], layer.get_parameter(name).grad, THROUGH_LAYERS)


@pytest.mark.parametrize("unroll, error, message", [
    (0, ValueError, "LayerStack: unroll must be 1 or more steps per loop iteration, got 0"),
    (2.0, TypeError, "LayerStack: unroll must be an int (steps per loop iteration) or True "
                     "(all steps unrolled), got float 2.0"),
])
def test_a_bad_unroll_is_refused_when_the_stack_is_made(unroll, error, message):
    with pytest.raises(error, match=re.escape(message)):
        LayerStack(blocks(), unroll=unroll)


def stacked_param_shapes(stack: LayerStack) -> set[tuple[int, ...]]:
    return {tuple(p.shape) for p in stack.parameters()}


def concatenated_shapes(hlo: str) -> set[tuple[int, ...]]:
    """The result shapes of every concatenate in an HLO module's text."""
    found = re.findall(r"= \w+\[([\d,]*)\]\S* concatenate\(", hlo)
    return {tuple(int(d) for d in dims.split(",") if d) for dims in found}


def test_steady_training_step_holds_no_copy_of_the_weights(device):
    loop_model, scan_model = decoder_models(device)
    batch = make_batch(BATCH, SEQ, HIDDEN, device=device)
    optimizer = torch.optim.SGD(scan_model.parameters(), lr=1e-2, momentum=0.9)
    weight_shapes = stacked_param_shapes(scan_model.layers)
    # Step 0 creates the momentum buffers; from step 1 on every step is the same.
    for step in range(3):
        if step == 2:
            compiles_before = met.metric_data("CompileTime")[0]
        loss = training_step(scan_model, batch, optimizer)
        if step == 1:
            tensors = [loss, *scan_model.parameters(), *(p.grad for p in scan_model.parameters())]
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(tensors)
            assert "while" in hlo
            assert not concatenated_shapes(hlo) & weight_shapes
        torch_xla.sync()
    assert met.metric_data("CompileTime")[0] == compiles_before, "a steady step recompiled"

    # The detector does see the stacking that scan_layers (the drop-in) does.
    stacked_output = scan_layers(loop_model.layers, batch[0])
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([stacked_output])
    assert concatenated_shapes(hlo) & weight_shapes


def steps_compilations(model, x, steps=2) -> list[int]:
    """The graphs each of `steps` training steps (a gradient step on every
    parameter) compiles."""
    # Earlier tests of this process may have left lazy tensors alive in
    # garbage not yet collected: the first step's sync would compute them too,
    # and its graph would then differ from the second's.
    gc.collect()
    torch_xla.sync()
    counts = []
    for _ in range(steps):
        before = (met.metric_data("CompileTime") or (0,))[0]
        model(x).sum().backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.sub_(parameter.grad, alpha=1e-2)
                parameter.grad = None
        torch_xla.sync()
        counts.append(met.metric_data("CompileTime")[0] - before)
    return counts


def test_layers_stacked_or_unstacked_on_the_device_compile_their_step_once(device):
    # Left lazy, the stacking (or the slicing back) would be part of the
    # first step's graph only, and the second step would compile another.
    layers = nn.ModuleList(blocks(count=3)).to(device)
    torch_xla.sync()
    stack = LayerStack(layers)
    x = torch.randn(BATCH, SEQ, HIDDEN).to(device)  # data, not a graph that draws it
    assert steps_compilations(stack, x)[1] == 0
    unstacked = nn.Sequential(*stack.unstacked())
    assert steps_compilations(unstacked, x)[1] == 0


def test_layers_of_placeholders_stack_into_placeholders_without_running_anything():
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    for layer in layers:
        layer.weight = nn.Parameter(tx.placeholder((4, 4)))
        layer.bias = nn.Parameter(tx.placeholder((4,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sync would discard their stacking, warning
        stack = LayerStack(layers)
    with pytest.raises(tx.PlaceholderError):
        stack.stacked.weight.cpu()
    assert "while" in stack.lower(tx.placeholder((2, 4))).forward_hlo


# ---------------------------------------------------------------------------
# Checkpoints


def test_checkpoints_move_between_module_list_and_layer_stack(device):
    loop_model = make_decoder_stack(LAYERS, HIDDEN, HEADS, "loop", device=device, seed=0)
    scan_model = make_decoder_stack(LAYERS, HIDDEN, HEADS, "scan", device=device, seed=1)
    inputs, _ = make_batch(BATCH, SEQ, HIDDEN, device=device)

    saved = io.BytesIO()
    torch.save({k: v.cpu() for k, v in loop_model.state_dict().items()}, saved)
    saved.seek(0)
    result = scan_model.load_state_dict(torch.load(saved))
    assert not result.missing_keys and not result.unexpected_keys
    close(scan_model(inputs), loop_model(inputs), THROUGH_LAYERS)

    fresh_loop_model = make_decoder_stack(LAYERS, HIDDEN, HEADS, "loop", device=device, seed=2)
    fresh_loop_model.load_state_dict(scan_model.state_dict())
    close(fresh_loop_model(inputs), loop_model(inputs), THROUGH_LAYERS)


class WithBuffers(nn.Module):

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("running", torch.randn(3))
        self.register_buffer("scratch", torch.randn(3), persistent=False)

    def forward(self, x):
        return self.linear(x) + self.running + self.scratch


def test_state_dict_matches_module_list():
    layers = nn.ModuleList(WithBuffers() for _ in range(3))
    stack = LayerStack(layers)
    expected = layers.state_dict()
    actual = stack.state_dict()
    assert list(actual) == list(expected)
    assert "0.scratch" not in actual
    for key, value in expected.items():
        assert torch.equal(actual[key], value)
    assert not actual["1.linear.weight"].requires_grad
    assert stack.state_dict(keep_vars=True)["1.linear.weight"].requires_grad


def test_strict_loading_reports_per_layer_names():
    stack = LayerStack(WithBuffers() for _ in range(2))
    checkpoint = nn.ModuleList(WithBuffers() for _ in range(2)).state_dict()
    del checkpoint["1.linear.weight"]
    checkpoint["2.linear.weight"] = torch.zeros(3, 3)
    checkpoint["0.linear.unknown"] = torch.zeros(3)
    with pytest.raises(RuntimeError) as error:
        stack.load_state_dict(checkpoint)
    assert '"1.linear.weight"' in str(error.value)
    assert '"2.linear.weight"' in str(error.value)

    before = stack[1].linear.weight.clone()
    result = stack.load_state_dict(checkpoint, strict=False)
    assert result.missing_keys == ["1.linear.weight"]
    assert sorted(result.unexpected_keys) == ["0.linear.unknown", "2.linear.weight"]
    assert torch.equal(stack[0].linear.weight, checkpoint["0.linear.weight"])
    assert torch.equal(stack[1].linear.weight, before)
    assert torch.equal(stack[1].running, checkpoint["1.running"])

    checkpoint["1.linear.weight"] = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for 1\.linear\.weight"):
        stack.load_state_dict(checkpoint, strict=False)


def test_whole_module_pickles_and_deep_copies():
    stack = LayerStack(WithBuffers() for _ in range(2))
    saved = io.BytesIO()
    torch.save(stack, saved)
    saved.seek(0)
    for copied in (torch.load(saved, weights_only=False), copy.deepcopy(stack)):
        assert len(copied) == 2
        assert torch.equal(copied[1].linear.weight, stack[1].linear.weight)


# ---------------------------------------------------------------------------
# Per-layer access


def test_layers_are_views_of_the_stacked_tensors():
    layers = [WithBuffers() for _ in range(3)]
    stack = LayerStack(layers)
    assert len(stack) == 3
    assert [name for name, _ in stack.named_parameters()] == [
        "stacked.linear.weight", "stacked.linear.bias"]
    stacked_weight = stack.stacked.linear.weight
    assert stacked_weight.shape == (3, 3, 3)

    view = stack[-1]
    assert type(view) is WithBuffers
    assert view.linear.weight._base is stacked_weight
    assert not isinstance(view.linear.weight, nn.Parameter)
    with torch.no_grad():
        stacked_weight.add_(1.0)
    assert torch.equal(view.linear.weight, layers[2].linear.weight + 1.0)

    x = torch.randn(3)
    for layer, original in zip(stack, layers):
        assert torch.allclose(layer(x), original(x) + x.sum())  # weights + 1
    assert len(stack[1:]) == 2
    with pytest.raises(IndexError, match="Layer index 3 is out of range"):
        stack[3]


def test_per_layer_view_gradients_reach_the_stacked_parameter(device):
    # On the XLA device: a CPU-only backward before torch_xla's first device use
    # leaves autograd's engine without XLA queues for the rest of the process.
    stack = LayerStack(nn.Linear(2, 2) for _ in range(3)).to(device)
    stack[1](torch.ones(2, device=device)).sum().backward()
    grad = stack.stacked.weight.grad.cpu()
    assert grad[1].abs().sum() > 0 and grad[0].abs().sum() == 0 and grad[2].abs().sum() == 0


# ---------------------------------------------------------------------------
# Extra arguments, tuple outputs, train/eval


class TupleLayer(nn.Module):
    """A layer in the Hugging Face style: extra arguments, a tuple returned."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, scale, *, position_ids=None, bias=None, add_bias=True):
        out = hidden + torch.tanh(self.linear(hidden)) * scale
        if position_ids is not None:
            out = out + position_ids.to(out.dtype).unsqueeze(-1) * 0.01
        if add_bias:
            out = out + bias
        return out, out.sum()


@pytest.mark.parametrize("add_bias", [True, False])
def test_extra_arguments_reach_every_layer_and_tuple_outputs_carry_their_first(
    device, add_bias):
    torch.manual_seed(0)
    layers = nn.ModuleList(TupleLayer() for _ in range(3)).to(device)
    stack = LayerStack(copy.deepcopy(layers))
    hidden = torch.randn(BATCH, SEQ, HIDDEN, device=device)
    position_ids = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    bias = torch.randn(HIDDEN, device=device)
    scales = [torch.tensor(0.5, device=device, requires_grad=True) for _ in range(2)]

    expected = hidden
    for layer in layers:
        expected = layer(expected, scales[0], position_ids=position_ids, bias=bias,
                         add_bias=add_bias)[0]
    actual = stack(hidden, scales[1], position_ids=position_ids, bias=bias, add_bias=add_bias)
    expected.sum().backward()
    actual.sum().backward()
    torch_xla.sync()
    close(actual, expected, THROUGH_LAYERS)
    close(scales[1].grad, scales[0].grad, THROUGH_LAYERS)


class DropoutLayer(nn.Module):

    def __init__(self, p=0.5):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return x + self.dropout(self.linear(x))


def test_train_and_eval_modes_trace_separately(device):
    layers = nn.ModuleList(DropoutLayer() for _ in range(2)).to(device)
    stack = LayerStack(copy.deepcopy(layers))
    hidden = torch.randn(BATCH, HIDDEN, device=device)
    layers.eval()
    expected = hidden
    for layer in layers:
        expected = layer(expected)
    with torch.no_grad():
        training_output = stack(hidden)
        eval_output = stack.eval()(hidden)
    assert not stack[0].dropout.training
    torch_xla.sync()
    close(eval_output, expected, THROUGH_LAYERS)
    assert (training_output.cpu() - expected.cpu()).abs().max() > 1e-3


# ---------------------------------------------------------------------------
# Mismatched layers


def with_attribute(module, path, value):
    owner, _, name = path.rpartition(".")
    setattr(module.get_submodule(owner), name, value)
    return module


@pytest.mark.parametrize("layers, error, pattern", [
    ([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)], ValueError,
     r"Layer 2 parameter 'weight' has shape \(3, 4\).*layer 0's has shape \(4, 4\)"),
    ([nn.Linear(4, 4), nn.Linear(4, 4).double()], ValueError,
     r"Layer 1 parameter 'weight' has .*dtype torch.float64.*layer 0's has .*torch.float32"),
    ([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)], ValueError,
     r"Layer 1 differs from layer 0: it lacks parameters/buffers \['bias'\]"),
    ([nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.GELU())],
     TypeError, r"Layer 1 submodule '1' is a GELU but layer 0's is a ReLU"),
    ([DropoutLayer(0.1), DropoutLayer(0.1), DropoutLayer(0.2)], ValueError,
     r"Layer 2 setting 'dropout.p' is 0.2 but layer 0's is 0.1"),
    ([DropoutLayer(), DropoutLayer().eval()], ValueError,
     r"Layer 1 setting 'training' is False but layer 0's is True"),
    ([DecoderBlock(HIDDEN, HEADS),
      with_attribute(DecoderBlock(HIDDEN, HEADS), "input_layernorm.eps", 1e-5)], ValueError,
     r"Layer 1 setting 'input_layernorm.eps' is 1e-05 but layer 0's is 1e-06"),
    ([nn.Linear(4, 4), "not a layer"], TypeError, r"Layer 1 is a str, not an nn.Module"),
], ids=["shape", "dtype", "missing-parameter", "module-type", "dropout-p", "training",
        "eps", "not-a-module"])
def test_mismatched_layers_are_named(layers, error, pattern):
    with pytest.raises(error, match=pattern):
        LayerStack(layers)
    with pytest.raises(error, match=pattern):
        scan_layers(layers, torch.zeros(4))


def test_other_differing_attributes_name_per_layer_attributes():
    layers = [with_attribute(DecoderBlock(HIDDEN, HEADS), "self_attn.block_id", i)
              for i in range(2)]
    with pytest.raises(ValueError, match=r"Layer 1 setting 'self_attn.block_id' is 1 but layer "
                       r"0's is 0.*per_layer_attributes=\('layer_idx', 'block_id'\)"):
        LayerStack(layers)
    stack = LayerStack(layers, per_layer_attributes=["block_id"])
    assert [layer.self_attn.block_id for layer in stack] == [0, 1]


def test_a_setting_that_only_names_its_module_is_kept_per_layer():
    # peft keeps each adapted module's name in the module (kwargs["target_name"]).
    def named(index, path):
        return with_attribute(DecoderBlock(HIDDEN, HEADS), "self_attn.kwargs",
                              {"target_name": f"model.blocks.{index}.{path}", "rank": 4})
    stack = LayerStack([named(index, "self_attn") for index in range(3)])
    assert [layer.self_attn.kwargs["target_name"] for layer in stack] == [
        "model.blocks.0.self_attn", "model.blocks.1.self_attn", "model.blocks.2.self_attn"]
    # A name of another module is a setting like any other.
    with pytest.raises(ValueError, match=r"Layer 1 setting 'self_attn.kwargs' differs from "
                       r"layer 0's in its key 'target_name'"):
        LayerStack([named(0, "self_attn"), named(1, "mlp")])


def test_ignored_attributes_is_deprecated_in_favour_of_per_layer_attributes():
    layers = [with_attribute(DecoderBlock(HIDDEN, HEADS), "self_attn.block_id", i)
              for i in range(2)]
    with pytest.warns(DeprecationWarning,
                      match=r"ignored_attributes=\.\.\.\) is deprecated: pass "
                            r"per_layer_attributes=\('block_id',\)"):
        stack = LayerStack(layers, ignored_attributes=["block_id"])
    assert [layer.self_attn.block_id for layer in stack] == [0, 1]


def test_shared_parameters_are_refused():
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"Layer 1 parameter '0.weight' is the same tensor"):
        LayerStack([nn.Sequential(shared), nn.Sequential(shared)])


def test_empty_stack_returns_its_input():
    hidden = torch.randn(2)
    stack = LayerStack(nn.ModuleList())
    assert len(stack) == 0 and list(stack) == [] and stack.state_dict() == {}
    assert stack(hidden, "ignored", mask=None) is hidden
    assert scan_layers([], hidden) is hidden


# ---------------------------------------------------------------------------
# Layers alike in what they compute: functions, partials, methods, configs


def tanh_of_scaled(scale):
    return lambda x: torch.tanh(x * scale)


def tanh_with_default(scale):
    def act(x, scale=scale):
        return torch.tanh(x * scale)
    return act


class Scaler:
    """A plain settings object whose bound method serves as an activation."""

    def __init__(self, factor):
        self.factor = factor

    def apply(self, x):
        return x * self.factor


class ActLayer(nn.Module):

    def __init__(self, act, config=None):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.act = act
        self.config = config

    def forward(self, x):
        return x + self.act(self.linear(x))


class ClosesOverItself(nn.Module):

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.act = lambda x: self.linear(x).relu()

    def forward(self, x):
        return self.act(x)


class Offset(nn.Module):
    """Holds a plain tensor attribute, not a registered buffer."""

    def __init__(self, offset):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.offset = offset

    def forward(self, x):
        return self.linear(x) + self.offset


def config(theta):
    return types.SimpleNamespace(eps=1e-6, rope={"theta": theta, "type": "default"})


@pytest.mark.parametrize("layers, pattern", [
    ([ActLayer(tanh_of_scaled(1.0)), ActLayer(tanh_of_scaled(5.0))],
     r"Layer 1 setting 'act' differs from layer 0's in its closure variable 'scale': 5.0 in "
     r"layer 1 but 1.0 in layer 0"),
    ([ActLayer(tanh_with_default(1.0)), ActLayer(tanh_with_default(5.0))],
     r"Layer 1 setting 'act' differs from layer 0's in its default of 'scale': 5.0 in layer 1"),
    ([ActLayer(functools.partial(F.leaky_relu, negative_slope=0.1)),
      ActLayer(functools.partial(F.leaky_relu, negative_slope=0.2))],
     r"Layer 1 setting 'act' differs .* keyword 'negative_slope' of the partial: 0.2 in layer 1 "
     r"but 0.1 in layer 0"),
    ([ActLayer(Scaler(2.0).apply), ActLayer(Scaler(2.0).apply), ActLayer(Scaler(3.0).apply)],
     r"Layer 2 setting 'act' differs .* self of the method → attribute 'factor': 3.0"),
    ([ActLayer(torch.tanh, config(1e4)), ActLayer(torch.tanh, config(5e5))],
     r"Layer 1 setting 'config' differs .* attribute 'rope' → key 'theta': 500000.0 in layer 1 "
     r"but 10000.0 in layer 0"),
    ([ActLayer(torch.tanh), ActLayer(torch.sigmoid)],
     r"Layer 1 setting 'act' is <built-in method sigmoid.* but layer 0's is <built-in method tanh"),
    ([Offset(torch.zeros(4)), Offset(torch.zeros(4))],
     r"Layer 1 setting 'offset' is the Tensor object at .*very same object in every layer"),
    ([ClosesOverItself(), ClosesOverItself()],
     r"Layer 0 setting 'act' refers to the layer's own module '' through a function's closure "
     r"or defaults, which the stack's copy of layer 0 shares rather than copies"),
    # An RNN keeps weak references to its own weights, which functional_call cannot swap.
    ([nn.GRU(4, 4), nn.GRU(4, 4)],
     r"Layer 0 setting '_flat_weight_refs' refers to the layer's own tensor 'weight_ih_l0' "
     r"through a weak reference"),
], ids=["lambda-closure", "function-default", "partial", "bound-method", "config-object",
        "builtin", "unregistered-tensor", "closure-over-layer", "rnn-weak-references"])
def test_layers_that_compute_differently_are_refused(layers, pattern):
    with pytest.raises(ValueError, match=pattern):
        LayerStack(layers)
    with pytest.raises(ValueError, match=pattern):
        scan_layers(layers, torch.zeros(4))


def test_layers_built_alike_run_as_the_loop(device):
    """Distinct but equal functions, partials, bound methods and config objects are
    one computation; a tensor attribute all layers share is read at every call."""
    shared_offset = torch.zeros(4, device=device)

    def build():
        return nn.Sequential(ActLayer(tanh_of_scaled(2.0), config(1e4)),
                             ActLayer(functools.partial(F.leaky_relu, negative_slope=0.1)),
                             ActLayer(Scaler(0.5).apply), Offset(shared_offset))

    torch.manual_seed(0)
    layers = nn.ModuleList(build() for _ in range(3)).to(device)
    stack = LayerStack(copy.deepcopy(layers, {id(shared_offset): shared_offset}))
    hidden = torch.randn(BATCH, 4, device=device)
    for _ in range(2):
        expected = loop(layers, hidden)
        actual, drop_in = stack(hidden), scan_layers(layers, hidden)
        torch_xla.sync()
        close(actual, expected, THROUGH_LAYERS)
        close(drop_in, expected, THROUGH_LAYERS)
        with torch.no_grad():
            shared_offset.add_(1.0)


def test_torch_transformer_encoder_layers_match_the_loop(device):
    """torch's own layer: its activation is a function attribute, its mask a keyword."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0,
                                                      batch_first=True)
                           for _ in range(3)).to(device)
    stack = LayerStack(copy.deepcopy(layers))
    hidden, _ = make_batch(BATCH, SEQ, HIDDEN, device=device)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ, device=device)
    expected = loop(layers, hidden, src_mask=mask, is_causal=True)
    actual = stack(hidden, src_mask=mask, is_causal=True)
    expected.sum().backward()
    actual.sum().backward()
    layers.eval()
    with torch.no_grad():
        expected_eval, actual_eval = loop(layers, hidden), stack.eval()(hidden)
    torch_xla.sync()
    close(actual, expected, THROUGH_LAYERS)
    close(actual_eval, expected_eval, THROUGH_LAYERS)
    for index, layer in enumerate(layers):
        close(stack.stacked.linear1.weight.grad[index], layer.linear1.weight.grad, THROUGH_LAYERS)


# ---------------------------------------------------------------------------
# Per-layer attributes: an index that only picks a cache slot


def loop(layers, hidden, *args, **kwargs):
    for layer in layers:
        output = layer(hidden, *args, **kwargs)
        hidden = output[0] if isinstance(output, tuple) else output
    return hidden


class KVCache:
    """A cache object in the manner of transformers' DynamicCache: not a pytree."""

    def __init__(self):
        self.entries = {}

    def update(self, value, layer_idx):
        self.entries[layer_idx] = value
        return value


class CacheLayer(nn.Module):
    """Like a transformers attention layer: `layer_idx` only picks its cache slot."""

    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, cache=None):
        out = hidden + torch.tanh(self.linear(hidden))
        if cache is None:
            return out
        return cache.update(out, self.layer_idx) * 0.5, cache


class IndexedLayer(CacheLayer):
    """A layer whose computation depends on its index."""

    def forward(self, hidden):
        return hidden + torch.tanh(self.linear(hidden)) * (1 + self.layer_idx)


def cache_layers(device, layer_type=CacheLayer):
    torch.manual_seed(0)
    layers = nn.ModuleList(layer_type(index) for index in range(3)).to(device)
    return layers, LayerStack(copy.deepcopy(layers))


def test_cache_index_differs_per_layer_and_runs_as_one_scan(device):
    layers, stack = cache_layers(device)
    assert [layer.layer_idx for layer in stack] == [0, 1, 2]
    assert [type(layer) for layer in stack] == [CacheLayer] * 3
    hidden = torch.randn(BATCH, HIDDEN, device=device)
    expected = loop(layers, hidden)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        actual = stack(hidden)
        drop_in = scan_layers(layers, hidden)
    assert "while" in torch_xla._XLAC._get_xla_tensors_hlo([actual, drop_in])
    torch_xla.sync()
    close(actual, expected, THROUGH_LAYERS)
    close(drop_in, expected, THROUGH_LAYERS)


def test_cache_object_runs_layer_by_layer_with_each_layers_index(device):
    layers, stack = cache_layers(device)
    hidden = torch.randn(BATCH, HIDDEN, device=device)
    caches = [KVCache() for _ in range(3)]
    expected = loop(layers, hidden, caches[0])
    with pytest.warns(LayerByLayerWarning, match=r"args\[0\] is of type KVCache"):
        actual = stack(hidden, caches[1])
    with pytest.warns(LayerByLayerWarning, match=r"input_data\[1\] is of type KVCache"):
        drop_in, _ = scan_layers(layers, (hidden, caches[2]))
    expected.sum().backward()
    actual.sum().backward()
    torch_xla.sync()
    close(actual, expected, THROUGH_LAYERS)
    close(drop_in, expected, THROUGH_LAYERS)
    for cache in caches[1:]:
        assert sorted(cache.entries) == [0, 1, 2]
        for index, value in cache.entries.items():
            close(value, caches[0].entries[index], THROUGH_LAYERS)
    for index, layer in enumerate(layers):
        close(stack.stacked.linear.weight.grad[index], layer.linear.weight.grad, THROUGH_LAYERS)


def test_layer_that_reads_its_index_runs_layer_by_layer(device):
    layers, stack = cache_layers(device, IndexedLayer)
    hidden = torch.randn(BATCH, HIDDEN, device=device)
    expected = loop(layers, hidden)
    for _ in range(2):  # the second call knows without tracing again
        misses = tx.cache_info().misses
        with pytest.warns(LayerByLayerWarning, match=r"the layer reads \['layer_idx'\]"):
            actual = stack(hidden)
        with pytest.warns(LayerByLayerWarning, match=r"the layer reads \['layer_idx'\]"):
            drop_in = scan_layers(layers, hidden)
        torch_xla.sync()
        close(actual, expected, THROUGH_LAYERS)
        close(drop_in, expected, THROUGH_LAYERS)
    assert tx.cache_info().misses == misses
    assert type(stack._template) is IndexedLayer


# ---------------------------------------------------------------------------
# scan_layers, the drop-in


def test_scan_layers_matches_for_loop(device):
    torch.manual_seed(0)
    layers = nn.ModuleList(blocks(3)).to(device)
    twins = copy.deepcopy(layers)
    hidden, _ = make_batch(BATCH, SEQ, HIDDEN, device=device)
    expected = hidden
    for layer in layers:
        expected = layer(expected)
    actual = scan_layers(twins, hidden)
    expected.sum().backward()
    actual.sum().backward()
    torch_xla.sync()
    close(actual, expected, THROUGH_LAYERS)
    for layer, twin in zip(layers, twins):
        for (name, param), twin_param in zip(layer.named_parameters(), twin.parameters()):
            close(twin_param.grad, param.grad, THROUGH_LAYERS)

    misses = tx.cache_info().misses
    scan_layers(twins, hidden)
    assert tx.cache_info().misses == misses, "a second call re-traced the layer"


class ThreeInputs(nn.Module):
    """forward(x, y, z) returning the next layer's (x, y, z)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y, z):
        return torch.tanh(self.linear(x)) + y, y * 0.5, z + x.mean(-1, keepdim=True)


def test_scan_layers_passes_a_tuple_as_the_layers_arguments(device):
    from torch_xla.experimental.scan_layers import scan_layers as torch_xla_scan_layers
    torch.manual_seed(0)
    layers = nn.ModuleList(ThreeInputs() for _ in range(3)).to(device)
    x = torch.randn(BATCH, HIDDEN, device=device, requires_grad=True)
    inputs = (x, torch.randn(BATCH, HIDDEN, device=device), torch.randn(BATCH, 1, device=device))
    expected = inputs
    for layer in layers:
        expected = layer(*expected)
    results = [expected, scan_layers(layers, inputs), torch_xla_scan_layers(layers, inputs)]
    weights = [x, *(layer.linear.weight for layer in layers)]
    grads = [torch.autograd.grad(sum(out.sum() for out in result), weights)
             for result in results]
    torch_xla.sync()
    for result, result_grads in zip(results[1:], grads[1:]):
        assert isinstance(result, tuple) and len(result) == 3
        for out, expected_out in zip(result, expected):
            close(out, expected_out, THROUGH_LAYERS)
        for grad, expected_grad in zip(result_grads, grads[0]):
            close(grad, expected_grad, THROUGH_LAYERS)


def test_rms_norm_normalizes():
    norm = RMSNorm(4)
    x = torch.tensor([[3.0, -3.0, 3.0, -3.0]])
    torch.testing.assert_close(norm(x), torch.tensor([[1.0, -1.0, 1.0, -1.0]]))


def test_an_opaque_per_layer_value_is_recorded_when_used_and_acts_as_its_stand_in():
    from torch_xla_ext.layer_stack.per_layer import OpaqueValue

    reads = set()
    index = OpaqueValue("layer_idx", reads, 1)
    handed_on = {"index": index}  # passing it on is not a use
    assert handed_on["index"] is index and "layer_idx" in repr(index) and not reads
    for use, expected in ((lambda: index == 0, False), (lambda: [0, 1][index], 1),
                          (lambda: index + 1, 2), (lambda: 3 - index, 2),
                          (lambda: f"{index}", "1"), (lambda: hash(index), hash(1)),
                          (lambda: bool(index), True), (lambda: index.bit_length(), 1)):
        reads.clear()
        assert use() == expected
        assert reads == {"layer_idx"}


def test_a_layer_that_catches_everything_still_has_its_index_read_refused(device):
    # Nothing is raised in the layer's code when it reads a per-layer
    # attribute, so not even a catch-all `except` of its own hides the read.
    class Guarded(CacheLayer):
        def forward(self, hidden):
            try:
                scale = 1 + self.layer_idx
            except BaseException:
                scale = 1
            return hidden + torch.tanh(self.linear(hidden)) * scale

    layers, stack = cache_layers(device, Guarded)
    hidden = torch.randn(BATCH, HIDDEN, device=device)
    with pytest.warns(LayerByLayerWarning, match=r"the layer reads \['layer_idx'\]"):
        actual = stack(hidden)
    close(actual, loop(layers, hidden), THROUGH_LAYERS)


def test_a_stack_on_the_cpu_runs_its_layers_one_by_one_saying_why():
    # The scan is an XLA loop: on another device the stack is its for loop.
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    stack, x = LayerStack(copy.deepcopy(layers)), torch.randn(2, 8)
    with pytest.warns(LayerByLayerWarning, match="the layers run on cpu, and the scan is an XLA "
                                                 "loop"):
        out = stack(x)
    expected = x
    for layer in layers:
        expected = layer(expected)
    close(out, expected, THROUGH_LAYERS)
