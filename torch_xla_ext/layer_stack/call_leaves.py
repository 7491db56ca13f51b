"""How consecutive layer calls of the dry run relate, leaf by leaf: whether a
call can be a later step of the scan another call starts (`called_otherwise`
says why not), and how a run's calls give each leaf of their arguments
(`leaf_plans`, as `Leaf`s). `planner` splits the calls into runs with these.

Between the layers of one scan, an argument may differ where it is a
tensor (the scan stacks them), None for some layers and a tensor for others,
or a plain int that is each layer's own index in its list (as a loop
`for i, layer in enumerate(layers): layer(h, ..., i)` passes it): inside the
scan's step the layer gets it as transformers' `layer_idx` attribute, an
opaque value it may hand on to a cache but not use (`per_layer`).
"""
from __future__ import annotations

import dataclasses

from torch import Tensor
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from torch_xla_ext.layer_stack.dry_run import RecordedCall
from torch_xla_ext.layer_stack.kinds import argument_path, same_leaf

__all__ = ["Leaf", "called_otherwise", "fits", "handed_pairs", "is_own_index", "leaf_plans",
           "takes_handed"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """How a run's calls give one leaf of their arguments: the same object
    in every call (`shared`), the hidden state each layer gets from the one
    before (`carried`), a tensor per layer (`chosen`: layer i of the run
    gets variant `choice[i]`, the variants numbered by their first call),
    leaf `output` of what the layer before returned (`handed`; the run's
    first layer gets it from the forward), or each layer's own index in its
    list (`index`)."""
    kind: str
    choice: tuple[int, ...] = ()
    output: int | None = None


def called_otherwise(reference: RecordedCall, before: RecordedCall, call: RecordedCall
                     ) -> str | None:
    """Why `call` cannot be a later step of the scan whose first call at its
    position was `reference`, called alike (the same arguments' form, the
    same objects but for tensors and layer indices, the same form of output)
    on what the call `before` it returned; None where it can."""
    if call.spec != reference.spec:
        return (f"layer {call.index} is called with arguments of another form (their count, "
                f"keywords or nesting) than layer {reference.index}")
    if call.output_spec != reference.output_spec or call.sources != reference.sources:
        return (f"layer {call.index} returns values of another form, or from other places, "
                f"than layer {reference.index}")
    if not _carries(before, call):
        return (f"layer {call.index} is not called on the hidden state layer {before.index} "
                f"returned")
    for number, (leaf, first) in enumerate(zip(call.leaves[1:], reference.leaves[1:]), start=1):
        if not (_may_differ(leaf, first) or same_leaf(leaf, first)
                or (is_own_index(leaf, call) and is_own_index(first, reference))):
            path = argument_path(tree_flatten_with_path(
                tree_unflatten(call.leaves, call.spec))[0][number][0])
            return (f"layer {call.index} is given {path} = {leaf!r}, and layer "
                    f"{reference.index} {first!r}: the layers of one scan may differ in tensor "
                    f"arguments and in an int that is each layer's own index, not in other "
                    f"values")
    return None


def is_own_index(leaf, call: RecordedCall) -> bool:
    """Whether `leaf` is a plain int equal to the called layer's index in its list."""
    return type(leaf) is int and leaf == call.index


def takes_handed(first: RecordedCall, before: RecordedCall, call: RecordedCall) -> bool:
    """Whether the first call of a run can give, as the scan's first carry,
    each value that `call` gets from the call `before` it besides the
    hidden state: there, it has a tensor of that value's shape and dtype.
    (A run whose first layer gets None there starts at the next layer.)"""
    return all(fits(first.leaves[position], before.sources[output])
               for position, output in handed_pairs(before, call))


def fits(leaf, source) -> bool:
    """Whether `leaf` is a tensor of the shape and dtype of a computed output."""
    return isinstance(leaf, Tensor) and (tuple(leaf.shape), leaf.dtype) == source.value


def handed_pairs(before: RecordedCall, call: RecordedCall) -> tuple[tuple[int, int], ...]:
    """(argument leaf, output leaf) of each value `call` gets (past its
    hidden state) that the call `before` it computed and returned."""
    computed = {id(output): number for number, (output, source)
                in enumerate(zip(before.outputs, before.sources)) if source.kind == "computed"}
    return tuple((position, computed[id(leaf)]) for position, leaf
                 in enumerate(call.leaves[1:], start=1) if id(leaf) in computed)


def _may_differ(leaf, first) -> bool:
    """Whether an argument may differ between the layers of a scan: a tensor
    each (the scan stacks them), or None for some layers and a tensor for
    others (what None stands for may be a tensor: see `StackedList.scan_run`)."""
    return (isinstance(leaf, Tensor) or leaf is None) and (isinstance(first, Tensor)
                                                           or first is None)


def _carries(before: RecordedCall, call: RecordedCall) -> bool:
    """Whether `call`'s hidden state (its first argument) is what `before`
    returned first, a value it computed."""
    return (bool(call.leaves) and bool(before.outputs) and before.sources[0].kind == "computed"
            and call.leaves[0] is before.outputs[0])


def leaf_plans(calls: list[RecordedCall], handed: tuple[tuple[int, int], ...]
               ) -> tuple[Leaf, ...]:
    """How the calls at one position of a run give each argument leaf
    (`handed`: (argument leaf, output leaf) of the values each gets from the
    layer before)."""
    plans = [Leaf("carried")]
    outputs = dict(handed)
    for position in range(1, len(calls[0].leaves)):
        if position in outputs:
            plans.append(Leaf("handed", output=outputs[position]))
            continue
        if len(calls) > 1 and all(is_own_index(call.leaves[position], call) for call in calls):
            plans.append(Leaf("index"))
            continue
        variants, choice = [], []
        for call in calls:
            leaf = call.leaves[position]
            number = next((number for number, variant in enumerate(variants)
                           if same_leaf(leaf, variant)), None)
            if number is None:
                number = len(variants)
                variants.append(leaf)
            choice.append(number)
        plans.append(Leaf("shared") if len(variants) == 1 else Leaf("chosen", tuple(choice)))
    return tuple(plans)
