"""`LayerStorage`: one segment's layer tensors stored once, stacked, while
every layer stays in the module tree with its own Parameter objects.

Each tensor name of the segment's layers ('self_attn.q_proj.weight') is
one `[layers, ...]` tensor in `stacked`: the scan's operand and, for a
parameter, the autograd leaf, so the backward gives one stacked gradient
as a `LayerStack`'s does. Each layer keeps its Parameters (the same
objects, leaf tensors: an optimizer made before converting, per-layer
param groups and `requires_grad_` reach them) and its buffers, whose data
are views of their slices (`p.data = stacked[i]` keeps the object), so
writing one (an optimizer's update, `load_state_dict`, an init function)
writes its slice. Three rules keep the views and the stack one:

* gradients: once the backward has accumulated a stacked gradient, each
  layer parameter that requires grad gets its slice of it as `.grad` (a
  view; one that holds a gradient of its own, from a layer run as itself,
  gets the slice added), and the stacked tensor lets it go: the views hold
  it, so that clearing them (`zero_grad`) frees it, as unconverted. A
  backward while they are held accumulates into it; one after they were
  cleared or replaced starts the stacked gradient from what the layers hold;
* syncs: torch_xla computes every live tensor at a sync, views too, each
  into a buffer of its own, a second copy of the weights that would
  outlive the step. So the views are set aside for each live sync (and
  each clearing of live tensors' pending IR) and made again after it
  (`hide_views`, `show_views`, which `patches.torch_xla.around_live_tensor_ops`
  calls): the step's graph returns the stacked tensors alone, as for a
  `LayerStack`;
* `operands()`, what a scan reads: `stacked`, while the layers hold the
  Parameters and views put there; a call that swaps them
  (`torch.func.functional_call`, export's reparametrization) gets the stack
  of what they hold. (A layer whose Parameters have tensor hooks runs as
  itself: `addressed`.)
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch_xla
from torch import nn

from torch_xla_ext.patches.torch_xla import around_live_tensor_ops
from torch_xla_ext.placeholders import depends_on_placeholder

__all__ = ["LayerStorage", "computed_now", "stacked_place", "storage_of"]

# The storages whose views a sync sets aside, each layer Parameter's place
# (storage, name, layer) and each stacked tensor's (storage, name).
_LIVE: "weakref.WeakSet[LayerStorage]" = weakref.WeakSet()


class _Places:
    """Values by tensor, held as long as the tensor lives (a tensor compares
    by value, so it cannot key a WeakKeyDictionary)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, tensor: torch.Tensor, value) -> None:
        key = id(tensor)

        def forget(ref, key=key):
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]
        self._entries[key] = (weakref.ref(tensor, forget), value)

    def get(self, tensor: torch.Tensor):
        entry = self._entries.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def pop(self, tensor: torch.Tensor) -> None:
        if self.get(tensor) is not None:
            del self._entries[id(tensor)]


