"""A converted model's stacked tensors under their unconverted names, for
comparisons with the unconverted model: the stacks' own name map
(`StackedList.layer_parameters`) says which slice of which stored tensor
each per-layer parameter is."""
from torch_xla_ext.layer_stack import StackedList


def per_layer_grads(model) -> dict:
    """Every gradient under its parameter's unconverted name (frozen parameters have none)."""
    return {name: param.grad for name, param in per_layer_parameters(model).items()
            if param.grad is not None}


def per_layer_parameters(model) -> dict:
    """Every parameter under its unconverted name: a stacked one's slices as
    views, with their gradients' slices as `.grad` where they have one."""
    found, stacked = {}, set()
    for path, stack in model.named_modules():
        if not isinstance(stack, StackedList):
            continue
        prefix = f"{path}." if path else ""
        params = dict(stack.named_parameters())
        for stored, index, per_layer in stack.layer_parameters():
            param = params[stored]
            stacked.add(prefix + stored)
            found[prefix + per_layer] = param if index is None else _Slice(param, index)
    for name, param in model.named_parameters():
        if name not in stacked:
            found[name] = param
    return found


class _Slice:
    """Slice `index` of a stacked parameter, as a parameter of its own reads."""

    def __init__(self, param, index: int):
        self.param, self.index = param, index

    @property
    def grad(self):
        return None if self.param.grad is None else self.param.grad[self.index]

    @property
    def data(self):
        return self.param.data[self.index]

    @property
    def requires_grad(self):
        return self.param.requires_grad
