"""Look-alike subclasses swapped in and out of objects (torch_xla_ext.class_swaps)."""
import copy
import pickle

import pytest
from torch import nn

from torch_xla_ext.class_swaps import (
    lookalike_subclass, original_class, reduce_as_original, swap_back, swap_in, swapped)


def _plain_copy(layer, protocol):
    state = dict(vars(layer))
    state["extra"] = "dropped"
    return reduce_as_original(layer, state)


LOUD = lookalike_subclass(nn.Linear, {"loud": True, "__reduce_ex__": _plain_copy})


def test_a_lookalike_keeps_the_name_and_adds_behaviour_until_swapped_back():
    layer = nn.Linear(2, 2)
    assert (LOUD.__name__, LOUD.__qualname__, LOUD.__module__) == (
        "Linear", "Linear", nn.Linear.__module__)
    swap_in(layer, LOUD)
    assert type(layer) is LOUD and layer.loud and original_class(layer) is nn.Linear
    # Swapped again (nested), then back one step at a time.
    with swapped(layer, lookalike_subclass(LOUD, {"louder": True})):
        assert layer.louder and original_class(layer) is LOUD
    assert type(layer) is LOUD
    swap_back(layer)
    assert type(layer) is nn.Linear and not hasattr(layer, "loud")


def test_a_lookalike_pickles_and_copies_as_its_original_class():
    layer = nn.Linear(2, 2)
    swap_in(layer, LOUD)
    for copied in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert type(copied) is nn.Linear and copied.extra == "dropped"
    assert type(layer) is LOUD


def test_only_a_lookalike_of_the_objects_class_is_swapped_in():
    with pytest.raises(TypeError, match=r"swap_in: Linear is not a look-alike subclass of "
                                        r"Conv1d"):
        swap_in(nn.Conv1d(1, 1, 1), LOUD)
    with pytest.raises(TypeError, match="not a look-alike"):
        swap_in(nn.Linear(2, 2), nn.Linear)
