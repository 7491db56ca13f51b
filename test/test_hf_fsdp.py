"""FSDPv2 as transformers' Trainer wraps a model (`wrap_model_xla_fsdp` with
`fsdp_config={"xla": True, "xla_fsdp_v2": True, "transformer_layer_cls_to_wrap":
[...]}`) around a model converted by stack_layers, on 4 virtual devices: the
unconverted model's losses, its activation sharding (every device its part of
the batch, inside the loops too) and no more bytes per device.

The Trainer's own FSDPv2 path is not run: in transformers 5.23 it fails before
training on an unconverted model too (its optimizer is still None when the
scheduler is made), so the wrapping function is called as the Trainer calls it."""

import copy
import functools
import math
import os
import re
import tempfile
import warnings

import numpy as np
import torch
import torch_xla

import per_layer

from optimized_hlo import dump_flags, loop_states, step_module
from support import supports
from tolerances import TRAINING, close


def tiles(tensor) -> list[int]:
    """How many pieces each dimension of `tensor` is cut into ([] when replicated)."""
    found = re.search(r"devices=\[([\d,]+)\]", torch_xla._XLAC._get_xla_sharding_spec(tensor))
    return [int(n) for n in found.group(1).split(",")] if found else []


# SPMD needs a process of its own (xr.use_spmd() before any XLA tensor).
def wrapped_as_the_trainer_does_scenario():
    """test_hf's small Llama, unconverted and converted, each wrapped as the Trainer wraps
    it for FSDPv2, trains two SGD steps alike; the converted step's loops keep each
    device's part of the batch and it holds no more bytes per device."""
    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs
    import transformers
    from transformers.integrations.tpu import wrap_model_xla_fsdp
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel
    from torch_xla_ext import LayerStack
    from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy
    from torch_xla_ext.layer_stack.sharding import ShardingWarning
    from test_hf import converted_pair

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4,), ("fsdp",))
    xs.set_global_mesh(mesh)  # as the Trainer does with xla_fsdp_v2
    device = torch_xla.device()

    reference, model = converted_pair(layers=3)  # test_hf's small Llama, unconverted and converted
    reference.to(device).train()
    model.to(device).train()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), fsdp=True, report_to=[],
        fsdp_config={"xla": True, "xla_fsdp_v2": True,
                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = wrap_model_xla_fsdp(model, args, True)
    assert isinstance(wrapped, SpmdFullyShardedDataParallel), type(wrapped)
    # What a unit per layer adds, the stack does: nothing to warn about.
    assert not [w for w in caught if issubclass(w.category, ShardingWarning)], caught
    stacked = per_layer.stacked_of(model)
    assert len(stacked) == 9, sorted(stacked)
    for name, param in stacked.items():
        # The layer dimension whole, one other cut across the 4 devices (FSDP).
        assert tiles(param)[0] == 1 and math.prod(tiles(param)) == 4, (name, tiles(param))
    assert tiles(model.model.embed_tokens.weight), "the rest of the model is not sharded"
    wrapped_reference = wrap_model_xla_fsdp(reference, args, True)  # a unit per layer

    ids = torch.randint(0, 128, (4, 8))
    losses = {}
    for which in (wrapped_reference, wrapped):
        # SGD: the second step's graph is the first's (AdamW's first step differs).
        optimizer = torch.optim.SGD(which.parameters(), lr=0.5)
        inputs = ids.to(device)
        xs.mark_sharding(inputs, mesh, ("fsdp", None))  # as the Trainer's data loader does
        for step in range(2):
            loss = which(inputs, labels=inputs).loss
            loss.backward()
            if which is wrapped and step == 0:
                hlo = torch_xla._XLAC._get_xla_tensors_hlo(
                    [loss, *per_layer.stacked_grads_of(model).values()])
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.setdefault(which is wrapped, []).append(loss.cpu())
    assert "while" in hlo, "the stacked layers do not run as one loop"
    close(losses[True], losses[False], TRAINING)
    converted, unconverted = (step_module(os.environ["DUMP"], looped) for looped in (True, False))
    assert converted.bytes_used <= unconverted.bytes_used, (converted.bytes_used,
                                                            unconverted.bytes_used)
    states = loop_states(converted.optimized_hlo)
    assert len(states) == 2, states
    for state in states:  # [batch 4 / 4 devices, sequence, hidden], never the whole batch
        assert "f32[1,8,32]" in state and "f32[4,8,32]" not in state, state
    # The attention probabilities the forward loop saves, [layers, batch, heads, seq, seq].
    assert "f32[3,1,4,8,8]" in states[0] and "f32[3,4,4,8,8]" not in states[0], states[0]
    # The reference's units hold its layers as `_orig_module`.
    reference_state = {name.replace("._orig_module", ""): value
                       for name, value in reference.state_dict().items()}
    state = dict(wrapped.module.state_dict())
    assert list(state) == list(reference_state)
    close(state, reference_state, TRAINING)
    for name, param in stacked.items():
        assert tiles(param)[0] == 1 and math.prod(tiles(param)) == 4, (name, tiles(param))

    # A stack whose layer dimension is each weight's largest: FSDPv2 (which cuts
    # a weight's largest dimension) still cuts another one.
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = LayerStack([torch.nn.Linear(1, 2) for _ in range(8)])

        def forward(self, x):
            return self.stack(x)

    holder = Holder()
    SpmdFullyShardedDataParallel(holder)
    assert tiles(holder.stack.stacked.weight)[:2] == [1, 4], tiles(holder.stack.stacked.weight)
    assert tiles(holder.stack.stacked.bias) == [1, 4], tiles(holder.stack.stacked.bias)
    # The size-based policy (transformers' min_num_params) keeps the stack whole
    # for the unit that holds it (its `stacked` holder has no forward to wrap).
    holder = Holder()
    SpmdFullyShardedDataParallel(holder, auto_wrap_policy=functools.partial(
        size_based_auto_wrap_policy, min_num_params=1))
    assert type(holder.stack) is LayerStack and tiles(holder.stack.stacked.weight)[:2] == [1, 4]
    print("matched", [round(loss.item(), 5) for loss in losses[True]])


@supports("sharded", "llama")
def test_wrapped_as_the_trainer_does_shards_stacked_weights_and_trains_like_unsharded(
        run_isolated, tmp_path):
    flags = dump_flags(tmp_path)
    result = run_isolated(wrapped_as_the_trainer_does_scenario, env={
        "CPU_NUM_DEVICES": "4", "XLA_FLAGS": flags, "DUMP": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matched" in result.stdout, result.stdout


# Gemma3's layer kinds that differ in structure (another activation on full
# attention) as one scan over groups of the pattern, with transformers'
# xla_fsdp_grad_ckpt.
def kinds_wrapped_as_the_trainer_does_scenario():
    """Gemma3's layer kinds, converted and wrapped with xla_fsdp_grad_ckpt, train a step
    as the unconverted model does."""
    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs
    import transformers
    from transformers.integrations.tpu import wrap_model_xla_fsdp
    from torch_xla_ext.hf import stack_layers
    from torch_xla_ext.layer_stack.sharding import ShardingWarning

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4,), ("fsdp",))
    xs.set_global_mesh(mesh)
    device = torch_xla.device()

    SLIDING, FULL = "sliding_attention", "full_attention"
    torch.manual_seed(0)
    reference = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, use_cache=False,
        num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2))
    for layer_type, layer in zip(reference.config.layer_types, reference.model.layers):
        if layer_type == FULL:
            layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    model = stack_layers(copy.deepcopy(reference))
    assert [(segment.period, segment.groups) for segment in model.model.layers.plan] == [(2, 2)]
    reference.to(device).train()
    model.to(device).train()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), fsdp=True, report_to=[],
        fsdp_config={"xla": True, "xla_fsdp_v2": True,
                     "transformer_layer_cls_to_wrap": ["Gemma3DecoderLayer"],
                     "xla_fsdp_grad_ckpt": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = wrap_model_xla_fsdp(model, args, True)
    # Checkpointing each unit does not reach stacked layers, which are no units: said.
    assert [w for w in caught if issubclass(w.category, ShardingWarning)
            and "auto_wrapper_callable" in str(w.message)], [str(w.message) for w in caught]
    stacked = per_layer.stacked_of(model)
    assert len(stacked) == 2 * 13, sorted(stacked)
    for name, param in stacked.items():
        assert tiles(param)[0] == 1 and math.prod(tiles(param)) == 4, (name, tiles(param))
    ids = torch.randint(0, 128, (4, 8))
    losses = []
    for which in (reference, wrapped):
        inputs = ids.to(device)
        if which is wrapped:
            xs.mark_sharding(inputs, mesh, ("fsdp", None))
        loss = which(inputs, labels=inputs).loss
        loss.backward()
        torch_xla.sync()
        losses.append(loss.cpu())
    close(losses[1], losses[0], TRAINING)
    for name, grad in per_layer.stacked_grads_of(model).items():
        assert grad is not None, name
    print("matched", losses[1].item())


@supports("sharded", "gemma3")
def test_layer_kinds_in_a_few_scans_wrapped_as_the_trainer_does(run_isolated):
    result = run_isolated(kinds_wrapped_as_the_trainer_does_scenario, env={"CPU_NUM_DEVICES": "4"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matched" in result.stdout, result.stdout
