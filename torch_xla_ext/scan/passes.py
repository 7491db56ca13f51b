"""Small passes over a traced step, each deciding what a loop need not carry,
copy or stack."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch_xla

from torch_xla_ext.scan.loop import reads_random_seed

_XLAC = torch_xla._XLAC


def read_only_carries(carry_out: Sequence[torch.Tensor], carry_arg: Sequence[torch.Tensor],
                      written: Sequence[bool]) -> list:
    """A carry `fn` returns unchanged (the tensor it received, not written in
    place) is read-only: it leaves the loop (as a loop invariant) and its
    output is `init` itself."""
    return [out is arg and not w for out, arg, w in zip(carry_out, carry_arg, written)]


def ys_passed_from_xs(y_out: Sequence[torch.Tensor], x_arg: Sequence[torch.Tensor],
                      written: Sequence[int]) -> list:
    """For each y, the index of the x slice `fn` returned as it unchanged (not
    written in place; that ys leaf is then the xs leaf, not a stacked copy), or
    None."""
    x_index = {id(x): i for i, x in enumerate(x_arg) if i not in written}
    return [x_index.get(id(y)) for y in y_out]


class FromX(NamedTuple):
    """A saved value that is x slice `index`: the backward step reads it from xs."""
    index: int

    def read(self, x_slices, activations):
        return x_slices[self.index]


class Recomputed(NamedTuple):
    """A saved value the backward step computes again from its own inputs."""
    value: torch.Tensor

    def read(self, x_slices, activations):
        return self.value


class Stacked(NamedTuple):
    """A saved value the forward loop stacks: activation `index`."""
    index: int

    def read(self, x_slices, activations):
        return activations[self.index]


def classify_saved(saved: Sequence[torch.Tensor], saved_nodes: Sequence, fw_graph,
                   carry_in: Sequence[torch.Tensor], x_in: Sequence[torch.Tensor]):
    """Where the backward step gets each value the forward graph saves for it.

    An x slice is read from xs (`FromX`); a value computed from invariants
    alone, or from an x slice by layout ops alone (a layer weight's transpose),
    is recomputed in the backward step (`Recomputed`), unless a random op made
    it (a dropout mask drawn again would differ); anything else is an
    activation, stacked by the forward loop (`Stacked`). Returns the sources
    (each `.read(x_slices, activations)` gives the value in the backward step)
    and the activations."""
    n_carry = len(carry_in)
    carry_ids = {_XLAC._xla_get_tensor_id(t) for t in carry_in}
    x_ids = {_XLAC._xla_get_tensor_id(t) for t in x_in}
    x_index = {id(t): i for i, t in enumerate(x_in)}
    primal_nodes = [n for n in fw_graph.graph.nodes if n.op == "placeholder"]
    free_inputs = set(primal_nodes[n_carry:])  # x slices and invariants
    sources, activations = [], []
    for value, node in zip(saved, saved_nodes):
        reads = set(_XLAC._get_tensors_xla_device_data_node([value])[0])
        if id(value) in x_index:
            sources.append(FromX(x_index[id(value)]))
        elif carry_ids.isdisjoint(reads) and not reads_random_seed(value) and (
                x_ids.isdisjoint(reads) or _is_layout_of(node, free_inputs)):
            sources.append(Recomputed(value))
        else:
            sources.append(Stacked(len(activations)))
            activations.append(value)
    return sources, activations


# Ops that move no data but only reinterpret its layout: recomputing them in the
# backward step costs nothing, stacking their results costs a copy per step.
# (checkpoint_name is an identity that names a value.)
_LAYOUT_OPS = frozenset(["t", "transpose", "permute", "view", "_unsafe_view", "reshape",
                         "expand", "slice", "select", "unsqueeze", "squeeze", "alias",
                         "detach", "clone", "checkpoint_name"])


def _is_layout_of(node, inputs: set) -> bool:
    """Whether the FX `node` is computed from `inputs` by layout ops alone
    (or the `+ 0` that `sharding.as_fn_arguments` adds under SPMD)."""
    if node in inputs:
        return True
    if node.op != "call_function":
        return False
    opname = getattr(node.target, "_opname", None)
    if opname == "add" and node.args[1:] == (0,) and not node.kwargs:
        return _is_layout_of(node.args[0], inputs)
    if opname not in _LAYOUT_OPS:
        return False
    return all(_is_layout_of(arg, inputs) for arg in node.all_input_nodes)
