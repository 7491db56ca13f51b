"""Ops that read their inputs' data never kill the process on placeholders:
they raise PlaceholderError naming the op (and, in a scan, fn's line).

Without the guard these cases kill the process, so they run in processes of
their own (the checks are in data_reading_ops.py)."""
import json
import re

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
import data_reading_ops
from data_reading_ops import ISSUE_CASES, op_named, swept_ops
from torch_xla_ext.placeholders import (
    HOST_READING_XLA_KERNELS, data_read_reason, indices_position)


def test_every_data_reading_op_raises_on_a_placeholder_and_in_a_scan(run_isolated):
    result = run_isolated(data_reading_ops.sweep)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    swept = re.findall(r"^ok (\S+)$", result.stdout, re.MULTILINE)
    assert swept == [op.name().replace("::", ".") for op in swept_ops()]
    # The ops with XLA kernels of their own, which killed the process before.
    assert {"aten.nonzero", "aten.masked_select", "aten.index.Tensor",
            "aten._local_scalar_dense"} <= set(swept)


@pytest.mark.parametrize("case", ISSUE_CASES)
def test_the_issue_cases_raise_naming_the_op_and_the_line(run_isolated, case):
    result = run_isolated(data_reading_ops.check_issue_case, args=(case,))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"checked {case}"


def test_static_shape_ops_and_real_tensors_still_run():
    device = torch_xla.device()
    p = tx.placeholder((4,))
    real = torch.tensor([1.0, -1.0, 2.0, 0.0], device=device)
    # Integer indices, a masked fill and a fixed-size top-k have static shapes.
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(
        [p[torch.tensor([0, 2], device=device)], torch.where(p > 0, p, 0), p.topk(2).indices])
    assert "gather" in hlo
    # A data-dependent op on real data beside placeholders runs as before.
    assert (real > 0).nonzero().flatten().tolist() == [0, 2]
    assert (p + real)[torch.tensor([1], device=device)].shape == (1,)


def test_scan_error_names_fn_and_its_line(run_isolated):
    result = run_isolated(data_reading_ops.check_scan_error)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "checked scan"


def test_every_xla_kernel_that_reads_data_on_the_host_is_guarded(run_isolated):
    # Run on real tensors: every op that makes torch_xla 2.9.0 copy data to
    # the host, tagged or not, must reach an op the guard knows (an indexing
    # op: for its masks), and the guard's list must name no other op.
    result = run_isolated("import json, data_reading_ops\n"
                          "print(json.dumps(data_reading_ops.host_reading_kernels()))\n")
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert "aten::nonzero" in found  # the sweep sees transfers
    guarded = {name for reached in found.values() for name in reached
               if data_read_reason(op_named(name)) is not None
               or indices_position(op_named(name)) is not None}
    # inverse's transfer reads the error codes torch_xla's linalg_inv_ex
    # makes, not its input: an inverse of a placeholder lowers.
    unguarded = {called: reached for called, reached in found.items()
                 if not guarded & set(reached)}
    assert unguarded == {"aten::inverse": ["aten::linalg_inv_ex", "aten::_linalg_check_errors"]}
    assert HOST_READING_XLA_KERNELS <= guarded
