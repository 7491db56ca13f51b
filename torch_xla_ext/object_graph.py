"""The one walk over Python object graphs: what an object holds, one step at a time.

Three questions walk the objects a function or a layer holds: which program a
scan's `fn` traces (the cache key, `scan/cache.py`), where `fn` keeps the
tensors it captures (access paths, below), and whether two layers are built
alike (`layer_stack/forms.py`). Each decides at the leaves what a value counts
as (the cache: a tensor by its aval, a module by weak identity; the layers
check: a layer's own tensors by their place in it), and all of them descend
through `children`, so what tells two functions apart for one tells them apart
for the others.

A path is a tuple of `Step`s from a root object: closure cell 0, then
attribute `cell`, then `weight`, say. A path recorded on one function leads
to the corresponding object of another function made from the same code, so
that a call of a fresh closure finds the tensors it captures.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import types
import weakref
from typing import Any, Iterator, NamedTuple

import torch

# Immutable values that are compared, and may be keyed, as themselves: the
# constants a function may close over or a layer call may pass.
VALUE_TYPES = (type(None), type(Ellipsis), bool, int, float, complex, str, bytes, range,
               enum.Enum, torch.dtype, torch.device, torch.layout, torch.memory_format)

# What a closure cell that is not filled yet holds, as far as the walk goes.
EMPTY_CELL = object()


class Step(NamedTuple):
    """One step into an object: `kind` says how (a closure cell, an item, an
    attribute, ...) and `key` which one (an index, a dict key, a name)."""
    kind: str
    key: Any


def children(value) -> Iterator[tuple[Step, Any]]:
    """(step, object) for each object `value` holds directly; `follow` takes a
    step on another object of the same kind. Objects are not entered (a class,
    a module object, a tensor) yield nothing."""
    if isinstance(value, types.FunctionType):
        for i, cell in enumerate(value.__closure__ or ()):
            try:
                yield Step("closure", i), cell.cell_contents
            except ValueError:  # a cell not filled yet
                yield Step("closure", i), EMPTY_CELL
        for i, default in enumerate(value.__defaults__ or ()):
            yield Step("default", i), default
        for name, default in (value.__kwdefaults__ or {}).items():
            yield Step("kwdefault", name), default
    elif isinstance(value, functools.partial):
        yield Step("partial.func", None), value.func
        for i, arg in enumerate(value.args):
            yield Step("partial.arg", i), arg
        for name, arg in value.keywords.items():
            yield Step("partial.keyword", name), arg
    elif isinstance(value, types.MethodType):
        yield Step("method.func", None), value.__func__
        yield Step("method.self", None), value.__self__
    elif isinstance(value, weakref.ref):
        yield Step("deref", None), value()
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield Step("item", i), item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield Step("item", key), item
    elif isinstance(value, (set, frozenset)):
        # A member has no path back to it (`follow` cannot take this step).
        for member in value:
            yield Step("member", None), member
    elif isinstance(value, slice):
        for name in ("start", "stop", "step"):
            yield Step("attr", name), getattr(value, name)
    elif isinstance(value, torch.nn.Module):
        # Parameters, buffers and submodules first, so that paths read `.cell.weight`.
        for members in (value._parameters, value._buffers, value._modules):
            for name, member in members.items():
                yield Step("attr", name), member
        yield from attributes(value)
    elif isinstance(value, (torch.Tensor, type, types.ModuleType)):
        return
    elif hasattr(value, "__dict__"):
        yield from attributes(value)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield Step("attr", field.name), getattr(value, field.name)


def attributes(value) -> Iterator[tuple[Step, Any]]:
    """The steps to the attributes in `value`'s `__dict__`."""
    for name, member in vars(value).items():
        yield Step("attr", name), member


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


def follow(obj, step: Step):
    """The object `step` reaches from `obj`; raises LookupError for a set's member."""
    if step.kind not in _FOLLOW:
        raise LookupError(f"a {step.kind} step cannot be followed")
    return _FOLLOW[step.kind](obj, step.key)


def resolve(root, path: tuple):
    """The object `path` reaches from `root`, or None when it leads nowhere."""
    obj = root
    try:
        for step in path:
            obj = follow(obj, step)
    except (AttributeError, LookupError, TypeError, ValueError):
        return None
    return obj


# How many objects a search for paths visits at most: it runs when fn is traced
# and stops early once every target is found, so this only bounds the search
# for captures that no path reaches (globals) in a large object graph.
_SEARCH_LIMIT = 100_000


def find_paths(root, targets) -> list:
    """For each target object, the shortest path from `root` to it that
    `follow` can take, or None when there is none."""
    wanted = {id(t): i for i, t in enumerate(targets)}
    paths = [None] * len(targets)
    remaining = len(wanted)
    queue = collections.deque([(root, ())])
    seen = {id(root)}
    while queue and remaining and len(seen) < _SEARCH_LIMIT:
        obj, path = queue.popleft()
        for step, child in children(obj):
            if id(child) in seen or step.kind not in _FOLLOW:
                continue
            seen.add(id(child))
            index = wanted.get(id(child))
            if index is not None:
                paths[index] = path + (step,)
                remaining -= 1
            queue.append((child, path + (step,)))
    return paths


def describe(root, path: tuple) -> str:
    """`path` as code-like text, "<closure self>.cell.weight", naming closure
    cells by their variable names."""
    text, obj = "", root
    for step in path:
        kind, key = step
        if kind == "closure":
            text += f"<closure {obj.__code__.co_freevars[key]}>"
        elif kind in ("default", "partial.arg"):
            text += f"<{kind} {key}>"
        elif kind in ("kwdefault", "partial.keyword"):
            text += f"<{kind} {key!r}>"
        elif kind in ("partial.func", "method.func"):
            text += ".func" if kind == "partial.func" else ".__func__"
        elif kind == "method.self":
            text += ".__self__"
        elif kind == "deref":
            text += "()"
        else:
            text += f".{key}" if kind == "attr" else f"[{key!r}]"
        obj = follow(obj, step)
    return text


def label(parent, step: Step) -> str:
    """`step` from `parent` in words, for messages: "closure variable 'scale'",
    "default of 'eps'", "item [2]", "key 'mask'", "attribute 'p'"."""
    kind, key = step
    if kind == "closure":
        return f"closure variable {parent.__code__.co_freevars[key]!r}"
    if kind == "default":
        code = parent.__code__
        positional = code.co_varnames[:code.co_argcount]
        return f"default of {positional[len(positional) - len(parent.__defaults__) + key]!r}"
    if kind == "kwdefault":
        return f"default of {key!r}"
    if kind == "partial.arg":
        return f"argument [{key}] of the partial"
    if kind == "partial.keyword":
        return f"keyword {key!r} of the partial"
    if kind == "item":
        return f"key {key!r}" if isinstance(parent, dict) else f"item [{key}]"
    if kind == "attr":
        return f"attribute {key!r}"
    return {"partial.func": "function of the partial", "method.func": "function of the method",
            "method.self": "self of the method", "deref": "referent of the weak reference"}[kind]


def tensors_in(root, limit: int = _SEARCH_LIMIT) -> list[torch.Tensor]:
    """The tensors `root` holds, at any depth (at most `limit` objects visited)."""
    found, queue, seen = [], collections.deque([root]), {id(root)}
    while queue and len(seen) < limit:
        obj = queue.popleft()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        for _, child in children(obj):
            if id(child) not in seen:
                seen.add(id(child))
                queue.append(child)
    return found
