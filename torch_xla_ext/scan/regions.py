"""torch_xla's activation checkpointing inside a scanned fn.

`torch_xla.utils.checkpoint.checkpoint(function, *args)` is reentrant: its
backward runs `function` again and calls `torch.autograd.backward`, which
AOTAutograd's tracing of the backward cannot do. While scan traces fn, such a
call instead runs `function` as ordinary ops, its tensor inputs and outputs
marked with `checkpoint_name` under a region's names; the partitioner then
recomputes what lies between them in the backward step and keeps only what the
policy keeps outside the region, which is what the checkpoint asks for. Outside
scan's tracing the checkpoint runs as torch_xla wrote it.
"""
from __future__ import annotations

import itertools

import torch
from torch.utils._pytree import tree_map

from torch_xla_ext.patches.torch_xla import route_checkpoint
from torch_xla_ext.placeholders import is_tracing
from torch_xla_ext.policies import REGION_PREFIX, checkpoint_name

_region_numbers = itertools.count()


def install() -> None:
    """Routes torch_xla's checkpoint through `_route` (once, when scan first
    traces; importing torch_xla_ext changes nothing)."""
    route_checkpoint(_route)


def _route(torch_xla_apply, function, preserve_rng_state, *args):
    if not is_tracing():
        return torch_xla_apply(function, preserve_rng_state, *args)
    return _run_region(function, args)


def _run_region(function, args: tuple):
    number = next(_region_numbers)

    def mark(end):
        def marked(value):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return checkpoint_name(value, f"{REGION_PREFIX}{number} {end}")
            return value
        return marked

    return tree_map(mark("out"), function(*tree_map(mark("in"), args)))
