"""Run a stack of structurally identical layers as one `scan`.

`LayerStack` keeps each parameter and buffer of its layers once, stacked along
a new leading layer dimension, and hands those stacked tensors to `scan` as
`xs`. Each loop iteration slices one layer's weights out inside the XLA While
loop, so neither the forward nor the backward copies the weights, and the
gradients land in the stacked parameters' `.grad`.

`scan_layers` is the drop-in for `torch_xla.experimental.scan_layers.scan_layers`
(and for `for layer in layers: x = layer(x)`) on layers kept in a list: it
stacks their tensors at every call, which copies them, then runs the same scan.

Both trace one layer (the template) once per combination of layer settings and
call arguments; they check first that every layer has the same structure,
tensor shapes and settings as the template, since the template's code runs for
every layer.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import operator
import types
import weakref
from typing import Any, Iterable

import torch
from functorch.compile import default_partition
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from torch_xla_ext.scan import scan

__all__ = ["LayerStack", "scan_layers"]

# Keys that every nn.Module puts in its __dict__ for its own bookkeeping (hooks,
# registries); `training` is not among them because it changes the computation.
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}

_NOT_PLAIN = object()


def _plain_value(value: Any) -> Any:
    """`value` in a hashable, comparable form if it is a plain Python value, else `_NOT_PLAIN`.

    Plain values are the ones a layer's settings are made of: numbers, strings,
    None, enums, dtypes, functions (compared by their code, so the same lambda
    created in each layer's __init__ counts as one setting) and tuples or lists
    of those.
    """
    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype)):
        return value
    if isinstance(value, types.FunctionType):
        return value.__code__
    if isinstance(value, types.BuiltinFunctionType):
        return value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain_value(item) for item in value)
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    return _NOT_PLAIN


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    is_parameter: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    # requires_grad for a parameter, persistent (saved in state_dict) for a buffer.
    flag: bool

    def describe(self) -> str:
        flag = ("requires_grad" if self.is_parameter else "persistent") + f"={self.flag}"
        return f"shape {self.shape}, dtype {self.dtype}, {flag}"


@dataclasses.dataclass(frozen=True)
class _LayerLayout:
    """What must agree between the layers of a stack."""
    # Submodule path ('' for the layer itself) -> module type.
    modules: dict[str, type]
    # 'path.attribute' -> plain value, for each submodule's non-tensor settings.
    settings: dict[str, Any]
    # Parameter or buffer name ('self_attn.q_proj.weight') -> spec, in state_dict order.
    tensors: dict[str, _TensorSpec]

    def trace_key(self) -> tuple:
        """The part of the layout that decides what a trace of the layer computes."""
        return tuple(self.modules.items()), tuple(self.settings.items())


def _layout(layer: nn.Module, ignored_attributes: frozenset[str]) -> _LayerLayout:
    modules, settings, tensors = {}, {}, {}
    for path, module in layer.named_modules():
        modules[path] = type(module)
        for attribute, value in vars(module).items():
            if attribute in _MODULE_BOOKKEEPING or attribute in ignored_attributes:
                continue
            plain = _plain_value(value)
            if plain is not _NOT_PLAIN:
                settings[_join(path, attribute)] = plain
        for name, param in module._parameters.items():
            if param is not None:
                tensors[_join(path, name)] = _TensorSpec(True, tuple(param.shape),
                                                         param.dtype, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                tensors[_join(path, name)] = _TensorSpec(False, tuple(buffer.shape),
                                                         buffer.dtype, persistent)
    return _LayerLayout(modules, settings, tensors)


_SAME_CODE_NOTE = ("the stack runs layer 0's code and settings for every layer, "
                   "so all layers must be built the same way")


def _key_difference(index: int, what: str, reference: dict, other: dict) -> str | None:
    missing = [key for key in reference if key not in other]
    extra = [key for key in other if key not in reference]
    if not missing and not extra:
        return None
    parts = []
    if missing:
        parts.append(f"lacks {what} {missing}")
    if extra:
        parts.append(f"has extra {what} {extra}")
    return (f"Layer {index} differs from layer 0: it {' and '.join(parts)}; "
            f"{_SAME_CODE_NOTE}.")


def _check_same_layout(index: int, reference: _LayerLayout, other: _LayerLayout) -> None:
    """Raises TypeError/ValueError naming the first thing layer `index` does differently."""
    message = _key_difference(index, "submodules", reference.modules, other.modules)
    if message:
        raise ValueError(message)
    for path, module_type in reference.modules.items():
        if other.modules[path] is not module_type:
            where = f"submodule '{path}'" if path else "itself"
            raise TypeError(f"Layer {index} {where} is a {other.modules[path].__name__} but "
                            f"layer 0's is a {module_type.__name__}; {_SAME_CODE_NOTE}.")
    message = _key_difference(index, "parameters/buffers", reference.tensors, other.tensors)
    if message:
        raise ValueError(message)
    for name, spec in reference.tensors.items():
        if other.tensors[name] != spec:
            kind = "parameter" if spec.is_parameter else "buffer"
            raise ValueError(
                f"Layer {index} {kind} '{name}' has {other.tensors[name].describe()} but "
                f"layer 0's has {spec.describe()}; the stack keeps one [num_layers, ...] "
                f"tensor per name, so every layer's '{name}' must match layer 0's.")
    message = _key_difference(index, "settings", reference.settings, other.settings)
    if message:
        raise ValueError(message)
    for name, value in reference.settings.items():
        if other.settings[name] != value:
            attribute = name.rpartition(".")[2]
            raise ValueError(
                f"Layer {index} setting '{name}' is {other.settings[name]!r} but layer 0's "
                f"is {value!r}; {_SAME_CODE_NOTE}. If '{attribute}' does not change what "
                f"the layer computes (a layer index used for caching, say), pass "
                f"ignored_attributes=({attribute!r},).")


def _check_identical_layers(layers: list, ignored_attributes: Iterable[str]) -> _LayerLayout:
    """Returns layer 0's layout after checking that every layer shares it."""
    ignored = frozenset(ignored_attributes)
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"Layer {index} is a {type(layer).__name__}, not an nn.Module; "
                            f"pass a list or nn.ModuleList of layers.")
    reference = _layout(layers[0], ignored)
    for index, layer in enumerate(layers[1:], start=1):
        _check_same_layout(index, reference, _layout(layer, ignored))
    return reference


