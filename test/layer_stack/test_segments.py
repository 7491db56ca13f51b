"""Where a list of layers splits into segments (layer_stack.segments): runs
of one kind, repeating patterns scanned a group per step, and single layers,
the fewest of them."""
import itertools

import pytest

from torch_xla_ext.layer_stack.segments import Segment, plan_segments


@pytest.mark.parametrize("kinds, plan", [
    ("aaaa", [(0, 1, 4)]),
    # T5: the first block (it holds the position biases), then a run.
    ("abbb", [(0, 1, 1), (1, 1, 3)]),
    # DeepSeek: dense layers, then mixture-of-experts ones.
    ("aabbb", [(0, 1, 2), (2, 1, 3)]),
    # Gemma2's alternating kinds: one pattern of two, three times.
    ("ababab", [(0, 2, 3)]),
    # Gemma3's five sliding layers and a full one, twice.
    ("aaaaabaaaaab", [(0, 6, 2)]),
    # Jamba's attention layer every eighth.
    ("mmmmmmmammmmmmma", [(0, 8, 2)]),
    ("abc", [(0, 1, 1), (1, 1, 1), (2, 1, 1)]),
    ("a", [(0, 1, 1)]),
    ("", []),
])
def test_the_plan_covers_the_layers_in_order_with_runs_patterns_and_single_layers(kinds, plan):
    assert plan_segments(list(kinds)) == tuple(Segment(*each) for each in plan)


@pytest.mark.parametrize("kinds, plan", [
    # Two groups of three rather than runs and single layers.
    ("aabaab", [(0, 3, 2)]),
    # A run where a pattern of two (a a) would cover the same layers: the shorter period.
    ("aaaaaa", [(0, 1, 6)]),
    # A pattern of four that is itself a pattern of two repeated is the pattern of two.
    ("abababab", [(0, 2, 4)]),
    # A run, a pattern, a run: the pattern takes the run's last layer.
    ("aaaabababcccc", [(0, 1, 3), (3, 2, 3), (9, 1, 4)]),
])
def test_the_plan_has_the_fewest_segments_and_among_as_few_the_shortest_periods(kinds, plan):
    assert plan_segments(list(kinds)) == tuple(Segment(*each) for each in plan)


def segmentations(kinds, start=0):
    """Every way to cover kinds[start:] with segments, by enumeration: single
    layers, and two or more repetitions of a pattern."""
    if start == len(kinds):
        yield ()
        return
    left = len(kinds) - start
    for period in range(1, left + 1):
        first = kinds[start:start + period]
        for groups in range(1 if period == 1 else 2, left // period + 1):
            if all(kinds[start + group * period:start + (group + 1) * period] == first
                   for group in range(groups)):
                for rest in segmentations(kinds, start + period * groups):
                    yield (Segment(start, period, groups), *rest)


def test_every_plan_is_one_of_the_fewest_segments_of_the_shortest_periods():
    # Exhaustively over short lists of three kinds, against every way to
    # cover them: each plan covers the list in order, with alike layers at
    # each position of a segment's groups, and none has fewer segments, or
    # as few of shorter periods.
    for length in range(1, 7):
        for kinds in itertools.product("abc", repeat=length):
            plan = plan_segments(kinds)
            assert plan in set(segmentations(kinds)), (kinds, plan)
            cost = min((len(each), sum(segment.period for segment in each))
                       for each in segmentations(kinds))
            assert (len(plan), sum(segment.period for segment in plan)) == cost, (kinds, plan)


def test_a_segment_places_its_layers_and_describes_itself():
    pattern = Segment(start=2, period=3, groups=2)
    assert pattern.stop == 8 and not pattern.single
    assert [pattern.place(index) for index in (2, 4, 5, 7)] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert str(pattern) == "layers 2-7 (2 groups of 3 layers)"
    assert str(Segment(0, 1, 4)) == "layers 0-3 (4 layers)"
    single = Segment(5, 1, 1)
    assert single.single and single.stop == 6 and str(single) == "layer 5"
