"""Fake stand-ins of a layer call's arguments and weights (`FakeTensorMode`:
shapes and dtypes, no data), for running a layer to see what it gives back
or what it computes, without computing anything: tensors become fakes on
the CPU (a layer's own constants then hold their values), other objects
(a key/value cache) deep copies holding fakes, which the layer may change
as it likes; constants stay as they are. What runs on them runs apart from
any trace in progress (`torch.export`'s): it is no part of the traced graph."""
from __future__ import annotations

import contextlib
import copy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from torch_xla_ext.object_graph import VALUE_TYPES, tensors_in

__all__ = ["apart_from_trace", "fake_leaves", "fake_mode", "fake_tensor", "fake_weights",
           "faking", "template_copy"]


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode in which a tensor the copies reach that is no fake
    (a cache layer pickles its slices of stacked buffers as tensors of its
    own) becomes one as an op reads it."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def apart_from_trace():
    """What runs in the block is no part of a trace in progress (`torch.export`'s)."""
    with disable_proxy_modes_tracing():
        yield


def template_copy(template: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of a stack's template (its tensors meta tensors), made
    apart from any trace: under `torch.export`, copying its tensors would be
    ops of the exported graph on constants."""
    with apart_from_trace(), unset_fake_temporarily():
        return copy.deepcopy(template)


@contextlib.contextmanager
def faking(mode: FakeTensorMode):
    """`mode` entered apart from any trace in progress: a trace by
    `torch.export` would otherwise record the ops on the fakes (of another
    fake mode than its own) in its graph."""
    with apart_from_trace(), mode:
        yield


def fake_tensor(mode: FakeTensorMode, tensor: torch.Tensor, shape=None) -> torch.Tensor:
    """A fake of `tensor`'s shape (or `shape`) and dtype, on the CPU, that
    requires grad as it does."""
    with faking(mode):
        made = torch.empty(tuple(tensor.shape if shape is None else shape), dtype=tensor.dtype)
    return made.requires_grad_(tensor.requires_grad and tensor.dtype.is_floating_point)


def fake_leaves(mode: FakeTensorMode, leaves: list) -> list:
    """Stand-ins of a call's leaves (see the module docstring)."""
    given = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            given.append(fake_tensor(mode, leaf))
        elif isinstance(leaf, VALUE_TYPES):
            given.append(leaf)
        else:
            given.append(copy.deepcopy(leaf, {id(t): fake_tensor(mode, t)
                                              for t in tensors_in(leaf)}))
    return given


def fake_weights(mode: FakeTensorMode, layer: torch.nn.Module) -> dict:
    """Fakes of `layer`'s parameters and buffers, by name."""
    return {name: fake_tensor(mode, tensor) for name, tensor in
            (*layer.named_parameters(remove_duplicate=False),
             *layer.named_buffers(remove_duplicate=False))}