def _layer_tensors(layer: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    tensors = dict(layer.named_parameters(remove_duplicate=False))
    tensors.update(layer.named_buffers(remove_duplicate=False))
    return {name: tensors[name] for name in names}


# Per template layer, the scan step functions made for it, one per trace key.
# `scan` caches its trace on the function's identity, so each combination of
# layer settings and constant call arguments keeps its own function object.
_STEP_FUNCTIONS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

# Stands in the call key for a tensor argument, which is passed through the carry.
_TENSOR_ARGUMENT = object()


def _argument_path(path) -> str:
    """'args[1]' or "kwargs['mask']" for a leaf path of the pytree `(args, kwargs)`."""
    return ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])


def _split_arguments(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """Splits layer call arguments into tensors and a hashable description of the rest."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors, constants = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            constants.append(_TENSOR_ARGUMENT)
            continue
        if _plain_value(leaf) is _NOT_PLAIN:
            path = next(path for path, value in tree_flatten_with_path((args, kwargs))[0]
                        if value is leaf)
            raise TypeError(
                f"Layer argument {_argument_path(path)} has type {type(leaf).__name__}; layers "
                f"in a stack run inside one traced loop, so each extra argument must be a "
                f"tensor or a plain constant (None, bool, int, float, str).")
        # With its type, since True == 1 == 1.0 would otherwise share one trace.
        constants.append((type(leaf), leaf))
    return tuple(tensors), (spec, tuple(constants))


def _make_step(template_ref: weakref.ref, arguments: tuple, hidden_from_tuple: bool):
    spec, constants = arguments

    def run_one_layer(carry, layer_tensors):
        hidden, tensor_arguments = carry
        supplied = iter(tensor_arguments)
        leaves = [next(supplied) if constant is _TENSOR_ARGUMENT else constant[1]
                  for constant in constants]
        args, kwargs = tree_unflatten(leaves, spec)
        output = torch.func.functional_call(template_ref(), layer_tensors, (hidden, *args),
                                            kwargs, strict=True)
        if hidden_from_tuple and isinstance(output, tuple):
            output = output[0]
        return (output, tensor_arguments), None

    return run_one_layer


def _run_layers(template: nn.Module, layout: _LayerLayout,
                stacked_tensors: dict[str, torch.Tensor], hidden, args: tuple,
                kwargs: dict, *, hidden_from_tuple: bool, partition_fn,
                is_layer_pure) -> Any:
    """Runs `template` once per layer slice of `stacked_tensors`, threading `hidden`.

    `args`/`kwargs` go to every layer; their tensors ride along in the carry
    unchanged, so they reach the layers as loop inputs and gradients flow back to
    them. `layout` is the template's current layout.
    """
    tensor_arguments, arguments = _split_arguments(args, kwargs)
    key = (layout.trace_key(), arguments, hidden_from_tuple)
    steps = _STEP_FUNCTIONS.setdefault(template, {})
    step = steps.get(key)
    if step is None:
        step = steps[key] = _make_step(weakref.ref(template), arguments, hidden_from_tuple)
    (hidden, _), _ = scan(step, (hidden, tensor_arguments), stacked_tensors,
                          partition_fn=partition_fn, is_fn_pure=is_layer_pure)
    return hidden


def scan_layers(layers: Iterable[nn.Module], input_data, partition_fn=default_partition,
                is_layer_pure=None, *, ignored_attributes: Iterable[str] = ()):
    """Runs `layers` in sequence on `input_data` as one scan; returns the last output.

    Equivalent to `for layer in layers: input_data = layer(input_data)` (the
    whole output of a layer is the next layer's input), and a drop-in for
    `torch_xla.experimental.scan_layers.scan_layers`. The layers must be
    identical in structure, tensor shapes/dtypes and settings; attributes named
    in `ignored_attributes` may differ (layer 0's value is used for all).

    This stacks the layers' tensors at every call, a copy of all the weights
    that the backward pass flows through too; keep the layers in a `LayerStack`
    to avoid it.
    """
    layers = list(layers)
    if not layers:
        return input_data
    layout = _check_identical_layers(layers, ignored_attributes)
    per_layer = [_layer_tensors(layer, layout.tensors) for layer in layers]
    stacked = {name: torch.stack([tensors[name] for tensors in per_layer])
               for name in layout.tensors}
    return _run_layers(layers[0], layout, stacked, input_data, (), {},
                       hidden_from_tuple=False, partition_fn=partition_fn,
                       is_layer_pure=is_layer_pure)


class _StackedTensors(nn.Module):
    """Holds the stacked tensors of one submodule path of the layers."""


def _meta_copy(layer: nn.Module) -> nn.Module:
    """A deep copy of `layer` whose parameters and buffers are meta tensors (no data)."""
    memo = {}
    for param in layer.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(layer, memo)


def _state_dict_per_layer(stack: "LayerStack", state_dict, prefix: str,
                          local_metadata) -> None:
    """state_dict post-hook: replaces the stacked entries by per-layer ones."""
    storage_prefix = prefix + "stacked."
    stacked = {key[len(storage_prefix):]: state_dict.pop(key)
               for key in list(state_dict) if key.startswith(storage_prefix)}
    for index in range(len(stack)):
        for name, tensor in stacked.items():
            state_dict[f"{prefix}{index}.{name}"] = tensor[index]
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None and stack._template is not None:
        for key in [key for key in metadata
                    if key == storage_prefix[:-1] or key.startswith(storage_prefix)]:
            del metadata[key]
        for index in range(len(stack)):
            for path, module in stack._template.named_modules():
                metadata[_join(f"{prefix}{index}", path)] = {"version": module._version}


class LayerStack(nn.Module):
    """Structurally identical layers, run as one scan with their weights stacked.

    Built from an `nn.ModuleList` (or any iterable) of layers, it copies every
    parameter and buffer into one tensor per name with a leading layer
    dimension, held under `stacked` (`stack.stacked.self_attn.q_proj.weight` is
    `[num_layers, out, in]`); those are its `parameters()`, for optimizers and
    gradient clipping. The original layers are not used afterwards: drop them to
    free their memory.

    `stack(hidden, *args, **kwargs)` runs the layers in order, each called as
    `layer(hidden, *args, **kwargs)` with the same extra arguments (attention
    masks, position ids, rotary embeddings as tensors, or plain constants). When
    a layer returns a tuple its first element is the hidden state for the next
    layer and the rest (attention weights, caches) is discarded: the stack
    returns the last layer's hidden state only. The hidden state must keep its
    shape and dtype from layer to layer. An empty stack returns `hidden`.

    `stack[i]` is layer i as a module of the layers' type whose parameters and
    buffers are views of slice i of the stacked tensors (not Parameters of its
    own), rebuilt at each access; changing its settings does not change the
    stack. `len(stack)` is the number of layers; iterating yields each layer.

    `state_dict()` and `load_state_dict()` use the per-layer names and tensors an
    `nn.ModuleList` of the same layers would (`3.self_attn.q_proj.weight`), so
    checkpoints move between the two.

    Args:
      layers: the layers, identical in submodule types and names, parameter and
        buffer shapes and dtypes, and plain settings (dropout `p`, `eps`,
        `training`, ...).
      partition_fn, is_layer_pure: passed to `scan` as `partition_fn` and
        `is_fn_pure`.
      ignored_attributes: names of plain attributes allowed to differ between
        layers because they do not change the computation (such as a
        `layer_idx` used only for caching); layer 0's values are used.
    """

    def __init__(self, layers: Iterable[nn.Module], *, partition_fn=default_partition,
                 is_layer_pure=None, ignored_attributes: Iterable[str] = ()):
        super().__init__()
        layers = list(layers)
        self.partition_fn = partition_fn
        self.is_layer_pure = is_layer_pure
        self.ignored_attributes = frozenset(ignored_attributes)
        self.num_layers = len(layers)
        self.stacked = _StackedTensors()
        # The layer whose code runs each step; kept out of _modules so that it is
        # no part of parameters(), state_dict() or .to().
        self.__dict__["_template"] = None
        self.register_state_dict_post_hook(_state_dict_per_layer)
        if not layers:
            return
        layout = _check_identical_layers(layers, self.ignored_attributes)
        _check_no_shared_parameters(layers)
        self.__dict__["_template"] = _meta_copy(layers[0])
        self.training = layers[0].training
        with torch.no_grad():
            per_layer = [_layer_tensors(layer, layout.tensors) for layer in layers]
            for name, spec in layout.tensors.items():
                owner_path, _, local_name = name.rpartition(".")
                owner = self._storage(owner_path)
                stacked = torch.stack([tensors[name] for tensors in per_layer])
                if spec.is_parameter:
                    owner.register_parameter(local_name,
                                             nn.Parameter(stacked, requires_grad=spec.flag))
                else:
                    owner.register_buffer(local_name, stacked, persistent=spec.flag)

    def _storage(self, path: str) -> _StackedTensors:
        """The `_StackedTensors` for submodule `path`, created on first use."""
        node = self.stacked
        for part in path.split(".") if path else ():
            if part not in node._modules:
                node.add_module(part, _StackedTensors())
            node = node._modules[part]
        return node

    def _stacked_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.stacked.named_parameters())
        tensors.update(self.stacked.named_buffers())
        return tensors

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Layer index {index} is out of range for a LayerStack of "
                             f"{len(self)} layers.")
        layer = copy.deepcopy(self._template)
        for name, tensor in self._stacked_tensors().items():
            owner_path, _, local_name = name.rpartition(".")
            owner = layer.get_submodule(owner_path)
            registry = owner._parameters if local_name in owner._parameters else owner._buffers
            registry[local_name] = tensor[index]
        return layer

    def __iter__(self):
        return (self[index] for index in range(len(self)))

    def train(self, mode: bool = True) -> "LayerStack":
        super().train(mode)
        if self._template is not None:
            self._template.train(mode)
        return self

    def forward(self, hidden, *args, **kwargs):
        if self._template is None:
            return hidden
        layout = _layout(self._template, self.ignored_attributes)
        return _run_layers(self._template, layout, self._stacked_tensors(), hidden, args,
                           kwargs, hidden_from_tuple=True, partition_fn=self.partition_fn,
                           is_layer_pure=self.is_layer_pure)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # Gathers the per-layer entries into one stacked entry per tensor, which
        # the `stacked` submodules then load; what is absent or the wrong shape is
        # reported under its per-layer name and keeps the current value.
        # The stacked state_dict lists the persistent tensors only, as checkpoints do.
        for name, current in self.stacked.state_dict(keep_vars=True).items():
            slices = []
            for index in range(len(self)):
                key = f"{prefix}{index}.{name}"
                loaded = state_dict.pop(key, None)
                if loaded is None:
                    if strict:
                        missing_keys.append(key)
                elif loaded.shape != current.shape[1:]:
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {loaded.shape} from "
                        f"checkpoint, the shape in current model is {current.shape[1:]}.")
                    loaded = None
                slices.append(loaded)
            found = next((loaded for loaded in slices if loaded is not None), None)
            if found is None:
                stacked = current.detach()
            else:
                stacked = torch.stack([
                    current[index].detach().to(found) if loaded is None else loaded
                    for index, loaded in enumerate(slices)
                ])
            state_dict[f"{prefix}stacked.{name}"] = stacked
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        layer_type = type(self._template).__name__ if self._template is not None else "-"
        return f"num_layers={len(self)}, layer={layer_type}"


def _check_no_shared_parameters(layers: list) -> None:
    """LayerStack gives each layer its own slice, which would untie shared parameters."""
    owners = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            first_index, first_name = owners.setdefault(id(param), (index, name))
            if first_index != index:
                raise ValueError(
                    f"Layer {index} parameter '{name}' is the same tensor as layer "
                    f"{first_index}'s '{first_name}'; a LayerStack stores one copy per layer "
                    f"and would untie them. Give each layer its own parameters, or keep "
                    f"the shared one outside the layers.")
