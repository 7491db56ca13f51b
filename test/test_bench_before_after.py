"""scripts/bench_before_after.py against the commit checked out: both sides
run the same library, so every figure is printed on both sides with a ratio,
and the step's counts (exact) match."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--steps", "3", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "64", "--vocab", "64", "--seq", "8", "--batch", "2"]


def test_the_same_commit_on_both_sides_gives_equal_counts_and_every_figure():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_before_after.py"), "--base", "HEAD",
         "--rounds", "1", "bench_hf.py", "--mode", "stack_layers", "--layers", "2", *TINY],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()
            if re.match(r"^[a-z_]+ +[0-9]", line)}
    for figure in ("python_ms", "compile_s", "first_step_s"):
        assert figure in rows, result.stdout
    before, _, after, _, ratio, _ = rows["compiles"]
    assert before == after and float(ratio) == 1.0, rows["compiles"]