_PLACES = _Places()
_STACKED = _Places()


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one layer holds one tensor: `owner._parameters[local]` or `_buffers`."""
    owner: nn.Module
    local: str
    is_parameter: bool

    def held(self) -> torch.Tensor | None:
        return (self.owner._parameters if self.is_parameter else self.owner._buffers)[self.local]


class LayerStorage:
    """The stacked tensors of `members` (a segment's layers, or its groups),
    by name (see the module docstring).

    Args:
      members: the layers (or groups), alike in structure.
      names: the names of their tensors, parameters and buffers, in the
        layers' order.
    """

    def __init__(self, members: list[nn.Module], names: list[str]):
        self.size = len(members)
        self.slots: dict[str, list[_Slot]] = {}
        for name in names:
            owner_path, _, local = name.rpartition(".")
            owners = [member.get_submodule(owner_path) for member in members]
            self.slots[name] = [_Slot(owner, local, local in owner._parameters)
                                for owner in owners]
        # Each parameter name's layer Parameters, the objects the layers keep.
        self.parameters: dict[str, list[nn.Parameter]] = {
            name: [slot.held() for slot in slots]
            for name, slots in self.slots.items() if slots[0].is_parameter}
        self._handed: dict[str, list] = {}  # the gradient views last given, per name
        self._hidden: dict[str, list[bool]] = {}  # which of them a sync set aside
        self._kept: dict[str, torch.Tensor] = {}  # their stacked gradient, during a sync
        self._views: dict[str, list[torch.Tensor]] = {}  # the buffer views put in place
        self._shardings: dict[str, tuple] = {}  # (mesh, spec) per name, as the layers asked
        with torch.no_grad():
            self.stacked = {name: self._stack_held(name) for name in self.slots}
        self._start()

    def _stack_held(self, name: str) -> torch.Tensor:
        stacked = torch.stack([slot.held().detach() for slot in self.slots[name]])
        _STACKED[stacked] = (self, name)
        if name in self.parameters:
            self._require_grad(stacked, name, any(param.requires_grad
                                                  for param in self.parameters[name]))
        return stacked

    def _require_grad(self, stacked: torch.Tensor, name: str, wanted: bool) -> None:
        """Sets `stacked.requires_grad`, with the gradient hooks (above) once it does."""
        stacked.requires_grad_(wanted)
        if wanted and not getattr(stacked, "_layer_hooks", False):
            stacked.register_hook(lambda grad, name=name: self._before_accumulating(name))
            stacked.register_post_accumulate_grad_hook(
                lambda _, name=name: self._after_accumulating(name))
            stacked._layer_hooks = True

    def _start(self) -> None:
        computed_now(list(self.stacked.values()))
        self.show_views()
        _LIVE.add(self)
        for name, params in self.parameters.items():
            for index, param in enumerate(params):
                _PLACES[param] = (self, name, index)
        if any(tensor.device.type == "xla" for tensor in self.stacked.values()):
            around_live_tensor_ops(hide_all_views, show_all_views)

    def show_views(self) -> None:
        """Points every layer tensor at its slice of the stacked one, and gives
        back the gradient views a sync set aside."""
        with torch.no_grad():
            for name, slots in self.slots.items():
                views = self.stacked[name].unbind(0)
                if slots[0].is_parameter:
                    for slot, view in zip(slots, views):
                        slot.held().data = view
                else:
                    for slot, view in zip(slots, views):
                        slot.owner._buffers[slot.local] = view
                    self._views[name] = list(views)
            for name, hidden in self._hidden.items():
                grad = self._kept.pop(name, None)
                if grad is not None:
                    handed = self._handed[name]
                    for index, view in enumerate(grad.unbind(0)):
                        if hidden[index]:
                            self.parameters[name][index].grad = handed[index] = view
            self._hidden.clear()

    def hide_views(self) -> None:
        """Points every layer tensor (and gradient view) at an empty tensor
        until `show_views`, so that a sync computes no view."""
        for name, slots in self.slots.items():
            empty = _empty_like(self.stacked[name])
            for slot in slots:
                if slot.is_parameter:
                    slot.held().data = empty
                else:
                    slot.owner._buffers[slot.local] = empty
        for name, handed in self._handed.items():
            params, given = self.parameters[name], self.given_gradient(name)
            # The views of the stacked gradient (a layer's gradient of its own stays).
            hidden = self._hidden[name] = [
                given is not None and view is not None and param.grad is view
                and view._base is given for param, view in zip(params, handed)]
            if any(hidden):  # computed by the sync, sliced again after it
                self._kept[name] = given
            for param, each in zip(params, hidden):
                if each:
                    param.grad = None
            # Views held here would be computed too (`show_views` makes new ones);
            # what no layer holds any more is no one's.
            self._handed[name] = [view if not each and param.grad is view else None
                                  for param, view, each in zip(params, handed, hidden)]
        self._views.clear()

    def operands(self) -> dict[str, torch.Tensor]:
        """The stacked tensors a scan reads (see the module docstring)."""
        tensors = {}
        for name, slots in self.slots.items():
            held = [slot.held() for slot in slots]
            own = self.parameters.get(name) or self._views.get(name) or ()
            if any(tensor is not mine for tensor, mine in zip(held, own)):
                tensors[name] = torch.stack(held)
                continue
            stacked = self.stacked[name]
            if name in self.parameters:
                wanted = any(param.requires_grad for param in held)
                if stacked.requires_grad != wanted:
                    self._require_grad(stacked, name, wanted)
            tensors[name] = stacked
        return tensors

    def shard(self, name: str, index: int, mesh, partition_spec: tuple, mark_sharding) -> None:
        """Shards the stacked tensor `name` as layer `index` asks its own
        (`partition_spec`), the layer dimension whole, with torch_xla's
        `mark_sharding`; the layers share one sharding per tensor, so a
        layer asking another than an earlier one raises a ValueError."""
        asked = (mesh, tuple(partition_spec))
        given = self._shardings.get(name)
        if given is None:
            mark_sharding(self.stacked[name], mesh, (None, *partition_spec))
            self._shardings[name] = asked
            self.show_views()
        elif given[1] != asked[1] or given[0] is not mesh:
            raise ValueError(
                f"mark_sharding of layer {index}'s '{name}' with {tuple(partition_spec)!r}: the "
                f"stacked layers hold that tensor as one stacked tensor, sharded as an earlier "
                f"call gave it ({given[1]!r} on its mesh), the same for every layer. Give every "
                f"layer the same spec, or run the model unconverted (unstack_layers(model)).")

    def given_gradient(self, name: str) -> torch.Tensor | None:
        """The stacked gradient whose slices the layers were last given, while
        one of them holds its view."""
        for param, view in zip(self.parameters[name], self._handed.get(name) or ()):
            if view is not None and param.grad is view and view._base is not None:
                return view._base
        return None

    def hands_whole_gradient(self, name: str) -> bool:
        """Whether every layer Parameter of `name` requires grad and holds the
        view of the stacked gradient it was given (none replaced or cleared)."""
        return (all(param.requires_grad for param in self.parameters[name])
                and self._all_hold_given(name) and self.given_gradient(name) is not None)

    def _all_hold_given(self, name: str) -> bool:
        """Whether every layer Parameter of `name` holds the gradient last given it."""
        handed = self._handed.get(name)
        return handed is not None and all(
            view is not None and param.grad is view
            for param, view in zip(self.parameters[name], handed))

    def _before_accumulating(self, name: str) -> None:
        """Before the stacked gradient accumulates: into the one the layers
        hold the views of, or one stacked from what they hold instead."""
        stacked, params = self.stacked[name], self.parameters[name]
        given = self.given_gradient(name)
        if given is not None and self._all_hold_given(name):
            stacked.grad = given
            return None
        grads = [param.grad for param in params]
        with torch.no_grad():
            stacked.grad = None if all(grad is None for grad in grads) else torch.stack(
                [torch.zeros_like(stacked[0]) if grad is None else grad for grad in grads])
        self._handed[name] = grads  # in the stacked gradient now: views of it replace them
        return None

    def _after_accumulating(self, name: str) -> None:
        """Gives each layer parameter that requires grad its slice of the
        stacked gradient (added to a gradient of its own, if it holds one);
        the views hold the stacked gradient from then on."""
        stacked, params = self.stacked[name], self.parameters[name]
        handed = self._handed.get(name) or [None] * self.size
        grad = stacked.grad
        with torch.no_grad():
            for param, view, given in zip(params, grad.unbind(0), handed):
                if not param.requires_grad:
                    continue
                if param.grad is None or param.grad is given:
                    param.grad = view
                else:
                    param.grad.add_(view)
        self._handed[name] = [param.grad for param in params]
        stacked.grad = None

    def restacked(self) -> None:
        """Stacks again what the layers hold where it is no longer a view of
        the stacked tensor (moved or cast by `.to()`, which makes new
        Parameters when it moves them to another kind of device)."""
        for params in self.parameters.values():
            for param in params:
                _PLACES.pop(param)
        self.parameters = {name: [slot.held() for slot in self.slots[name]]
                           for name in self.parameters}
        with torch.no_grad():
            for name, slots in self.slots.items():
                held = [slot.held() for slot in slots]
                if not all(tensor.numel() == 0 or torch._C._is_alias_of(tensor, self.stacked[name])
                           for tensor in held):
                    self.stacked[name] = self._stack_held(name)
                    self._handed.pop(name, None)
        self._start()

    def release(self) -> None:
        """Gives each layer tensor a copy of its slice of its own, and stops
        keeping the views (the layers leave the stack)."""
        _LIVE.discard(self)
        with torch.no_grad():
            for name, slots in self.slots.items():
                for slot, view in zip(slots, self.stacked[name].unbind(0)):
                    if slot.is_parameter:
                        slot.held().data = view.clone()
                    else:
                        slot.owner._buffers[slot.local] = view.clone()
        for params in self.parameters.values():
            for param in params:
                _PLACES.pop(param)
                if param.grad is not None and param.grad._base is not None:
                    param.grad = param.grad.clone()  # a view of the stacked gradient: its own

    def __getstate__(self) -> dict:
        # The layers' tensors are copied with them; the stack is made again from those.
        return {"size": self.size, "slots": self.slots, "parameters": self.parameters}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handed, self._hidden, self._kept, self._views, self._shardings = {}, {}, {}, {}, {}
        with torch.no_grad():
            self.stacked = {name: self._stack_held(name) for name in self.slots}
        self._start()


def computed_now(tensors: list[torch.Tensor]) -> None:
    """Computes the XLA tensors among `tensors` now, in a graph of their own.
    Left lazy, the stacking (or slicing) of a model already on the device
    would be part of the next step's graph, which would then differ from
    every later step's and compile twice, and the tensors it reads would stay
    alive until then. (Tensors computed from placeholders have no value.)"""
    lazy = [tensor for tensor in tensors
            if tensor.device.type == "xla" and not depends_on_placeholder(tensor)]
    if lazy:
        torch_xla._XLAC._xla_sync_multi(lazy, devices=[], wait=False)


# Per (dtype, device), an empty tensor computed once: a new one at each sync
# would be a graph of its own.
_EMPTY: dict[tuple, torch.Tensor] = {}


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    key = (tensor.dtype, str(tensor.device))
    if key not in _EMPTY:
        empty = tensor.new_empty(0)
        computed_now([empty])
        _EMPTY[key] = empty
    return _EMPTY[key]


def storage_of(param: torch.Tensor) -> tuple[LayerStorage, str, int] | None:
    """(storage, tensor name, layer) of a layer Parameter a storage holds, or None."""
    return _PLACES.get(param)


def stacked_place(tensor: torch.Tensor) -> tuple[LayerStorage, str] | None:
    """(storage, tensor name) of a stacked tensor, or None."""
    return _STACKED.get(tensor)


def hide_all_views() -> None:
    for storage in _on_xla():
        storage.hide_views()


def show_all_views() -> None:
    for storage in _on_xla():
        storage.show_views()


def _on_xla() -> list[LayerStorage]:
    return [storage for storage in list(_LIVE)
            if next(iter(storage.stacked.values())).device.type == "xla"]
