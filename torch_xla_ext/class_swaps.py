"""Objects that take, for a while, a look-alike subclass of their class: one
with the same name, module and qualified name (what code that checks a class
by name, and pickle, sees) that adds behaviour (attributes or descriptors).

The object is swapped in place (`obj.__class__ = ...`), not replaced: the
objects that hold it (a model holds a layer, a cache its cache layers) keep
holding it. Swapped back, it is an object of its own class again. One
module does it for every such object (a template layer whose per-layer
attributes are watched, a cache layer that reads stacked buffers), so that
the rules (only to a look-alike, back to the class it had) hold everywhere.
"""
from __future__ import annotations

import contextlib
import copyreg

# The class attribute naming the class a look-alike subclass was made from.
_MADE_FROM = "_lookalike_of"


def lookalike_subclass(cls: type, attributes: dict) -> type:
    """A subclass of `cls` with its name, module and qualified name, with
    `attributes` added. Callers cache it per class (one class per behaviour)."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__,
                                       _MADE_FROM: cls, **attributes})


def original_class(obj) -> type:
    """The class `obj` had before it was swapped to a look-alike (its own
    class, if it was not)."""
    return type(obj).__dict__.get(_MADE_FROM, type(obj))


def swap_in(obj, lookalike: type) -> None:
    """Gives `obj` the look-alike subclass `lookalike` of its class."""
    if lookalike.__dict__.get(_MADE_FROM) is not type(obj):
        raise TypeError(f"swap_in: {lookalike.__qualname__} is not a look-alike subclass of "
                        f"{type(obj).__qualname__} (made by lookalike_subclass from it)")
    obj.__class__ = lookalike


def swap_back(obj) -> None:
    """Gives `obj` back the class it had before `swap_in`."""
    obj.__class__ = original_class(obj)


@contextlib.contextmanager
def swapped(obj, lookalike: type):
    """While the block runs, `obj` has the look-alike class `lookalike`."""
    swap_in(obj, lookalike)
    try:
        yield obj
    finally:
        swap_back(obj)


def reduce_as_original(obj, state: dict) -> tuple:
    """A `__reduce_ex__` result that pickles (and copies) `obj` as an object of
    its original class with `state` as its `__dict__`: a look-alike's class
    cannot be found by its name, which is its original class's."""
    return copyreg._reconstructor, (original_class(obj), object, None), state
