"""Avals and structures of scan's inputs and outputs, the input checks and the
carry type check. An aval is what a trace depends on: shape, dtype and
requires_grad, never the value."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
from torch.utils._pytree import (
    TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten)


class Aval(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor, nested: bool = False) -> "Aval":
        """`t`'s aval; `nested` (a nested scan's key, see `CacheKey.nested`):
        as requiring grad if floating."""
        return Aval(tuple(t.shape), t.dtype, keyed_grad(t, nested))

    def __str__(self):
        return f"{str(self.dtype).removeprefix('torch.')}[{','.join(map(str, self.shape))}]"


def avals(leaves, nested: bool = False) -> tuple:
    return tuple(Aval.of(t, nested) for t in leaves)


def keyed_grad(t: torch.Tensor, nested: bool = False) -> bool:
    """The requires_grad of `t` in a trace's key (see `Aval.of`)."""
    return t.requires_grad or nested and t.dtype.is_floating_point


class Structure(NamedTuple):
    """A pytree structure whose `None` leaves are kept out of the flat list."""
    spec: TreeSpec
    is_none: tuple

    def unflatten(self, leaves) -> Any:
        leaves = iter(leaves)
        return tree_unflatten([None if none else next(leaves) for none in self.is_none], self.spec)

    def leaf_path(self, name: str, index: int) -> str:
        """`name` and the key path of kept leaf `index`, like "init['h'][0]"; for
        messages only, so it is computed on demand."""
        with_paths = tree_flatten_with_path(tree_unflatten(list(self.is_none), self.spec))[0]
        kept = [path for path, none in with_paths if not none]
        return f"{name}{keystr(kept[index])}"


def flatten(tree) -> tuple[list, Structure]:
    """The leaves other than None, and the structure."""
    leaves, spec = tree_flatten(tree)
    return [leaf for leaf in leaves if leaf is not None], Structure(
        spec, tuple(leaf is None for leaf in leaves))


def as_placeholders(tree, name: str):
    """`tree` with each tensor leaf that is not a placeholder replaced by a
    placeholder of its aval: for staging a scan from shapes and dtypes alone."""
    from torch_xla_ext.placeholders import is_placeholder, placeholder

    def convert(leaf):
        if not isinstance(leaf, torch.Tensor) or (leaf.device.type == "xla"
                                                  and is_placeholder(leaf)):
            return leaf  # non-tensors are refused by flatten_inputs, naming the leaf
        return placeholder(tuple(leaf.shape), leaf.dtype).requires_grad_(leaf.requires_grad)

    return tree_map(convert, tree)


def flatten_inputs(tree, name: str) -> tuple[list, Structure]:
    leaves, structure = flatten(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"scan: {structure.leaf_path(name, i)} must be a tensor, got "
                            f"{type(leaf).__name__} {leaf!r}; pass non-tensor settings through "
                            f"fn's closure instead")
        if leaf.device.type != "xla":
            raise ValueError(f"scan: {structure.leaf_path(name, i)} is on {leaf.device}, not an "
                             f"XLA device; move it with .to(torch_xla.device())")
    return leaves, structure


def scan_length(xs_leaves, xs_structure: Structure) -> int:
    if not xs_leaves:
        raise ValueError("scan: xs has no tensor leaves, so the number of steps is unknown")
    for i, leaf in enumerate(xs_leaves):
        if leaf.dim() == 0:
            raise ValueError(f"scan: {xs_structure.leaf_path('xs', i)} is a 0-d tensor; xs leaves "
                             f"need a leading dim to scan over")
    length = xs_leaves[0].shape[0]
    for i, leaf in enumerate(xs_leaves):
        if leaf.shape[0] != length:
            raise ValueError(
                f"scan: xs leaves must share their leading size: "
                f"{xs_structure.leaf_path('xs', 0)} has {length} but "
                f"{xs_structure.leaf_path('xs', i)} has {leaf.shape[0]} (shape {tuple(leaf.shape)})")
    return length


def check_carry_types(init_structure: Structure, init_avals, out_carry) -> list:
    """The carry `fn` returns must have the structure, shapes and dtypes of
    `init`. Returns its leaves."""
    out_leaves, out_structure = flatten(out_carry)
    if out_structure != init_structure:
        raise TypeError(f"scan: fn must return a carry with the structure of init; init is "
                        f"{init_structure.spec} but fn returned {out_structure.spec}")
    for i, (aval, leaf) in enumerate(zip(init_avals, out_leaves)):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"scan: fn returned {type(leaf).__name__} for carry leaf "
                            f"{init_structure.leaf_path('carry', i)}, which init has as a "
                            f"tensor {aval}")
        if tuple(leaf.shape) != aval.shape or leaf.dtype != aval.dtype:
            cast = (f" (cast it back with .to({aval.dtype}); under torch.autocast, linear "
                    f"layers and matmuls return the autocast dtype)"
                    if leaf.dtype != aval.dtype else "")
            raise TypeError(f"scan: fn changed the type of carry leaf "
                            f"{init_structure.leaf_path('carry', i)}: init has {aval} but fn "
                            f"returned {Aval.of(leaf)}; the carry must keep its shape and "
                            f"dtype{cast}")
    return out_leaves


def check_y_leaves(y_out) -> tuple[list, Structure]:
    """The y `fn` returns as its tensor leaves (`None` leaves are kept out) and
    its structure; other leaves raise."""
    y_leaves, y_tree = flatten(y_out)
    for i, leaf in enumerate(y_leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"scan: fn returned {type(leaf).__name__} for "
                            f"{y_tree.leaf_path('y', i)}; y leaves must be tensors or None")
    return y_leaves, y_tree


def empty_stack(aval: Aval, like: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.empty((0, *aval.shape), dtype=aval.dtype, device=like[0].device)

