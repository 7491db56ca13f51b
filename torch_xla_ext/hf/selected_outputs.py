"""The hidden states a call selects by index (`output_hidden_states=-2`,
what LLaVA's `vision_feature_layer` asks of its vision tower): transformers'
`capture_outputs` collects them with hooks on the layers, which do not run
inside a scan, so a stack hands them over itself."""
from __future__ import annotations

import dataclasses
import sys

import torch


@dataclasses.dataclass(frozen=True)
class SelectedHiddenStates:
    # transformers' list for this call: an entry per hidden state so far, None
    # where the call does not select it (as its hooks append them).
    collected: list
    selected: frozenset[int]

    def record(self, hidden: torch.Tensor) -> None:
        """The next hidden state, as transformers' hook on a layer appends it
        (the first layer's input first, when nothing is collected yet)."""
        self.collected.append(hidden if len(self.collected) in self.selected else None)

    def skip(self, count: int) -> None:
        """`count` hidden states that the call does not select (see `inner`)."""
        self.collected.extend([None] * count)

    def inner(self, num_layers: int) -> list[int]:
        """The selected hidden states that are the output of another layer than
        the last of the `num_layers` to run next, which one scan does not give;
        by their index in transformers' list."""
        first_output = len(self.collected)
        return sorted(index for index in self.selected
                      if first_output <= index < first_output + num_layers - 1)


def selected_hidden_states(kwargs: dict) -> SelectedHiddenStates | None:
    """What transformers collects in this call when the call selects hidden
    states by index (not a flag asking for all of them), else None."""
    requested = kwargs.get("output_hidden_states")
    capturing = sys.modules.get("transformers.utils.output_capturing")
    if requested is None or isinstance(requested, bool) or capturing is None:
        return None
    collector = capturing._active_collector.get()
    if not collector or "_hidden_states_layers" not in collector:
        return None
    return SelectedHiddenStates(collector["hidden_states"],
                                frozenset(collector["_hidden_states_layers"]))
