"""The plans of a stacked list's kinds of call, and the stand-ins they hand
out, are kept as the scan cache keeps traces: bounded by its maxsize, least
recently used first, and emptied by cache_clear()."""
import gc

import torch
import torch_xla

import torch_xla_ext as tx
from layer_calls import Block, Loop, converted
from tolerances import TRAINING, close
from torch_xla_ext.layer_stack import StackedList
from torch_xla_ext.scan.cache import CACHE


def live_count() -> int:
    gc.collect()
    return len(tx.live_placeholders())


def test_new_shapes_past_the_bound_keep_no_more_plans_or_placeholders(monkeypatch):
    monkeypatch.setattr(CACHE, "maxsize", 2)
    device = torch_xla.device()
    torch.manual_seed(0)
    reference, model = converted(Loop(StackedList([Block() for _ in range(3)])), device)
    tx.cache_clear()
    baseline = live_count()
    counts = []
    with torch.no_grad():
        for batch in range(1, 7):  # six kinds of call, each planned anew
            x = torch.randn(batch, 4, device=device)
            close(model(x), reference(x), TRAINING)
            torch_xla.sync()
            counts.append(live_count() - baseline)
    assert counts[0] > 0  # each kind keeps stand-ins for the layers' outputs between them
    assert counts[2:] == [counts[1]] * 4, counts  # none past the bound of 2 kinds
    assert tx.cache_info().plans == 2
    tx.cache_clear()
    assert live_count() == baseline and tx.cache_info().plans == 0


def test_a_cleared_plan_is_made_again_and_runs_as_before():
    device = torch_xla.device()
    torch.manual_seed(0)
    reference, model = converted(Loop(StackedList([Block() for _ in range(3)])), device)
    x = torch.randn(2, 4, device=device)
    close(model(x), reference(x), TRAINING)
    plans = tx.cache_info().plans
    tx.cache_clear()
    close(model(x), reference(x), TRAINING)
    assert tx.cache_info().plans == 1 <= plans
