"""scripts/torch_scan_peer_suite.py on three of torch's cases: both runs
report each case, and hop_db's own sample, which torch's kernels compute
wrongly on XLA (the second step's carry), passes only registered. The command
line runs in pytest's process, its workers forked (benchmark_scripts.py)."""
import re

from benchmark_scripts import forked_workers  # noqa: F401 (a fixture)
import torch_scan_peer_suite

WRONG_UNREGISTERED = "hop_db_simple[dtype=torch.float32]"
RIGHT_IN_BOTH = ("compile[reverse=True,autograd=True,compiled=True]", "errors[call=float_output]")


def test_both_runs_report_each_case_and_hop_dbs_sample_passes_registered(forked_workers,
                                                                         capsys):
    cases = (WRONG_UNREGISTERED, *RIGHT_IN_BOTH)
    torch_scan_peer_suite.main([argument for case in cases for argument in ("--cases", case)])
    printed = capsys.readouterr().out
    rows = {name: cells.split() for name, cells in
            re.findall(r"^(\S+\]) +(.+)$", printed, re.MULTILINE)}
    assert set(rows) == set(cases), printed
    assert rows[WRONG_UNREGISTERED] == ["FAIL", "AssertionError", "pass"], printed
    for case in RIGHT_IN_BOTH:
        assert rows[case] == ["pass", "pass"], printed
    assert re.search(r"^  +1  AssertionError: results leaf 0: Tensor-likes are not close!$",
                     printed, re.MULTILINE), printed
    assert re.search(r"^unregistered: 2 of 3 cases pass$", printed, re.MULTILINE), printed
    assert re.search(r"^registered: 3 of 3 cases pass$", printed, re.MULTILINE), printed
