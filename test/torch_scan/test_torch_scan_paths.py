"""scripts/torch_scan_paths.py at 3 steps, in a fresh interpreter (it sets XLA's
dump flag before torch_xla starts): each path's While loops, unregistered and
registered, and its difference from the for loop."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def test_each_path_runs_as_loops_once_registered_with_the_loops_results():
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "torch_scan_paths.py"), "--steps", "3"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "PJRT_DEVICE": "CPU"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = completed.stdout
    rows = {path: cells.split() for path, cells in re.findall(
        r"^(eager forward|eager training|autocast training|export\+StableHLO|"
        r"openxla_scan training) +(.+)$", printed, re.MULTILINE)}
    loops = {path: cells[:2] for path, cells in rows.items()}
    assert loops == {"eager forward": ["0", "1"], "eager training": ["0", "2"],
                     "autocast training": ["fails", "2"], "export+StableHLO": ["0", "1"],
                     "openxla_scan training": ["2", "2"]}, printed
    registered = {path: float(cells[3]) for path, cells in rows.items()}
    assert max(registered.values()) <= 1e-4, printed
    # torch 2.9's own backward drops the gradient through the carry.
    assert float(rows["eager training"][2]) > 1, printed
    assert re.search(r"^openxla_scan: XLA compilations per step \[\d+, \d+, 0\]$", printed,
                     re.MULTILINE), printed
    assert "fails: autocast training, unregistered: " in printed
