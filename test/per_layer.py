"""A converted model's parameters and gradients by their names, for
comparisons with the unconverted model: the layers' own Parameters keep
their unconverted names, and their gradients are slices of the stacked ones."""


def per_layer_grads(model) -> dict:
    """Every gradient under its parameter's name (frozen parameters have none)."""
    return {name: param.grad for name, param in model.named_parameters()
            if param.grad is not None}


def per_layer_parameters(model) -> dict:
    """Every parameter under its name."""
    return dict(model.named_parameters())


class StackedTensors:
    """A segment's stacked tensors by attribute path, as a module tree reads
    them (`stacked_tensors(stack.segments[0]).self_attn.q_proj.weight`)."""

    def __init__(self, tensors: dict, prefix: str = ""):
        self._tensors, self._prefix = tensors, prefix

    def __getattr__(self, name: str):
        path = self._prefix + name
        if path in self._tensors:
            return self._tensors[path]
        if not any(key.startswith(path + ".") for key in self._tensors):
            raise AttributeError(f"no stacked tensor under {path!r}")
        return StackedTensors(self._tensors, path + ".")


def stacked_tensors(segment) -> StackedTensors:
    """The stacked tensors of a `StackedList`'s segment stack."""
    return StackedTensors(segment.storage.stacked)


def stacked_of(model) -> dict:
    """Every stacked tensor of the model's stacked lists, by the list's path,
    segment and tensor name ('model.layers/0/self_attn.q_proj.weight')."""
    from torch_xla_ext.layer_stack import StackedList

    return {f"{path}/{number}/{name}": tensor
            for path, module in model.named_modules() if isinstance(module, StackedList)
            for number, stack in enumerate(module.segments) if hasattr(stack, "storage")
            for name, tensor in stack.storage.stacked.items()}


def stacked_grads_of(model) -> dict:
    """The stacked gradients whose slices the layers hold, keyed as `stacked_of`
    (None where the layers hold none)."""
    from torch_xla_ext.layer_stack import StackedList

    return {f"{path}/{number}/{name}": stack.storage.given_gradient(name)
            for path, module in model.named_modules() if isinstance(module, StackedList)
            for number, stack in enumerate(module.segments) if hasattr(stack, "storage")
            for name in stack.storage.parameters}
