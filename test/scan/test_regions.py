"""torch_xla's activation checkpointing inside a scanned fn: the for loop's
gradients, and what the checkpoint wraps is recomputed, not stacked."""
import re

import pytest
import torch
import torch_xla
import torch_xla.utils.checkpoint as xla_checkpoint
from torch import nn
from torch_xla.utils.checkpoint import checkpoint

import torch_xla_ext as tx
from torch_xla_ext import policies
from reference import scan_loop
from tolerances import ACCUMULATED, SAME_OPS, close

DEV = torch_xla.device()


class Block(nn.Module):
    """A block whose wide hidden layer ([4, 32]) is the activation a
    checkpoint around it should keep out of memory."""

    def __init__(self, checkpointed):
        super().__init__()
        self.up, self.down, self.checkpointed = nn.Linear(8, 32), nn.Linear(32, 8), checkpointed

    def wide(self, a, scale):
        return self.down(torch.tanh(self.up(a)) * scale)

    def forward(self, c, x):
        if self.checkpointed == "module attribute":
            h = xla_checkpoint.checkpoint(self.wide, c + x, 2.0)
        elif self.checkpointed == "imported function":
            h = checkpoint(self.wide, c + x, 2.0)
        else:
            h = self.wide(c + x, 2.0)
        return c + torch.sin(h), h.sum()


def stacked_shapes(hlo: str, length: int) -> list[str]:
    state = next(line for line in hlo.splitlines() if re.search(r"= \(.*\) while\(", line))
    return [s for s in re.findall(r"(\w+\[[\d,]*\])", state.split(" while(")[0])
            if s.startswith(f"f32[{length},")]


@pytest.mark.parametrize("checkpointed", ["module attribute", "imported function"])
@pytest.mark.parametrize("policy", [policies.save_everything, policies.save_dots], ids=repr)
def test_checkpoint_inside_fn_gives_the_loops_gradients_and_stacks_no_wide_activation(
        checkpointed, policy):
    torch.manual_seed(0)
    block = Block(checkpointed).to(DEV)
    init = torch.randn(4, 8, device=DEV, requires_grad=True)
    xs = torch.randn(5, 4, 8, device=DEV)
    params = [init, *block.parameters()]
    carry, ys = tx.scan(block, init, xs, partition_fn=policy)
    (carry.sum() + ys.sum()).backward()
    scanned = [carry.cpu(), ys.cpu()] + [p.grad.cpu() for p in params]
    for p in params:
        p.grad = None
    carry, ys = scan_loop(block, init, xs)  # torch_xla's checkpoint as torch_xla runs it
    (carry.sum() + ys.sum()).backward()
    for s, l in zip(scanned, [carry, ys] + [p.grad for p in params]):
        close(s, l, ACCUMULATED)
    checkpointed_stack = stacked_shapes(tx.lower(block, init, xs, partition_fn=policy)
                                        .forward_hlo, 5)
    block.checkpointed = None
    plain_stack = stacked_shapes(tx.lower(block, init, xs, partition_fn=policy).forward_hlo, 5)
    assert "f32[5,4,32]" in plain_stack, plain_stack
    assert "f32[5,4,32]" not in checkpointed_stack, checkpointed_stack


def checkpoint_outside_scan_scenario():
    """Importing patches nothing of torch_xla's checkpoint; after a scan traced,
    the checkpoint outside scan is still torch_xla's."""
    from torch_xla.utils.checkpoint import CheckpointFunction
    assert "apply" not in vars(CheckpointFunction)  # importing patches nothing
    dev = torch_xla.device()
    lin = torch.nn.Linear(4, 4).to(dev)
    tx.scan(lambda c, x: (lin(c + x), None), torch.zeros(2, 4, device=dev),
            torch.ones(3, 2, 4, device=dev))
    # Outside scan's tracing the checkpoint is torch_xla's: it recomputes in
    # its backward, and gives the plain call's gradients.
    x = torch.randn(2, 4, device=dev, requires_grad=True)
    checkpoint(lambda a: torch.tanh(lin(a)), x).sum().backward()
    grad, x.grad = x.grad.cpu(), None
    torch.tanh(lin(x)).sum().backward()
    close(grad, x.grad, SAME_OPS)
    print("ok")


def test_torch_xla_checkpoint_is_left_alone_until_scan_traces(run_isolated):
    process = run_isolated(checkpoint_outside_scan_scenario)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.strip().endswith("ok")
