"""scripts/bench_policies.py end to end at tiny shapes: each policy runs in its
own process through the shared harness, every policy's gradients match
save_everything's, and the table and the issue's peak RSS ratio are printed."""
import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "bench_policies.py")
POLICIES = ("save_everything", "save_nothing", "offload:attn_out+mlp_hidden")


def run_script(*arguments, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *arguments], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PJRT_DEVICE": "CPU"})


def test_every_policy_is_measured_with_the_baselines_gradients():
    done = run_script("--quick", "--policies", ",".join(POLICIES))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("figure"))
    assert header.split() == ["figure", *POLICIES]
    for row in ("compile s", "steady step time", "peak RSS", "parameters"):
        assert re.search(rf"^{row} .*\d", done.stdout, re.MULTILINE), row
    # The stack's 2 layers of hidden 32 (MLP 128) and its final norm, in float32.
    parameters = 2 * (4 * 32 * 32 + 3 * 32 * 128 + 2 * 32) + 32
    assert re.search(rf"^parameters +{parameters * 4 / 1024:.2f} KiB", done.stdout, re.MULTILINE)
    for policy in POLICIES[1:]:
        difference = re.search(rf"^  {re.escape(policy)} +max abs diff (\S+) +within atol$",
                               done.stdout, re.MULTILINE)
        assert difference and float(difference.group(1)) <= 1e-4, done.stdout
    assert re.search(r"^peak RSS save_nothing / save_everything: \d\.\d{3} \(goal <= 0\.70\) "
                     r"(ok|MISSED)$", done.stdout, re.MULTILINE), done.stdout


def test_unknown_policies_are_refused_before_any_run():
    done = run_script("--quick", "--policies", "save_everything,save_little")
    assert done.returncode == 2
    assert "unknown policy 'save_little'" in done.stderr and "save_nothing" in done.stderr
    assert "ran " not in done.stdout
    done = run_script("--quick", "--policies", "save_dots:attn_out")
    assert done.returncode == 2
    assert "only save_only and offload take names" in done.stderr
