"""stack_layers on T5, whose loop hands the position biases the first layer
computes on to the others (`hidden_states, self_attention_position_bias,
cross_attention_position_bias = layer_module(...)`, then `position_bias =
self_attention_position_bias`): block 0, the one with the relative attention
bias, is a segment of its own that runs as itself, and the other blocks a run
that is one scan per layer list, against the same model unconverted; and the
same for small models of such loops."""
import copy
import functools
import warnings

import pytest
import torch
import torch_xla
import torch_xla.utils.checkpoint as xla_checkpoint
import transformers
from torch import nn

from layer_calls import forward_with_warnings
from support import supports
from test_hf import per_layer_grads, seeded_generate
from tolerances import TRAINING, close
from torch_xla_ext.hf.cache_plan import CACHE_REASON
from torch_xla_ext.hf import StackedLayers, stack_layers, unstack_layers
from torch_xla_ext import policies
from torch_xla_ext.layer_stack import LayerByLayerWarning, executors
from torch_xla_ext.layer_stack.segments import Segment

VOCAB, SEQ, BATCH = 128, 6, 2
LISTS = ("encoder.block", "decoder.block")


def t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4,
        d_kv=8, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def tokens(device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator).to(device)


def run_training_step(model, ids, **options):
    """The loss, the number of While loops in its graph and the LayerByLayerWarnings."""
    model.to(ids.device).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(input_ids=ids, labels=ids, **options).loss
    loss.backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
    torch_xla.sync()
    model.cpu()  # the gradients too: compared on the host
    return loss.cpu(), hlo.count(" while("), [str(each.message) for each in caught
                                              if each.category is LayerByLayerWarning]


@supports("training", "t5")
def test_t5_training_matches_the_unconverted_model(device):
    reference = t5()
    model = stack_layers(copy.deepcopy(reference))
    for path in LISTS:
        # Block 0 holds the relative attention bias: a layer of its own, then a run of 2.
        stack = model.get_submodule(path)
        assert type(stack) is StackedLayers and len(stack) == 3
        assert stack.plan == (Segment(0, 1, 1), Segment(1, 1, 2))
    assert model.state_dict().keys() == reference.state_dict().keys()

    ids = tokens(device)
    # Without a key/value cache: T5's decoder makes an EncoderDecoderCache otherwise.
    expected, loops_before, _ = run_training_step(reference, ids, use_cache=False)
    loss, loops_after, one_by_one = run_training_step(model, ids, use_cache=False)
    close(loss, expected, TRAINING)
    assert loops_after == loops_before + 2  # a scan of layers 1-2 of each list
    assert not one_by_one
    expected_grads, grads = per_layer_grads(reference), per_layer_grads(model)
    assert grads.keys() == expected_grads.keys()
    # Layer 0's relative_attention_bias gets the gradients of every layer's use of the bias.
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in grads
    for name, grad in grads.items():
        close(grad, expected_grads[name], TRAINING)

    # An optimizer's state dict names and orders the parameters as unconverted.
    states = []
    for which in (reference, model):
        optimizer = torch.optim.SGD(which.named_parameters(), lr=0.1, momentum=0.9)
        optimizer.step()
        states.append(optimizer.state_dict())
    (group,), (stacked_group,) = (state["param_groups"] for state in states)
    assert stacked_group["param_names"] == group["param_names"]
    expected_state, state = (each["state"] for each in states)
    assert state.keys() == expected_state.keys()
    for index, expected_buffers in expected_state.items():
        close(state[index]["momentum_buffer"], expected_buffers["momentum_buffer"], TRAINING)


def test_t5_per_layer_hidden_states_match_the_unconverted_model(device):
    reference = t5()
    model = stack_layers(copy.deepcopy(reference))
    ids = tokens(device)
    outputs = []
    for which in (reference, model):
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            outputs.append(which.to(device).eval()(input_ids=ids, labels=ids, use_cache=False,
                                                   output_hidden_states=True))
    for name in ("encoder_hidden_states", "decoder_hidden_states"):
        expected, actual = (output[name] for output in outputs)
        assert len(actual) == len(expected) == 4
        close(actual, expected, TRAINING)


