"""Small layers, an owner's loop converted as stack_layers converts one, and
a call that reports what ran, shared by the tests of the plan from calls
(test/layer_stack/: test_planner.py, test_execution.py, test_handed_on.py,
test_shared_mappings.py, test_layer_state.py, test_lifted_numbers.py) and
T5's small loops (test_hf_t5.py)."""
import copy
import warnings

import torch_xla
from torch import nn

from torch_xla_ext.layer_stack import LayerByLayerWarning, OwnerPlans, StackedList, drive_loops
from torch_xla_ext.layer_stack.planner import plan_calls
from torch_xla_ext.layer_stack.dry_run import record_calls

HIDDEN = 4


class Block(nn.Module):
    """A norm and a linear layer; scaled and shifted when given both."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, scale=None, shift=None):
        x = self.linear(self.norm(x))
        return x if scale is None else x * scale + shift


class Loop(nn.Module):
    """An owner whose forward calls each of its `blocks` on what the one
    before returned."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def planned(owner, *args, **kwargs):
    """The plan of a call of `owner` (its `blocks` a StackedList) and its dry run's record."""
    record = record_calls(owner, {"blocks": owner.blocks}, args, kwargs)
    return plan_calls(owner.blocks, record.calls["blocks"], record), record


def forward_with_warnings(model, x) -> tuple:
    """The output, the While loops of its graph (not run) and the
    LayerByLayerWarnings of a call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = model(x)
    loops = torch_xla._XLAC._get_xla_tensors_hlo([output]).count(" while(")
    return output, loops, [str(each.message) for each in caught
                           if each.category is LayerByLayerWarning]


def converted(model: nn.Module, device) -> tuple[nn.Module, nn.Module]:
    """The model, and a copy whose `blocks` are stacked and driven by their
    plans, both on `device`."""
    stacked = copy.deepcopy(model)
    stacked.blocks = StackedList(stacked.blocks)
    drive_loops(stacked, ("blocks",), OwnerPlans().start)
    return model.to(device), stacked.to(device)
