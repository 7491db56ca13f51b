"""Under data parallelism, which dimension of each value a step computes
holds the batch.

When a loop's carry is split along its leading dimension over every device
(data parallelism, FSDP's: each device holds its part of the batch), every
activation computed from it holds its own part of the batch in the unrolled
layers. The forward loop and the backward loop are two While loops, and XLA
chooses the sharding of each one's state apart: a saved activation stacked
batch-split by the forward loop could be read split on another dimension by
the backward loop, and resharded, whole stack and every step. So the
training plan pins what the forward loop stacks, and the backward loop
reads, to the split along the dimension that holds the batch, which
`batch_dims` follows through the forward graph, op by op: through pointwise
ops, reductions over other dimensions, products that keep it, layout ops.
Where an op's rule is unknown, or the batch is reduced or mixed, the value
has none and is not pinned: XLA chooses, as it would without this.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import fx

from torch_xla_ext import policies

aten = torch.ops.aten

# Ops whose output is their first argument's layout unchanged.
_IDENTITIES = frozenset([aten.clone.default, aten.alias.default, aten.detach.default,
                         aten._to_copy.default, policies.NAMED_OP,
                         torch.ops.torch_xla_ext.sharding_constraint.default])
_REDUCTIONS = frozenset([aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
                         aten.amin.default, aten.var.correction, aten.prod.dim_int])
_VIEWS = frozenset([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
# Matrix products: per operand, where each of its dimensions goes in the
# output (None: contracted).
_MATRIX = ({0: 0, 1: None}, {0: None, 1: 1})
_PRODUCTS = {aten.mm.default: _MATRIX, aten.addmm.default: _MATRIX,
             aten.bmm.default: ({0: 0, 1: 1, 2: None}, {0: 0, 1: None, 2: 2})}


def batch_dims(graph_module: fx.GraphModule, sources: Mapping[fx.Node, int],
               batch: int) -> dict:
    """The dimension holding the batch (of `batch` examples) of each node of
    `graph_module` that has one, from the `sources` (placeholders) and
    theirs; a dimension may hold it merged with the ones after it (tokens,
    [batch * sequence, ...])."""
    found = dict(sources)
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node not in found:
            dim = _rule(node, found, batch)
            if dim is not None:
                found[node] = dim
    return found


def _shape(node) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _normalized(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _rule(node: fx.Node, found: Mapping, batch: int) -> int | None:
    target, args = node.target, node.args
    out = _shape(node)
    if target is aten.cat.default and out is not None:
        joined = _normalized(args[1] if len(args) > 1 else 0, len(out))
        dims = {found.get(part) for part in args[0]}
        return dims.pop() if len(dims) == 1 and None not in dims and joined not in dims else None
    if out is None or not args or not isinstance(args[0], fx.Node):
        return None
    first = found.get(args[0])
    rank = len(_shape(args[0]) or ())
    if target in _IDENTITIES:
        return first
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        # Broadcast: each operand's dimensions are the output's last ones.
        dims = {found[arg] + len(out) - len(_shape(arg)) for arg in args
                if isinstance(arg, fx.Node) and arg in found}
        return dims.pop() if len(dims) == 1 else None
    if target in _PRODUCTS:
        operands = args[-2:] if target is aten.addmm.default else args[:2]
        dims = set()
        for operand, kept in zip(operands, _PRODUCTS[target]):
            if operand in found:
                dims.add(kept[found[operand]])  # None: the batch is summed over
        return dims.pop() if len(dims) == 1 else None
    if first is None:
        return None
    return _layout_rule(target, args, first, rank, out, batch)


def _layout_rule(target, args, dim: int, rank: int, out: tuple, batch: int) -> int | None:
    """Where the batch dimension `dim` of the first argument (of rank `rank`)
    goes in an output of shape `out`, through one op with one tensor input."""
    if target in _REDUCTIONS:
        reduced = args[1] if len(args) > 1 and args[1] is not None else range(rank)
        reduced = {_normalized(d, rank) for d in ([reduced] if isinstance(reduced, int)
                                                   else reduced)}
        keepdim = len(out) == rank
        if dim in reduced:
            return None
        return dim if keepdim else dim - sum(d < dim for d in reduced)
    if target in (aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default):
        return None if _normalized(args[1], rank) == dim else dim
    if target in _VIEWS:
        return _reshaped(_shape(args[0]), out, dim, batch)
    if target is aten.expand.default:
        return dim + len(out) - rank
    if target is aten.permute.default:
        return [_normalized(d, rank) for d in args[1]].index(dim)
    if target is aten.transpose.int:
        swapped = {_normalized(args[1], rank): _normalized(args[2], rank)}
        swapped.update({value: key for key, value in swapped.items()})
        return swapped.get(dim, dim)
    if target is aten.t.default:
        return rank - 1 - dim
    if target is aten.unsqueeze.default:
        return dim + (_normalized(args[1], len(out)) <= dim)
    if target in (aten.squeeze.dim, aten.select.int):
        removed = _normalized(args[1], rank)
        return None if removed == dim else dim - (removed < dim)
    if target is aten.slice.Tensor:
        return None if _normalized(args[1] if len(args) > 1 else 0, rank) == dim else dim
    return None


def _reshaped(shape: tuple | None, out: tuple, dim: int, batch: int) -> int | None:
    """The dimension of `out` that holds the batch that dimension `dim` of
    `shape` holds (as its outermost part): the one whose preceding
    dimensions hold as many elements as those of `dim`, and the batch whole;
    None when a reshape splits it."""
    if shape is None:
        return None
    before = math.prod(shape[:dim])
    for index in range(len(out)):
        if math.prod(out[:index]) == before and out[index] != 1:
            return index if out[index] % batch == 0 else None
    return None