@supports("default cache", "t5")
def test_t5_training_with_the_default_cache_is_a_scan_per_list(device):
    # The decoder's empty EncoderDecoderCache: block 0 fills its slot, the scan
    # of blocks 1-2 records theirs and fills them after the loop.
    reference = t5()
    model = stack_layers(copy.deepcopy(reference))
    ids = tokens(device)
    expected, _, _ = run_training_step(reference, ids)
    loss, loops, one_by_one = run_training_step(model, ids)
    close(loss, expected, TRAINING)
    assert loops == 2 and not one_by_one
    expected_grads = per_layer_grads(reference)
    for name, grad in per_layer_grads(model).items():
        close(grad, expected_grads[name], TRAINING)


@supports("generate", "t5")
def test_t5_greedy_generation_matches_the_unconverted_model(device):
    reference = t5()
    model = stack_layers(copy.deepcopy(reference))
    ids = tokens(device, seed=2)
    mask = torch.ones_like(ids)
    expected = seeded_generate(reference, ids, mask, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert seeded_generate(model, ids, mask, do_sample=False) == expected
    # The encoder and the prefill (an empty EncoderDecoderCache) are scans; the
    # decoding step, whose cache holds tokens, runs the decoder's blocks one by one.
    one_by_one = [str(each.message) for each in caught if each.category is LayerByLayerWarning]
    assert len(one_by_one) == 1 and CACHE_REASON in one_by_one[0]


def test_unstack_layers_and_state_dicts_of_t5(device):
    reference = t5()
    expected = reference.state_dict()
    model = stack_layers(copy.deepcopy(reference))
    stack = model.encoder.block
    assert stack[0] is stack.segments[0]  # held as itself
    assert stack[-1].layer[0].SelfAttention.q.weight.shape == (32, 32)
    assert stack.segments[1].storage.stacked["layer.0.SelfAttention.q.weight"].shape == (2, 32, 32)
    assert list(stack.state_dict()) == list(reference.encoder.block.state_dict())
    assert torch.equal(stack[2].layer[1].DenseReluDense.wi.weight,
                       expected["encoder.block.2.layer.1.DenseReluDense.wi.weight"])
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())

    # An unconverted checkpoint loads into the stacked model, layer by layer.
    other = t5()
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1.0)
    assert not model.load_state_dict(other.state_dict()).missing_keys
    assert torch.equal(model.decoder.block[1].layer[2].DenseReluDense.wo.weight,
                       other.decoder.block[1].layer[2].DenseReluDense.wo.weight)
    incompatible = model.load_state_dict({"encoder.block.2.layer.0.SelfAttention.q.weight":
                                          expected["encoder.block.2.layer.0.SelfAttention.q.weight"],
                                          "encoder.block.3.extra": torch.zeros(1)}, strict=False)
    assert "encoder.block.3.extra" in incompatible.unexpected_keys
    assert "encoder.block.1.layer.0.SelfAttention.q.weight" in incompatible.missing_keys

    model.load_state_dict(expected)
    stack_layers(model)  # stacked already: nothing to do
    unstack_layers(model, path="encoder.block")
    assert type(model.encoder.block) is nn.ModuleList
    assert type(model.decoder.block) is StackedLayers
    unstack_layers(model)
    for path in LISTS:
        assert type(model.get_submodule(path)) is nn.ModuleList
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())


class Block(nn.Module):
    """Adds a bias that the first block computes and hands on (or, `recomputed`, each block)."""

    def __init__(self, recomputed=False):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(4), nn.Linear(4, 4)
        self.recomputed = recomputed

    def forward(self, x, scale, bias=None):
        if bias is None or self.recomputed:
            bias = x.mean(dim=-1, keepdim=True)
        return self.linear(self.norm(x)) * scale + bias, bias


class HandsBack(nn.Module):
    def __init__(self, recomputed=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(recomputed) for _ in range(3))

    def forward(self, x):
        bias = None
        scale = 0.5
        for block in self.blocks:
            x, returned = block(x, scale, bias)
            if scale:
                bias = returned
        return x


class HandsBackUnderASetting(HandsBack):
    """Hands the bias back under a test of its own settings alone (a plain
    value of the owner, which each kind of call is planned by)."""
    hands_on = True

    def forward(self, x):
        bias = None
        for block in self.blocks:
            x, returned = block(x, 0.5, bias)
            if self.hands_on:
                bias = returned
        return x


@pytest.mark.parametrize("loop, recomputed", [(HandsBack, False), (HandsBack, True),
                                              (HandsBackUnderASetting, False)],
                         ids=["hands-back", "recomputed", "under-a-setting"])
