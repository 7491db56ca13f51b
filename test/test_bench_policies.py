"""scripts/bench_policies.py at tiny shapes: each policy runs in a process of its
own, every policy's gradients match save_everything's, and the table and the
issue's peak RSS ratio are printed. The command line runs in pytest's process,
its workers forked (benchmark_scripts.py)."""
import re

import pytest

from benchmark_scripts import forked_workers  # noqa: F401 (a fixture)
import bench_policies

POLICIES = ("save_everything", "save_nothing", "offload:attn_out+mlp_hidden")


def test_every_policy_is_measured_with_the_baselines_gradients(forked_workers, capsys):
    bench_policies.main(["--quick", "--policies", ",".join(POLICIES)])
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("figure"))
    assert header.split() == ["figure", *POLICIES]
    for row in ("compile s", "steady step time", "peak RSS", "parameters"):
        assert re.search(rf"^{row} .*\d", printed, re.MULTILINE), row
    # The stack's 2 layers of hidden 32 (MLP 128) and its final norm, in float32.
    parameters = 2 * (4 * 32 * 32 + 3 * 32 * 128 + 2 * 32) + 32
    assert re.search(rf"^parameters +{parameters * 4 / 1024:.2f} KiB", printed, re.MULTILINE)
    for policy in POLICIES[1:]:
        difference = re.search(rf"^{re.escape(policy)} +(\S+) +within atol$",
                               printed, re.MULTILINE)
        assert difference and float(difference.group(1)) <= 1e-4, printed
    assert re.search(r"^  peak RSS save_nothing / save_everything +\d\.\d{3} +goal <= 0\.7 +"
                     r"(ok|MISSED)$", printed, re.MULTILINE), printed


def test_markdown_prints_every_table_as_markdown(forked_workers, capsys):
    bench_policies.main(["--quick", "--policies", "save_everything,save_nothing", "--markdown"])
    lines = capsys.readouterr().out.splitlines()
    figures = lines.index("| figure | save_everything | save_nothing |")
    assert lines[figures + 1] == "|---|---:|---:|"
    assert [line.split(" | ")[0] for line in lines[figures + 2:figures + 7]] == [
        "| compile s", "| compiles", "| steady step time", "| peak RSS", "| parameters"]
    gradients = lines.index("| policy | max abs diff | verdict |")
    assert lines[gradients + 1] == "|---|---:|---:|"
    assert re.fullmatch(r"\| save_nothing \| \S+ \| within atol \|", lines[gradients + 2])
    ratio = lines.index("| ratio | value | goal | verdict |")
    assert re.fullmatch(r"\| peak RSS save_nothing / save_everything \| \d\.\d{3} \| <= 0\.7 \| "
                        r"(ok|MISSED) \|", lines[ratio + 2])


@pytest.mark.parametrize("policies, messages", [
    # The error lists the policies there are.
    ("save_everything,save_little", ["unknown policy 'save_little'", "save_nothing"]),
    ("save_dots:attn_out", ["only save_only and offload take names"]),
])
def test_unknown_policies_are_refused_before_any_run(policies, messages, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_policies.main(["--quick", "--policies", policies])
    printed = capsys.readouterr()
    assert exited.value.code == 2
    for message in messages:
        assert message in printed.err
    assert "ran " not in printed.out
