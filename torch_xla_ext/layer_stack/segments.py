"""Where a list of layers splits into parts that scans can stand for.

Each layer has a kind (a hashable: its structure, for storage; its
structure and the settings that change what it computes, for a call).
`plan_segments` covers the list, in order, with the fewest segments, each
one of:

* a run of layers of one kind, scanned one layer per step;
* a pattern of `period` kinds repeated at least twice (Jamba's attention
  layer every eighth, Gemma's sliding and full attention), scanned one group
  of `period` consecutive layers per step: group g's position j is alike to
  group 0's position j, while the positions of a group may differ;
* one layer, which runs as itself.

DeepSeek-V3's dense layers then mixture-of-experts layers are two runs;
T5's first block, the one computing the position biases, is a layer of its
own before a run of the others.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

__all__ = ["Segment", "plan_segments"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start, ..., stop - 1, as `groups` groups of `period` layers."""
    start: int
    period: int
    groups: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.groups

    @property
    def single(self) -> bool:
        """One layer, which runs as itself rather than as a scan."""
        return self.period * self.groups == 1

    def place(self, index: int) -> tuple[int, int]:
        """(group, position) of layer `index` of the list, in this segment."""
        return divmod(index - self.start, self.period)

    def __str__(self) -> str:
        if self.single:
            return f"layer {self.start}"
        grouped = (f"{self.groups} groups of {self.period} layers" if self.period > 1
                   else f"{self.groups} layers")
        return f"layers {self.start}-{self.stop - 1} ({grouped})"


def plan_segments(kinds: Sequence[Hashable]) -> tuple[Segment, ...]:
    """The fewest segments covering layers of `kinds` in order (see the
    module docstring); among as few, those of the shortest periods."""
    count = len(kinds)
    # common[i][j]: how many layers from i on have the kinds of the layers from j on.
    common = [[0] * (count + 1) for _ in range(count + 1)]
    for i in range(count - 1, -1, -1):
        for j in range(count - 1, i, -1):
            if kinds[i] == kinds[j]:
                common[i][j] = common[i + 1][j + 1] + 1
    # best[i]: (segments, summed periods, the last segment) covering kinds[:i].
    best: list[tuple[int, int, Segment | None] | None] = [None] * (count + 1)
    best[0] = (0, 0, None)
    for start in range(count):
        segments, periods, _ = best[start]
        for segment in _segments_from(common, count, start):
            candidate = (segments + 1, periods + segment.period, segment)
            if best[segment.stop] is None or candidate[:2] < best[segment.stop][:2]:
                best[segment.stop] = candidate
    plan, stop = [], count
    while stop:
        plan.append(best[stop][2])
        stop = plan[-1].start
    return tuple(reversed(plan))


def _segments_from(common: list[list[int]], count: int, start: int):
    """Every segment that can start at `start`: the layer alone, and each
    whole number (two or more) of repetitions of each period whose pattern
    is not itself a repetition of a shorter one (which covers the same
    layers with fewer kinds per step)."""
    yield Segment(start, 1, 1)
    for period in range(1, (count - start) // 2 + 1):
        if any(period % shorter == 0 and common[start][start + shorter] >= period - shorter
               for shorter in range(1, period // 2 + 1)):
            continue
        repeated = period + common[start][start + period]
        for groups in range(2, repeated // period + 1):
            yield Segment(start, period, groups)
