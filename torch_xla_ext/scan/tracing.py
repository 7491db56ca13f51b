"""Tracing `fn` once on placeholders, lifting the tensors it captures.

`fn` runs under `LiftCaptures`, which swaps every XLA tensor `fn` reads without
receiving it (closures, module parameters, buffers) for a placeholder of its
own; those captures become loop-invariant inputs, bound at every call."""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

from torch_xla_ext.placeholders import (
    PlaceholderTensor, mutates_arguments, placeholder, tracing, unguarded_placeholder)
from torch_xla_ext.scan import regions
from torch_xla_ext.scan.avals import Aval, Structure, check_carry_types, check_y_leaves
from torch_xla_ext.scan.mutation import Writes
from torch_xla_ext.scan.sharding import as_fn_arguments

_CAPTURABLE = (torch.nn.Parameter, PlaceholderTensor)


def liftable(tensor: torch.Tensor) -> bool:
    """Whether a tensor that fn reads without having received or made it
    becomes an input of the trace: yes on XLA, unless it is one of
    AOTAutograd's or SPMD's wrappers (what fn reads otherwise is baked in)."""
    return (tensor.device.type == "xla"
            and (isinstance(tensor, _CAPTURABLE) or type(tensor) is torch.Tensor)
            and not _wraps_fake(tensor))


def _wraps_fake(tensor: torch.Tensor) -> bool:
    # XLA tensors are functional wrappers too; AOTAutograd's wrap fake tensors.
    return (torch._is_functional_tensor(tensor)
            and isinstance(torch._from_functional_tensor(tensor), FakeTensor))


