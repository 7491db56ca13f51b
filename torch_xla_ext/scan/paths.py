"""Access paths from a function to the objects it holds: closure cell 0, then
attribute `cell`, then `weight`, say. A path recorded on one function leads
to the corresponding object of another function made from the same code, so
that a call of a fresh closure finds the tensors it captures."""
from __future__ import annotations

import collections
import dataclasses
import functools
import types
import weakref

import torch

# What a closure cell that is not filled yet holds, as far as paths go.
_EMPTY_CELL = object()


def steps(value):
    """(step, object) for each object `value` holds that a capture may be reached
    through; `resolve` follows a step on another object of the same kind."""
    if isinstance(value, types.FunctionType):
        for i, cell in enumerate(value.__closure__ or ()):
            try:
                yield ("closure", i), cell.cell_contents
            except ValueError:  # a cell not filled yet
                yield ("closure", i), _EMPTY_CELL
        for i, default in enumerate(value.__defaults__ or ()):
            yield ("default", i), default
        for name, default in (value.__kwdefaults__ or {}).items():
            yield ("kwdefault", name), default
    elif isinstance(value, functools.partial):
        yield ("partial.func", None), value.func
        for i, arg in enumerate(value.args):
            yield ("partial.arg", i), arg
        for name, arg in value.keywords.items():
            yield ("partial.keyword", name), arg
    elif isinstance(value, types.MethodType):
        yield ("method.func", None), value.__func__
        yield ("method.self", None), value.__self__
    elif isinstance(value, weakref.ref):
        yield ("deref", None), value()
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield ("item", i), item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield ("item", key), item
    elif isinstance(value, torch.nn.Module):
        # Parameters, buffers and submodules first, so that paths read `.cell.weight`.
        for members in (value._parameters, value._buffers, value._modules):
            for name, member in members.items():
                yield ("attr", name), member
        for name, member in vars(value).items():
            yield ("attr", name), member
    elif hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType)):
        for name, member in vars(value).items():
            yield ("attr", name), member
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield ("attr", field.name), getattr(value, field.name)


_FOLLOW = {
    "closure": lambda obj, i: obj.__closure__[i].cell_contents,
    "default": lambda obj, i: obj.__defaults__[i],
    "kwdefault": lambda obj, name: obj.__kwdefaults__[name],
    "partial.func": lambda obj, _: obj.func,
    "partial.arg": lambda obj, i: obj.args[i],
    "partial.keyword": lambda obj, name: obj.keywords[name],
    "method.func": lambda obj, _: obj.__func__,
    "method.self": lambda obj, _: obj.__self__,
    "deref": lambda obj, _: obj(),
    "item": lambda obj, key: obj[key],
    "attr": getattr,
}


def resolve(root, path: tuple):
    """The object `path` reaches from `root`, or None when it leads nowhere."""
    obj = root
    try:
        for kind, arg in path:
            obj = _FOLLOW[kind](obj, arg)
    except (AttributeError, LookupError, TypeError, ValueError):
        return None
    return obj


# How many objects a search for paths visits at most: it runs when fn is traced
# and stops early once every target is found, so this only bounds the search
# for captures that no path reaches (globals) in a large object graph.
_SEARCH_LIMIT = 100_000


def find_paths(root, targets) -> list:
    """For each target object, the shortest path from `root` to it through what
    `steps` follows, or None when it is not reachable."""
    wanted = {id(t): i for i, t in enumerate(targets)}
    paths = [None] * len(targets)
    remaining = len(wanted)
    queue = collections.deque([(root, ())])
    seen = {id(root)}
    while queue and remaining and len(seen) < _SEARCH_LIMIT:
        obj, path = queue.popleft()
        if isinstance(obj, torch.Tensor):
            continue
        for step, child in steps(obj):
            if id(child) in seen:
                continue
            seen.add(id(child))
            index = wanted.get(id(child))
            if index is not None:
                paths[index] = path + (step,)
                remaining -= 1
            queue.append((child, path + (step,)))
    return paths


def describe(root, path: tuple) -> str:
    """`path` as text, like "<closure self>.cell.weight", naming closure cells by
    their variable names."""
    text, obj = "", root
    for kind, arg in path:
        if kind == "closure":
            text += f"<closure {obj.__code__.co_freevars[arg]}>"
        elif kind in ("default", "partial.arg"):
            text += f"<{kind} {arg}>"
        elif kind in ("kwdefault", "partial.keyword"):
            text += f"<{kind} {arg!r}>"
        elif kind in ("partial.func", "method.func"):
            text += ".func" if kind == "partial.func" else ".__func__"
        elif kind == "method.self":
            text += ".__self__"
        elif kind == "deref":
            text += "()"
        else:
            text += f".{arg}" if kind == "attr" else f"[{arg!r}]"
        obj = _FOLLOW[kind](obj, arg)
    return text
