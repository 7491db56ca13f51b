"""The loop of a module's forward over its stacked layer lists.

A module that holds a `StackedList` (its owner) loops over it in its
forward, `for layer in self.layers[: n]` or `for block in self.h`, calling
each layer. `drive_loops(owner, names)` puts hooks on the owner: while its
forward runs, indexing, slicing or iterating the lists gives `LayerCall`s, callables
that stand for the layers (and read as them: `call.attention_type` is the
layer's), and each call goes to the driver of that forward, which decides
what runs (`executor.Execution` of a call plan, or the dry run's recorder,
`dry_run`, which is also told what the forward reads: a `ReadRecorder`).
Anywhere else (user code, peft, a forward called past its hooks), the
lists give the layers as modules.

The drivers of the forwards running in a thread are kept innermost last:
a forward called inside another's loop (a layer holding an owner of its
own) has its own.

Under `torch.compile`, the owner's hooks first ask `traced` (given to
`drive_loops`) for drivers that Dynamo can trace, made from what an eager
call of this kind planned (`dynamo`): with them, the hooks, the lists'
slicing and iteration and the layers' calls are traced, and each run of
layers is one call of torch's scan operator in Dynamo's graph; the loop's
items (`TracedLayerCall`) read as the dry run of that kind of call read them. Without
them, these entry points (`at_graph_break`) are where Dynamo breaks its
graph: they run as Python, not traced, so the driver plans and runs the
layers as it does without `torch.compile` (their runs as scans, each an XLA
While loop on lazy tensors), between the graphs Dynamo compiles before and
after the loop. Their decisions rest on what Dynamo cannot trace (object
identities, the dry run's fakes), and traced, they would be guarded on per
call. The traced drivers are kept apart (`traced_driver`), so that a
traced entry point never reads an eager driver.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Protocol

import torch.compiler
from torch import nn

from torch_xla_ext.layer_stack.executors import executor_of_call

__all__ = ["Driver", "LayerCall", "ReadRecorder", "TracedLayerCall", "active_driver",
           "at_graph_break", "drive_loops", "driving", "iterated", "iterating", "loop_item",
           "loop_names", "traced_driver", "undrive_loops"]

# Marks the loop's entry points that Dynamo runs at a graph break (see above).
at_graph_break = torch.compiler.disable


class Driver(Protocol):
    """What runs the calls of one forward's loop over one stacked list."""

    def call(self, index: int, args: tuple, kwargs: dict): ...


class ReadRecorder:
    """The base of a driver that is told what the forward reads of its loop's
    items (the dry run's): what Dynamo's trace of the loop must answer (`dynamo`)."""

    def read(self, index: int, name: str, value) -> None:
        raise NotImplementedError


class _Active(threading.local):
    def __init__(self):
        self.drivers: list[tuple[int, Driver]] = []  # (id of the list, its driver)
        self.iterations: list[int] = []  # the id of the list of each iteration under way
        self.traced: list[tuple[int, Driver]] = []  # drivers that Dynamo traces (see above)


_ACTIVE = _Active()


def active_driver(stack: nn.Module) -> Driver | None:
    """The driver of the innermost running forward that loops over `stack`."""
    return next((driver for stack_id, driver in reversed(_ACTIVE.drivers)
                 if stack_id == id(stack)), None)


def traced_driver(stack: nn.Module) -> Driver | None:
    """The driver Dynamo traces of the innermost forward that loops over `stack`."""
    return next((driver for stack_id, driver in reversed(_ACTIVE.traced)
                 if stack_id == id(stack)), None)


def iterated(stack: nn.Module, items: Iterable):
    """`items`, the layers of `stack` as a driven loop iterates over them,
    with the iteration marked as under way (`iterating`) from the first item
    taken until the loop asks past the last one, or drops the iterator."""
    iterations = _ACTIVE.iterations
    iterations.append(id(stack))
    try:
        yield from items
    finally:
        iterations.remove(id(stack))


def iterating(stack: nn.Module) -> bool:
    """Whether a driven loop's iteration over `stack` is under way (`iterated`):
    its body may be running though it calls no layer (one it skips)."""
    return id(stack) in _ACTIVE.iterations


class driving:
    """Context manager: while it is open, `stack`'s loop calls go to `driver`."""

    def __init__(self, stack: nn.Module, driver: Driver, traced: bool = False):
        self.entry = (id(stack), driver)
        self.drivers = _ACTIVE.traced if traced else _ACTIVE.drivers

    def __enter__(self):
        self.drivers.append(self.entry)
        return self.entry[1]

    def __exit__(self, *exc):
        self.drivers.remove(self.entry)


class LayerCall:
    """Layer `index` of a stacked list in its owner's loop: calling it is
    that layer's call, which the driver runs; reading an attribute reads the
    layer's (`stack.layer(index)`, built at the first read)."""
    __slots__ = ("_driver", "_index", "_layer_at", "_layer")

    def __init__(self, driver: Driver, index: int, layer_at: Callable[[int], nn.Module]):
        self._driver, self._index, self._layer_at, self._layer = driver, index, layer_at, None

    @at_graph_break
    def __call__(self, *args, **kwargs):
        return self._driver.call(self._index, args, kwargs)

    def __getattr__(self, name: str):
        if name in LayerCall.__slots__:  # unset: an object made without __init__ (by Dynamo)
            raise AttributeError(name)
        if self._layer is None:
            self._layer = self._layer_at(self._index)
        return getattr(self._layer, name)

    def __repr__(self) -> str:
        return f"<call of layer {self._index} in its owner's loop>"