def test_a_loop_that_hands_back_what_layers_return(device, loop, recomputed):
    reference = loop(recomputed).to(device)
    model = stack_layers(copy.deepcopy(reference))
    # The blocks are alike: one segment. Block 0 gets no bias and computes it,
    # the others hand it back as they got it (or, recomputed, each computes
    # the bias the next gets, which the scan carries with the hidden state):
    # block 0 runs as itself, the others as one scan that gets block 0's bias.
    assert type(model.blocks) is StackedLayers and model.blocks.plan == (Segment(0, 1, 3),)
    x = torch.randn(2, 4, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    close(output, reference(x), TRAINING)
    assert not one_by_one and loops == 1


def test_a_setting_of_the_owner_plans_its_calls_anew(device, monkeypatch):
    # Each kind of call is planned once; the owner's plain settings are part of
    # the kind: without the bias handed on, every block computes its own, and
    # the three are one scan.
    reference = HandsBackUnderASetting().to(device)
    model = stack_layers(copy.deepcopy(reference))
    scanned = []
    scan_run = StackedLayers.scan_run
    monkeypatch.setattr(StackedLayers, "scan_run", lambda stack, run, *args: (
        scanned.append((run.start, run.stop)), scan_run(stack, run, *args))[1])
    x = torch.randn(2, 4, device=device)
    assert forward_with_warnings(model, x)[1:] == (1, []) and scanned == [(1, 3)]
    for which in (reference, model):
        which.hands_on = False
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one and scanned == [(1, 3), (0, 3)]
    close(output, reference(x), TRAINING)


class Rescales(HandsBack):
    """Scales what it hands back: each block gets another bias."""

    def forward(self, x):
        bias = None
        for block in self.blocks:
            x, returned = block(x, 0.5, bias)
            bias = returned * 2
        return x


class Clamps(HandsBack):
    """Calls something on what it hands back."""

    def forward(self, x):
        bias = None
        for block in self.blocks:
            x, returned = block(x, 0.5, bias)
            bias = returned
            bias = bias.clamp(min=0)
        return x


@pytest.mark.parametrize("loop", [Rescales, Clamps])
def test_a_loop_that_changes_what_it_hands_back_scans_with_a_bias_per_layer(device, loop):
    # The forward works on what a layer handed back, not on the hidden state:
    # blocks 1-2 are one scan that gets each block's bias (stacked), given
    # once the last of them is known.
    reference = loop().to(device)
    model = stack_layers(copy.deepcopy(reference))
    x = torch.randn(2, 4, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    close(output, reference(x), TRAINING)


@supports("gradient checkpointing", "t5")
def test_t5_gradient_checkpointing_recomputes_block_0_and_the_scan(device, monkeypatch):
    # The unconverted oracle checkpoints its blocks with torch_xla's checkpoint
    # (torch's fails on XLA); converted, the scan recomputes under save_nothing
    # and block 0, which runs by itself, under torch_xla's checkpoint.
    reference = t5()
    reference._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=functools.partial(
        xla_checkpoint.checkpoint, use_reentrant=True))
    model = stack_layers(copy.deepcopy(t5()))
    model.gradient_checkpointing_enable()  # torch's checkpoint, non-reentrant: transformers' default
    checkpointed, partition_fns = [], []
    monkeypatch.setattr(xla_checkpoint, "checkpoint", recording(xla_checkpoint.checkpoint,
                                                                checkpointed))
    monkeypatch.setattr(executors, "scan", recording(executors.scan, partition_fns))
    ids = tokens(device)
    expected, _, _ = run_training_step(reference, ids, use_cache=False)
    expected_grads = per_layer_grads(reference)
    checkpointed.clear()
    loss, loops, one_by_one = run_training_step(model, ids, use_cache=False)
    close(loss, expected, TRAINING)
    assert loops == 2 and not one_by_one
    assert len(checkpointed) == 2  # block 0 of the encoder and of the decoder
    assert [each["partition_fn"] for each in partition_fns] == [policies.save_nothing] * 2
    for name, grad in per_layer_grads(model).items():
        close(grad, expected_grads[name], TRAINING)


def recording(function, calls: list):
    """`function`, appending the keyword arguments of each call to `calls`."""
    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return function(*args, **kwargs)
    return recorded