class LiftCaptures(TorchFunctionMode):
    """Swaps every XLA tensor that `fn` reads without having received or made it
    for a stand-in, so that the trace reads no data and the capture becomes an
    explicit input. `stand_ins` maps id(captured tensor) to its stand-in; new
    captures get a fresh placeholder unless the map is frozen. `writes`, if
    given, watches each new stand-in for in-place writes (see `mutation`)."""

    def __init__(self, arguments: Sequence[torch.Tensor], stand_ins: dict | None = None,
                 writes: Writes | None = None):
        super().__init__()
        self._known = {id(t): t for t in arguments}
        self.stand_ins = {} if stand_ins is None else stand_ins
        self._frozen = stand_ins is not None
        self.writes = writes
        self.captured: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (mutates_arguments(func) and args and isinstance(args[0], torch.Tensor)
                and args[0].device.type != "xla" and id(args[0]) not in self._known):
            raise TypeError(
                f"scan: fn writes in place ({getattr(func, '__name__', func)}) to a "
                f"{Aval.of(args[0])} tensor on {args[0].device} that it captures; scan runs "
                f"fn's Python body once, while tracing, not at every step, so the write would "
                f"happen once. Keep the tensor on the XLA device (scan then carries it) or "
                f"return the value in the carry")
        args, kwargs = tree_map_only(torch.Tensor, self._lift, (args, kwargs or {}))
        result = func(*args, **kwargs)
        for leaf in tree_flatten(result)[0]:
            if isinstance(leaf, torch.Tensor):
                self._known[id(leaf)] = leaf
        return result

    def _lift(self, tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in self._known or not liftable(tensor):
            return tensor
        stand_in = self.stand_ins.get(id(tensor))
        if stand_in is None:
            if self._frozen:
                raise RuntimeError(
                    f"scan: fn read a {Aval.of(tensor)} tensor on its second trace that it did "
                    f"not read on its first; fn must trace the same way each time (or pass "
                    f"is_fn_pure=False)")
            stand_in = new_stand_in(tensor.shape, tensor.dtype, tensor.requires_grad)
            self.stand_ins[id(tensor)] = stand_in
            self.captured.append(tensor)
            if self.writes is not None:
                self.writes.watch(stand_in)
        return stand_in


def new_stand_in(shape, dtype: torch.dtype, requires_grad: bool = False, *,
                 guarded: bool = True) -> torch.Tensor:
    """Every tensor scan traces or lowers with comes from here: a placeholder,
    so that no stage of a trace moves data (the main job's `scan-device-data`
    mode replaces this function to measure what that saves). `guarded=False`
    gives a plain tensor, not a `PlaceholderTensor`, for AOTAutograd, which
    inspects its inputs' storage while it fakeifies them."""
    if guarded:
        return placeholder(shape, dtype, requires_grad=requires_grad)
    return unguarded_placeholder(shape, dtype).requires_grad_(requires_grad)


def stand_in(aval: Aval, requires_grad: bool | None = None) -> torch.Tensor:
    grad = aval.requires_grad if requires_grad is None else requires_grad
    return new_stand_in(aval.shape, aval.dtype, grad and aval.dtype.is_floating_point)


class Trace(NamedTuple):
    """One run of `fn` on placeholders: the stand-ins it received (`*_in`, and
    `*_arg` as `fn` saw them, which differ under SPMD), what it returned, and
    the lifter that recorded its captures."""
    lifter: LiftCaptures
    carry_in: list
    carry_arg: list
    x_in: list
    x_arg: list
    carry_out: list
    y_out: list
    y_tree: Structure


@contextlib.contextmanager
def internal(autocast: tuple = ()):
    """Runs one of scan's own traces or lowerings of fn: under exactly the
    autocast state `autocast` (see `cache.autocast_state`), and invisible to the
    caller's saved-tensor hooks.

    Autocast's cache of casts is off: it would keep the casts of stand-ins
    (which read placeholders) until the caller's autocast region ends, and a
    sync inside the region would run them. The caller's saved-tensor hooks are
    deferred, as AOTAutograd defers them while it traces: what the trace saves
    reads placeholders and is not the caller's; what scan's backward keeps
    goes through the hooks when scan runs."""
    devices = torch._C._autocast_supported_devices()
    previous = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]
    previous_cache = torch.is_autocast_cache_enabled()
    enabled = dict(autocast)
    hooks_were_deferred = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        for device in devices:
            torch.set_autocast_enabled(device, device in enabled)
            if device in enabled:
                torch.set_autocast_dtype(device, enabled[device])
        torch.set_autocast_cache_enabled(False)
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(hooks_were_deferred)
        for device, was_enabled, dtype in previous:
            torch.set_autocast_enabled(device, was_enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(previous_cache)


def trace(key, fn) -> Trace:
    """Runs `fn` once on placeholders of `key`'s avals, under the autocast
    state of `key`."""
    regions.install()
    # A nested scan's key counts every floating input as requiring grad, which
    # only its differentiation needs: its one trace on placeholders, which
    # finds what fn writes in place, gives them none.
    requires_grad = False if key.nested else None
    with internal(key.autocast):
        carry_in = [stand_in(a, requires_grad) for a in key.carry_avals]
        x_in = [stand_in(a, requires_grad) for a in key.x_avals]
        carry_arg, x_arg = as_fn_arguments(carry_in), as_fn_arguments(x_in)
        lifter = LiftCaptures(carry_in + x_in + carry_arg + x_arg,
                              writes=Writes(carry_in + x_in + carry_arg + x_arg))
        with tracing(f"scan's fn {getattr(fn, '__qualname__', fn)!r}"), lifter:
            carry_out, y_out = call_body(fn, key.carry_tree.unflatten(carry_arg),
                                         key.xs_tree.unflatten(x_arg))
    carry_out = check_carry_types(key.carry_tree, key.carry_avals, carry_out)
    y_leaves, y_tree = check_y_leaves(y_out)
    return Trace(lifter, carry_in, carry_arg, x_in, x_arg, carry_out, y_leaves, y_tree)


def call_body(fn, carry, x):
    result = fn(carry, x)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(f"scan: fn must return a pair (carry, y), got {type(result).__name__}")
    return result

