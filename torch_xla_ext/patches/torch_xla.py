"""The changes torch_xla_ext makes to torch_xla, each installed by the first
call that needs it (never at import), once per process. What each change
does is passed in by the package that needs it; docs/design.md lists them
with why, and why none is undone.

* `guard_syncs`: torch_xla's sync entry points call a function first
  (placeholders discard the pending work that reads them).
* `around_live_tensor_ops`: torch_xla's syncs of every live tensor, and its
  clearing of their pending IR, call a function before and one after (layer
  storages set their views aside).
* `redirect_mark_sharding`: torch_xla's `mark_sharding` goes through a
  function (scan's traces turn it into an op of the graph).
* `route_checkpoint`: torch_xla's activation checkpoint goes through a
  function (scan runs it as a region of the partitioner).
* `prepare_fsdp_v2` and `keep_whole_in_auto_wrap`: FSDPv2 calls a function
  before it shards a module, and torch_xla's auto-wrapping keeps modules of
  a class whole (layer stacks), whatever the policy.
* `route_mark_sharding`: torch_xla's `mark_sharding` asks a function first
  (a stacked layer's parameter shards its stacked tensor).
* `lower_host_ops`: XLA kernels for ops torch_xla 2.9 runs on the host.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

from torch_xla_ext.patches.patching import Added, Patch, Replaced

__all__ = ["LIVE_TENSOR_OPS", "SYNC_ENTRY_POINTS", "around_live_tensor_ops", "guard_syncs",
           "host_ops_lowered", "keep_whole_in_auto_wrap", "lower_host_ops", "prepare_fsdp_v2",
           "redirect_mark_sharding", "route_checkpoint",
           "route_mark_sharding"]

# torch_xla's Python layer calls these through the _XLAC module at call time,
# so wrapping them there covers torch_xla.sync(), xm.mark_step(), optimizer
# barriers and explicit tensor syncs alike.
SYNC_ENTRY_POINTS = ("_xla_step_marker", "_xla_sync_multi", "_xla_sync_live_tensors")
# What acts on every live tensor: the syncs that compute them all, and the
# clearing of their pending IR (torch_xla's dynamo bridge, after a sync: a view
# made after the sync would lose its IR and be left with no value).
LIVE_TENSOR_OPS = ("_xla_step_marker", "_xla_sync_live_tensors", "_clear_pending_irs")
_SYNCS = Patch("torch_xla")
_LIVE_TENSOR_OPS = Patch("torch_xla")
_MARK_SHARDING = Patch("torch_xla")
_ROUTED_SHARDING = Patch("torch_xla.distributed.spmd")
_CHECKPOINT = Patch("torch_xla.utils.checkpoint")
_FSDP_V2 = Patch("torch_xla.experimental.spmd_fully_sharded_data_parallel")
_AUTO_WRAP_MODULE = "torch_xla.distributed.fsdp.wrap"
_kept_whole: dict[type, Patch] = {}
_kept_whole_lock = threading.Lock()


def guard_syncs(before_sync: Callable[[], None]) -> None:
    """Each of torch_xla's sync entry points (`SYNC_ENTRY_POINTS`) calls
    `before_sync()` first, which may raise to refuse the sync."""
    def changes():
        import torch_xla
        return [Replaced(torch_xla._XLAC, name, functools.partial(_calling_first, before_sync))
                for name in SYNC_ENTRY_POINTS]
    _SYNCS.install(changes)


def _calling_first(before: Callable[[], None], function: Callable) -> Callable:
    @functools.wraps(function)
    def calling_first(*args, **kwargs):
        before()
        return function(*args, **kwargs)
    return calling_first


def around_live_tensor_ops(before: Callable[[], None], after: Callable[[], None]) -> None:
    """Each of torch_xla's operations on every live tensor (`LIVE_TENSOR_OPS`)
    calls `before()` first and `after()` once it returns or raises."""
    def changes():
        import torch_xla
        return [Replaced(torch_xla._XLAC, name, functools.partial(_calling_around, before, after))
                for name in LIVE_TENSOR_OPS]
    _LIVE_TENSOR_OPS.install(changes)


def _calling_around(before: Callable[[], None], after: Callable[[], None],
                    function: Callable) -> Callable:
    # Never traced by Dynamo (a sync in a compiled function is a graph break):
    # what `before` and `after` do to tensors is no op of a graph.
    @torch.compiler.disable
    @functools.wraps(function)
    def calling_around(*args, **kwargs):
        before()
        try:
            return function(*args, **kwargs)
        finally:
            after()
    return calling_around


def redirect_mark_sharding(redirected: Callable) -> None:
    """torch_xla's `mark_sharding` calls `redirected(tensor, op_sharding)`
    instead of `torch_xla._XLAC._xla_mark_sharding` (which `redirected` calls
    for what it does not handle: it can take it before this runs). torch_xla's
    `mark_sharding` looks the function up on `_XLAC` at each call."""
    def changes():
        import torch_xla
        return [Replaced(torch_xla._XLAC, "_xla_mark_sharding", lambda original: redirected)]
    _MARK_SHARDING.install(changes)


def route_checkpoint(route: Callable) -> None:
    """torch_xla's activation checkpoint (`CheckpointFunction.apply(function,
    preserve_rng_state, *args)`, which `torch_xla.utils.checkpoint.checkpoint`
    calls) calls `route(torch_xla_apply, function, preserve_rng_state, *args)`,
    `torch_xla_apply` being torch_xla's own."""
    def changes():
        from torch_xla.utils.checkpoint import CheckpointFunction

        def wrap(torch_xla_apply):
            def apply(cls, function, preserve_rng_state, *args):
                return route(torch_xla_apply, function, preserve_rng_state, *args)
            return classmethod(apply)
        return [Replaced(CheckpointFunction, "apply", wrap)]
    _CHECKPOINT.install(changes)


def prepare_fsdp_v2(before_init: Callable) -> None:
    """FSDPv2 (`SpmdFullyShardedDataParallel(module, *args, **kwargs)`) calls
    `before_init(module, *args, **kwargs)` before it wraps and shards
    `module` (its `mesh` keyword given, None if the caller gave none)."""
    def changes():
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel)

        def wrap(init):
            @functools.wraps(init)
            def __init__(self, module, *args, mesh=None, **kwargs):
                before_init(module, *args, mesh=mesh, **kwargs)
                init(self, module, *args, mesh=mesh, **kwargs)
            return __init__
        return [Replaced(SpmdFullyShardedDataParallel, "__init__", wrap)]
    _FSDP_V2.install(changes)


def keep_whole_in_auto_wrap(module_class: type) -> None:
    """torch_xla's size-based auto-wrap policy (transformers' `min_num_params`)
    neither wraps a module of `module_class` as a unit of its own nor looks
    inside it: the unit that holds it holds it whole."""
    with _kept_whole_lock:
        patch = _kept_whole.setdefault(module_class, Patch(_AUTO_WRAP_MODULE))

    def changes():
        import torch_xla.distributed.fsdp.wrap as wrap_module
        from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy

        def wrap(recursive_wrap):
            @functools.wraps(recursive_wrap)
            def kept_whole(module, *args, **kwargs):
                if isinstance(module, module_class):  # any policy: the unit holding it holds it
                    return module, 0
                return recursive_wrap(module, *args, **kwargs)
            return kept_whole
        return [*(Added(kept, (module_class,)) for kept in (
            size_based_auto_wrap_policy.FORCE_LEAF_MODULES,
            size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES)),
            Replaced(wrap_module, "recursive_wrap", wrap)]
    patch.install(changes)


def route_mark_sharding(route: Callable) -> None:
    """torch_xla's `mark_sharding(tensor, mesh, partition_spec)` (as
    `torch_xla.distributed.spmd.mark_sharding`, which FSDPv2 calls, and in
    its own module) first asks `route(tensor, mesh, partition_spec)`, which
    returns what to return instead, or None for torch_xla's own."""
    def changes():
        import torch_xla.distributed.spmd as spmd
        import torch_xla.distributed.spmd.xla_sharding as xla_sharding

        def wrap(mark_sharding):
            @functools.wraps(mark_sharding)
            def routed(tensor, mesh, partition_spec):
                done = route(tensor, mesh, partition_spec)
                return mark_sharding(tensor, mesh, partition_spec) if done is None else done
            return routed
        return [Replaced(spmd, "mark_sharding", wrap), Replaced(xla_sharding, "mark_sharding", wrap)]
    _ROUTED_SHARDING.install(changes)


# ---------------------------------------------------------------------------
# XLA kernels for ops torch_xla 2.9 runs on the host
#
# torch_xla has no XLA kernel for some ops that layers call, and runs them on
# the CPU through its fallback: every call moves their inputs to the host and
# back, and a scan cannot trace them on placeholders (tensors with no data to
# move). `lower_host_ops()` gives those ops XLA kernels made of ops torch_xla
# lowers:
#
# * `linalg_solve_triangular` (gated linear attention's chunked delta rule:
#   Qwen3.5, Qwen3-Next) as `triangular_solve`, which torch_xla lowers to
#   XLA's TriangularSolve; solving from the right (`left=False`) is the
#   transposed solve from the left.
#
# Autograd is torch's own (the kernels sit below it): its derivative of the
# op calls the op again, here on the device.

_kernels_lock = threading.Lock()
_kernels: list = []  # the torch.library.Library holding the kernels, once made


def lower_host_ops() -> None:
    """Registers the XLA kernels above, once per process."""
    if _kernels:
        return
    with _kernels_lock:
        if not _kernels:
            library = torch.library.Library("aten", "IMPL")
            library.impl("linalg_solve_triangular", _solve_triangular, "XLA")
            _kernels.append(library)


def host_ops_lowered() -> bool:
    """Whether `lower_host_ops` has registered the kernels (which changes
    which ops read their data on the host)."""
    return bool(_kernels)


def _solve_triangular(matrix: torch.Tensor, rhs: torch.Tensor, *, upper: bool, left: bool = True,
                      unitriangular: bool = False) -> torch.Tensor:
    if not left:  # X A = B is A^T X^T = B^T
        return _solve_triangular(matrix.mT, rhs.mT, upper=not upper, left=True,
                                 unitriangular=unitriangular).mT
    solution, _ = torch.triangular_solve(rhs, matrix, upper=upper, transpose=False,
                                         unitriangular=unitriangular)
    return solution
