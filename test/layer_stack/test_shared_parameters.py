"""A Parameter that every layer of a segment holds as one tensor (a block the
layers share, as Zamba's hybrid layers share their attention) stays one
Parameter: the stacks keep it out of their stacked storage, the scan carries
it unchanged to every step, and its gradient is the sum over the layers, as
the unconverted loop's; moving the model to the device keeps it tied."""
import copy

import torch
import torch_xla
from torch import nn

from layer_calls import HIDDEN, Block, Loop, forward_with_warnings
from tolerances import TRAINING, close
from torch_xla_ext.layer_stack import OwnerPlans, StackedList, drive_loops


def sharing(count: int) -> Loop:
    """Blocks whose linear layer is one module, shared by all."""
    torch.manual_seed(0)
    blocks = [Block() for _ in range(count)]
    for block in blocks[1:]:
        block.linear = blocks[0].linear
    return Loop(nn.ModuleList(blocks))


def test_a_parameter_every_layer_holds_stays_one_and_trains_as_unconverted():
    reference = sharing(4)  # on the host: moved to XLA, torch_xla would untie it
    model = copy.deepcopy(reference)
    model.blocks = StackedList(model.blocks)
    drive_loops(model, ("blocks",), OwnerPlans().start)
    model.to(torch_xla.device())
    assert all(block.linear.weight is model.blocks[0].linear.weight for block in model.blocks)
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    x = torch.randn(2, HIDDEN)
    output, loops, warned = forward_with_warnings(model, x.to(torch_xla.device()))
    assert loops == 1 and not warned
    output.sum().backward()
    reference(x).sum().backward()
    close(output, reference(x), TRAINING)
    close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()],
          TRAINING)
