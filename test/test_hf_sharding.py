"""A converted model under a user's own `mark_sharding`, on 4 virtual devices:
trained on a 2-D mesh ('fsdp' x 'model', tensor-parallel weights, the batch on
'fsdp') with the unconverted model's losses, each device's part of the batch
inside the loops and no more bytes per device; decoding with tensor-parallel
stacked weights (`tx.generate` and `generate()`) gives the unconverted
model's tokens, its stacked key/value cache split on the heads as the
unconverted per-layer caches are, in no more bytes per device."""
import copy
import math
import os
import re

import numpy as np
import torch
import torch_xla

from optimized_hlo import dump_flags, loop_states, step_module
from support import supports
from tolerances import TRAINING, close

# Tensor parallelism: the output features of these on 'model' (column-parallel),
# the input features of the others (row-parallel).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens",
                   "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_by_hand(model, mesh, other_axis) -> None:
    """Each weight split on 'model' by its role, its other dimension on
    `other_axis` (a stacked layer's weight: its stacked tensor, with the
    layer dimension whole)."""
    import torch_xla.distributed.spmd as xs

    for name, param in model.named_parameters():
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        spec = (("model", other_axis) if module in COLUMN_PARALLEL
                else (other_axis, "model") if module in ROW_PARALLEL else None)
        if spec is not None:
            xs.mark_sharding(param, mesh, spec)  # a stacked layer's: its stacked tensor


def spmd_mesh(shape, axes):
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), shape, axes)
    xs.set_global_mesh(mesh)  # where the stack finds the data axis
    return mesh


def two_dimensional_mesh_scenario():
    """test_hf's small Llama on a 2 x 2 mesh, unconverted and converted, sharded alike."""
    import torch_xla.distributed.spmd as xs
    from test_hf import converted_pair

    mesh = spmd_mesh((2, 2), ("fsdp", "model"))
    device = torch_xla.device()
    reference, model = converted_pair(layers=3)
    ids = torch.randint(0, 128, (4, 8))
    losses = {}
    for which in (reference, model):
        which.to(device).train()
        shard_by_hand(which, mesh, "fsdp")
        optimizer = torch.optim.SGD(which.parameters(), lr=0.5)
        inputs = ids.to(device)
        xs.mark_sharding(inputs, mesh, ("fsdp", None))
        for _ in range(2):
            loss = which(inputs, labels=inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.setdefault(which is model, []).append(loss.cpu())
    close(losses[True], losses[False], TRAINING)
    converted, unconverted = (step_module(os.environ["DUMP"], looped) for looped in (True, False))
    assert converted.bytes_used <= unconverted.bytes_used, (converted.bytes_used,
                                                            unconverted.bytes_used)
    states = loop_states(converted.optimized_hlo)
    assert len(states) == 2, states
    for state in states:  # [batch 4 / 2 on 'fsdp', sequence, hidden], never the whole batch
        assert "f32[2,8,32]" in state and "f32[4,8,32]" not in state, state
    print("matched", [round(loss.item(), 5) for loss in losses[True]])


@supports("sharded", "llama")
def test_on_a_2d_mesh_the_loops_keep_the_batch_split(run_isolated, tmp_path):
    flags = dump_flags(tmp_path)
    result = run_isolated(two_dimensional_mesh_scenario, env={
        "CPU_NUM_DEVICES": "4", "XLA_FLAGS": flags, "DUMP": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matched" in result.stdout, result.stdout


def device_bytes(tensor) -> int:
    """The bytes of `tensor` one device holds, from its sharding."""
    spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    found = re.search(r"devices=\[([\d,]+)\]", spec)
    tiles = [int(n) for n in found.group(1).split(",")] if found else []
    if "last_tile_dim_replicate" in spec:
        tiles = tiles[:-1]
    return tensor.numel() * tensor.element_size() // math.prod(tiles)


def tensor_parallel_decoding_scenario():
    """A small Llama of 4 key/value heads, its weights split on a 'model' mesh of 4,
    decodes as the unconverted model does; its stacked cache is split on the heads."""
    import transformers

    import torch_xla_ext as tx

    mesh = spmd_mesh((4,), ("model",))
    device = torch_xla.device()
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4)).eval()
    ids = torch.randint(1, 128, (2, 8)).to(device)
    tokens, cache_bytes = {}, {}
    for converted in (False, True):
        model = copy.deepcopy(reference)
        if converted:
            tx.stack_layers(model)
        model.to(device)
        shard_by_hand(model, mesh, None)
        with torch.no_grad():
            tokens[converted] = [
                tx.generate(model, ids, max_new_tokens=4, max_cache_len=16).cpu(),
                model.generate(ids, max_new_tokens=4, do_sample=False,
                               cache_implementation="static").cpu()]
            # A prefill and a decoding step into a cache of one's own, as tx.generate's.
            cache = transformers.StaticCache(config=model.config, max_cache_len=16)
            logits = model(ids, past_key_values=cache).logits
            torch_xla.sync()
            model(logits[:, -1:].argmax(-1), past_key_values=cache)
            torch_xla.sync()
        layers = cache.layers
        if converted:
            buffers = (layers[0]._stacked_keys, layers[0]._stacked_values)
            for buffer in buffers:  # [layers, batch, heads, length, head_dim]: the heads split
                spec = torch_xla._XLAC._get_xla_sharding_spec(buffer)
                assert spec.startswith("{devices=[1,1,4,1,1]"), spec
        else:
            buffers = [tensor for layer in layers for tensor in (layer.keys, layer.values)]
        cache_bytes[converted] = sum(device_bytes(buffer) for buffer in buffers)
    assert all(torch.equal(a, b) for a, b in zip(tokens[True], tokens[False])), tokens
    assert cache_bytes[True] <= cache_bytes[False], cache_bytes
    print("decoded", cache_bytes)


@supports("sharded", "llama")
def test_tensor_parallel_decoding_splits_the_stacked_cache_on_heads(run_isolated):
    result = run_isolated(tensor_parallel_decoding_scenario, env={"CPU_NUM_DEVICES": "4"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decoded" in result.stdout, result.stdout
