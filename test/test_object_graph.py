"""The one walk over object graphs, and what it guarantees its callers: what
tells two functions apart for scan's cache key tells two layers apart for
LayerStack's alike-check, and the reverse."""
import functools

import pytest
import torch
from torch import nn

from torch_xla_ext import LayerStack
from torch_xla_ext.object_graph import Step, children, describe, find_paths, resolve
from torch_xla_ext.scan.cache import fingerprint


def scaled(scale):
    return lambda x: x * scale


def with_default(x, eps=1e-6):
    return x + eps


def with_other_default(x, eps=1e-5):
    return x + eps


def applying(activation):
    return lambda x: activation(x)


def keyword_only(x, *, power=2):
    return x ** power


def keyword_only_other(x, *, power=3):
    return x ** power


# (name, make) with make(variant) -> a function; variants 0 and 1 differ in what
# the name says, two calls of make(0) give distinct but equal functions.
DIFFERENCES = [
    ("closure constant", lambda v: scaled((2.0, 3.0)[v])),
    ("closure constant of another type", lambda v: scaled((1, 1.0)[v])),
    ("default", lambda v: (with_default, with_other_default)[v]),
    ("keyword default", lambda v: (keyword_only, keyword_only_other)[v]),
    ("captured function", lambda v: applying((torch.tanh, torch.relu)[v])),
    ("captured closure", lambda v: applying(scaled((2.0, 3.0)[v]))),
    ("partial argument", lambda v: functools.partial(torch.clamp, min=(0.0, 1.0)[v])),
    ("tuple in a closure", lambda v: scaled(((1, 2), (1, 3))[v])),
    ("dict in a closure", lambda v: scaled(({"a": 1}, {"a": 2})[v])),
    ("slice in a closure", lambda v: scaled((slice(0, 2), slice(0, 3))[v])),
]


class Holder(nn.Module):
    """A layer whose setting is a function."""

    def __init__(self, function):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.function = function


def alike(first, second) -> bool:
    try:
        LayerStack([Holder(first), Holder(second)])
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("make", [make for _, make in DIFFERENCES],
                         ids=[name for name, _ in DIFFERENCES])
def test_what_tells_functions_apart_for_the_cache_tells_layers_apart(make):
    assert fingerprint(make(0)) == fingerprint(make(0))
    assert alike(make(0), make(0))
    assert fingerprint(make(0)) != fingerprint(make(1))
    assert not alike(make(0), make(1))


def test_a_path_found_on_one_closure_leads_to_the_same_place_on_another():
    def over(module):
        return lambda x: module(x)

    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    path = find_paths(over(first), [first.weight])[0]
    assert path == (Step("closure", 0), Step("attr", "weight"))
    assert describe(over(first), path) == "<closure module>.weight"
    assert resolve(over(second), path) is second.weight
    assert resolve(lambda x: x, path) is None


def test_set_members_are_walked_but_have_no_path():
    tensor = torch.zeros(1)
    held = frozenset([tensor])
    assert [step for step, _ in children(held)] == [Step("member", None)]
    assert find_paths(scaled(held), [tensor]) == [None]