class _ReadLayerCall(LayerCall):
    """A `LayerCall` whose attribute reads its driver (a `ReadRecorder`) is told of."""
    __slots__ = ()

    def __getattr__(self, name: str):
        value = LayerCall.__getattr__(self, name)
        self._driver.read(self._index, name, value)
        return value


def loop_item(driver: Driver, index: int, layer_at: Callable[[int], nn.Module]) -> LayerCall:
    """Layer `index` as the owner's loop driven by `driver` gets it."""
    kind = _ReadLayerCall if isinstance(driver, ReadRecorder) else LayerCall
    return kind(driver, index, layer_at)


class TracedLayerCall:
    """A `LayerCall` that Dynamo traces (its driver is a traced one), of plain
    attributes, which Dynamo's objects made in its trace hold; reading an
    attribute gives what the forward read of this loop item when an eager
    call planned this kind of call (`driver.attribute(index, name)`, a
    constant in Dynamo's trace)."""

    def __init__(self, driver: Driver, index: int):
        self._driver, self._index = driver, index

    def __call__(self, *args, **kwargs):
        return self._driver.call(self._index, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return self._driver.attribute(self._index, name)


class _OwnerHooks:
    """The hooks on an owner: `enter` (a forward pre-hook) asks `start` for
    the drivers of this forward's loops and opens them; `leave` closes them,
    even when the forward raises. Under Dynamo, `traced`'s drivers, if it
    gives them, are opened and closed in Dynamo's trace instead."""

    def __init__(self, names: tuple[str, ...], start: Callable, traced: Callable | None):
        self.names = names
        self.start = start
        self.traced = traced
        self.open: list[list[driving]] = []
        self.open_traced: list[list[driving]] = []

    def enter(self, owner: nn.Module, args: tuple, kwargs: dict):
        drivers = self.traced(owner, self.names, args, kwargs) if (
            executor_of_call().traces_loops and self.traced is not None) else None
        if drivers is None:
            return self.enter_at_graph_break(owner, args, kwargs)
        entries = [driving(owner._modules[name], driver, traced=True)
                   for name, driver in drivers.items()]
        for entry in entries:
            entry.__enter__()
        self.open_traced.append(entries)

    def leave(self, owner: nn.Module, args: tuple, kwargs: dict, output):
        if not (executor_of_call().traces_loops and self.open_traced):
            return self.leave_at_graph_break(owner, args, kwargs, output)
        for entry in self.open_traced.pop():
            entry.__exit__(None, None, None)

    @at_graph_break
    def enter_at_graph_break(self, owner: nn.Module, args: tuple, kwargs: dict):
        entries = [driving(owner._modules[name], driver)
                   for name, driver in self.start(owner, self.names, args, kwargs).items()]
        for entry in entries:
            entry.__enter__()
        self.open.append(entries)

    @at_graph_break
    def leave_at_graph_break(self, owner: nn.Module, args: tuple, kwargs: dict, output):
        if self.open:  # an earlier pre-hook may have raised before `enter` ran
            for entry in self.open.pop():
                entry.__exit__(None, None, None)


def drive_loops(owner: nn.Module, names: Iterable[str], start: Callable,
                traced: Callable | None = None) -> None:
    """Hooks `owner` so that its forward's loops over its lists `names` are
    driven: `start(owner, names, args, kwargs)` gives, at each forward, a
    driver per list name (none: the lists give modules in that forward);
    under Dynamo, `traced(owner, names, args, kwargs)` gives drivers that
    Dynamo traces, or None (the loops run at a graph break). Replaces hooks
    an earlier call put there."""
    undrive_loops(owner)
    hooks = _OwnerHooks(tuple(names), start, traced)
    owner.register_forward_pre_hook(hooks.enter, with_kwargs=True)
    owner.register_forward_hook(hooks.leave, with_kwargs=True, always_call=True)


def undrive_loops(owner: nn.Module) -> None:
    """Removes the hooks `drive_loops` put on `owner`, if any."""
    for registry in (owner._forward_pre_hooks, owner._forward_hooks):
        for key, hook in list(registry.items()):
            if isinstance(getattr(hook, "__self__", None), _OwnerHooks):
                del registry[key]
                owner._forward_pre_hooks_with_kwargs.pop(key, None)
                owner._forward_hooks_with_kwargs.pop(key, None)
                owner._forward_hooks_always_called.pop(key, None)


def loop_names(owner: nn.Module) -> tuple[str, ...]:
    """The names of the lists whose loops `drive_loops` drives in `owner`."""
    for hook in owner._forward_pre_hooks.values():
        hooks = getattr(hook, "__self__", None)
        if isinstance(hooks, _OwnerHooks):
            return hooks.names
    return ()
