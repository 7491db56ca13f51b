"""scripts/compare_metrics.py run: every mode in its own process, figures per step.

The command line runs in pytest's process (main(argv)), its workers forked from
the scenario server (benchmark_scripts.py); one test runs the real command line
with a real worker."""
import contextlib
import io
import json
import math
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest

from benchmark_scripts import (  # noqa: F401 (forked_workers: a fixture)
    REPO, SCRIPTS, forked_run_worker, forked_workers, op_times_rows)
import compare_metrics as compare_metrics_script
import harness

ALL_MODES = ["loop", "scan", "scan-device-data", "torch-xla-scan"]
# Two steps: the first compiles, the second shows what a cached step moves.
STEPS = 2


def compare_metrics(*args) -> subprocess.CompletedProcess:
    """The command line `compare_metrics.py ARGS...`, run by main() in this process."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            returncode = compare_metrics_script.main(list(map(str, args)))
        except SystemExit as exited:  # argparse's errors
            returncode = exited.code
    return subprocess.CompletedProcess(["compare_metrics.py", *map(str, args)], returncode,
                                       stdout.getvalue(), stderr.getvalue())


def table_cells(table: str, label: str) -> list[str]:
    """The values of a table row (without its label), columns being 2+ spaces apart."""
    (line,) = [line for line in table.splitlines() if line.startswith(label + "  ")]
    return re.split(r"\s{2,}", line.strip())[1:]


@pytest.fixture(scope="module")
def all_modes(tmp_path_factory, scenario_server):
    """The completed default command (no `run`) on a tiny decoder stack, and its JSON."""
    json_path = tmp_path_factory.mktemp("run") / "figures.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "run_worker", forked_run_worker(scenario_server))
        completed = compare_metrics("--layers", 2, "--hidden", 32, "--steps", STEPS,
                                    "--json", json_path)
    assert completed.returncode == 0, completed.stderr
    return completed, json.loads(json_path.read_text())


def test_run_is_the_default_command_with_a_column_per_mode(all_modes):
    completed, figures = all_modes
    table = completed.stdout
    assert table.splitlines()[1].split() == ["figure", *ALL_MODES]
    assert list(figures["modes"]) == ALL_MODES
    assert figures["settings"] == {"workload": "decoder blocks", "hidden": 32, "steps": STEPS,
                                   "modes": ALL_MODES, "layers": 2}
    progress = [line for line in completed.stderr.splitlines() if line.startswith("[")]
    assert progress == [f"[{position}/4] {mode}: running {STEPS} steps ..."
                        for position, mode in enumerate(ALL_MODES, start=1)]
    # Only the device-data stand-ins move bytes to the device at every step.
    marked = [cell.endswith(" *") for cell in table_cells(table, "host-to-device bytes")]
    assert marked == [False, False, True, False]
    assert table.splitlines()[-1] == "* differs from loop by more than 10%"


def test_placeholders_move_no_bytes_after_the_first_step_but_device_data_does(all_modes):
    _, figures = all_modes
    scan, device_data = figures["modes"]["scan"], figures["modes"]["scan-device-data"]
    assert len(scan["steps"]) == len(device_data["steps"]) == STEPS
    assert [step["h2d_bytes"] for step in scan["steps"][1:]] == [0] * (STEPS - 1)
    assert [step["h2d_transfers"] for step in scan["steps"][1:]] == [0] * (STEPS - 1)
    assert all(step["h2d_bytes"] > 0 for step in device_data["steps"][1:])
    # The bytes come from tracing: one trace per step, each moving its stand-ins.
    assert [step["scan_traces"] for step in device_data["steps"]] == [1] * STEPS
    assert device_data["h2d_bytes"] == sum(step["h2d_bytes"] for step in device_data["steps"])


def test_device_data_moves_every_stand_in_of_the_trace_forward_and_backward(all_modes):
    _, figures = all_modes
    scan, device_data = figures["modes"]["scan"], figures["modes"]["scan-device-data"]
    # Each trace makes the stand-ins scan's one trace made (the forward's and
    # the backward's, AOTAutograd's primals and cotangents among them) ...
    made = scan["steps"][0]["scan_stand_ins"]
    assert made > 0
    assert [step["scan_stand_ins"] for step in device_data["steps"]] == [made] * STEPS
    assert [step["scan_stand_ins"] for step in scan["steps"][1:]] == [0] * (STEPS - 1)
    # ... and moves each from host on its own, the steps after the first moving
    # nothing else (the placeholder scan moves nothing then).
    assert [step["h2d_transfers"] for step in device_data["steps"][1:]] == [made] * (STEPS - 1)
    assert device_data["h2d_transfers"] > scan["h2d_transfers"] + (STEPS - 1) * made


def stand_ins_of_a_trace_scenario():
    """The placeholders and transfers of a scan's trace, with its own stand-ins
    and with StandInFactory's from host."""
    import torch
    import torch_xla
    import torch_xla_ext
    from torch_xla_ext import placeholder, placeholder_id
    from torch_xla_ext.metrics import collect

    device = torch_xla.device()
    layer = torch.nn.Linear(4, 4).to(device)
    xs = torch.randn(3, 2, 4, device=device)
    torch_xla.sync()

    def placeholders_and_transfers_of_a_trace():
        torch_xla_ext.cache_clear()
        first_id, transfers = placeholder_id(placeholder(1)), collect()["h2d_transfers"]
        carry, _ = torch_xla_ext.scan(lambda c, x: (torch.tanh(layer(c) + x), None),
                                      torch.zeros(2, 4, device=device), xs)
        carry.sum().backward()
        return (placeholder_id(placeholder(1)) - first_id - 1,
                collect()["h2d_transfers"] - transfers)

    print(*placeholders_and_transfers_of_a_trace())
    stand_ins = compare_metrics_script.StandInFactory(from_host=True)
    print(*placeholders_and_transfers_of_a_trace(), stand_ins.made)


def test_device_data_mode_makes_no_placeholder_and_moves_every_stand_in(run_isolated):
    # Counted by the ids the C++ core issues to every placeholder, guarded or
    # not (AOTAutograd's), rather than by the replaced factory itself.
    completed = run_isolated(stand_ins_of_a_trace_scenario)
    assert completed.returncode == 0, completed.stderr
    with_placeholders, with_device_data = (list(map(int, line.split()))
                                           for line in completed.stdout.splitlines())
    stand_in_count, transfers = with_placeholders
    assert stand_in_count > 0 and transfers == 0
    # The same stand-ins, now each moved from host, and not one placeholder.
    assert with_device_data == [0, stand_in_count, stand_in_count]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_sweep_plots_a_line_per_mode(tmp_path, forked_workers):
    plot, json_path = tmp_path / "sweep.png", tmp_path / "sweep.json"
    completed = compare_metrics("--sweep-layers", "1,2", "--modes", "loop,scan", "--hidden", 32,
                                "--steps", 2, "--plot", plot, "--json", json_path)
    assert completed.returncode == 0, completed.stderr
    assert "[4/4] scan, 2 layers: running 2 steps ..." in completed.stderr
    assert [line for line in completed.stdout.splitlines() if line.startswith("decoder")] == [
        "decoder blocks: 1 layers, hidden 32, 2 steps",
        "decoder blocks: 2 layers, hidden 32, 2 steps"]
    assert png_size(plot.read_bytes()) == (1100, 450)
    figures = json.loads(json_path.read_text())
    assert [run["layers"] for run in figures["sweep"]] == [1, 2]
    subplots = figures["plot"]
    assert len(subplots) == 2
    for title, lines in subplots.items():
        assert sorted(lines) == ["loop", "scan"], title
        for mode, line in lines.items():
            assert line["layers"] == [1, 2], (title, mode)
            assert all(math.isfinite(value) and value > 0 for value in line["seconds"]), (title, mode)
    compile_lines = subplots["XLA compile time (all steps)"]
    assert compile_lines["scan"]["seconds"] == [
        run["modes"]["scan"]["compile_seconds"] for run in figures["sweep"]]


# Imports torch where it builds, not when the parent imports it to check it.
USER_WORKLOAD = """
    def build(mode, layers, hidden):
        import torch, torch_xla

        device = torch_xla.device()
        weight = torch.nn.Parameter(torch.ones(hidden, hidden, device=device))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        inputs = torch.ones(4, hidden, device=device)

        def step():
            optimizer.zero_grad()
            loss = (inputs @ weight).pow(2).mean()
            loss.backward()
            optimizer.step()
            return loss, weight

        return step
"""


def test_user_workload_from_the_current_directory(tmp_path):
    # The real command line, in a new process, with a real worker.
    (tmp_path / "my_workload.py").write_text(textwrap.dedent(USER_WORKLOAD))
    json_path = tmp_path / "figures.json"
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "compare_metrics.py"), "run", "--workload",
         "my_workload:build", "--modes", "loop", "--hidden", "8", "--steps", "2",
         "--json", str(json_path)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        # This checkout's torch_xla_ext, in the parent and its worker.
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert completed.returncode == 0, completed.stderr
    loop = json.loads(json_path.read_text())["modes"]["loop"]
    # loss = mean((4 * 8 ones)^2) = 64 at the start, and SGD lowers it.
    assert 0 < loop["final_loss"] < 64
    assert loop["compilations"] >= 1 and loop["scan_traces"] == 0


@pytest.fixture
def import_path_restored(monkeypatch):
    """--workload puts the current directory on this process's import path: for this test only."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_a_failing_mode_shows_its_error_and_the_others_still_run(
        tmp_path, monkeypatch, forked_workers, import_path_restored):
    # A module name no other test imports into this process.
    (tmp_path / "failing_workload.py").write_text(
        textwrap.dedent(USER_WORKLOAD) + textwrap.dedent("""
        def build_but_not_scan(mode, layers, hidden):
            if mode == "scan":
                raise RuntimeError(f"no {mode} model with {layers} layers here")
            return build(mode, layers, hidden)
    """))
    json_path = tmp_path / "figures.json"
    monkeypatch.chdir(tmp_path)
    completed = compare_metrics("--workload", "failing_workload:build_but_not_scan",
                                "--modes", "scan,loop", "--layers", 4, "--hidden", 8,
                                "--steps", 2, "--json", json_path)
    assert completed.returncode == 1
    error_lines = completed.stderr.splitlines()
    assert "mode 'scan' with 4 layers: exit code 1; the end of its output:" in error_lines
    assert "RuntimeError: no scan model with 4 layers here" in error_lines
    assert error_lines[-1] == ("compare_metrics.py: error: 1 of 2 runs gave no figures: "
                               "scan (exit code 1)")
    # loop ran after scan failed, and the table has both columns.
    assert "[2/2] loop: running 2 steps ..." in error_lines
    assert table_cells(completed.stdout, "worker process") == ["exit code 1", "ok"]
    assert table_cells(completed.stdout, "compilations")[0] == "-"
    assert int(table_cells(completed.stdout, "compilations")[1]) >= 1
    modes = json.loads(json_path.read_text())["modes"]
    assert modes["scan"] == {"worker": "exit code 1"}
    assert modes["loop"]["worker"] == "ok" and modes["loop"]["final_loss"] < 64


def test_timed_out_modes_show_in_the_table_and_the_others_run():
    # Half a second is too little for a worker to import torch_xla: both time out.
    completed = compare_metrics("--modes", "loop,scan", "--timeout", 0.5)
    assert completed.returncode == 1
    assert table_cells(completed.stdout, "worker process") == ["timed out after 0.5 s"] * 2
    assert table_cells(completed.stdout, "compilations") == ["-", "-"]
    assert [line for line in completed.stderr.splitlines() if line.startswith("[")] == [
        "[1/2] loop: running 3 steps ...", "[2/2] scan: running 3 steps ..."]
    assert completed.stderr.splitlines()[-1] == (
        "compare_metrics.py: error: 2 of 2 runs gave no figures: loop (timed out after 0.5 s), "
        "scan (timed out after 0.5 s)")


@pytest.mark.parametrize("args, message", [
    (["--modes", "loop,scna"],
     "argument --modes: unknown mode 'scna' in 'loop,scna'; choose from loop, scan, "
     "scan-device-data, torch-xla-scan"),
    (["--modes", "scan,scan"], "argument --modes: mode 'scan' is given twice in 'scan,scan'"),
    (["--workload", "no_such_module:build"],
     "--workload 'no_such_module:build': cannot import 'no_such_module': "
     "No module named 'no_such_module'"),
    (["--workload", "build"], "--workload 'build': expected MODULE:FUNCTION"),
    (["--plot", "out.png"], "--plot draws a sweep over depths: give --sweep-layers too"),
    (["--timeout", "0"], "argument --timeout: '0' must be more than 0 seconds"),
])
def test_bad_options_name_the_culprit(args, message, import_path_restored):
    completed = compare_metrics(*args)
    assert completed.returncode == 2
    assert message in completed.stderr
    assert "running" not in completed.stderr


# --hf: a transformers model, unconverted (loop) and converted by stack_layers (scan).
TINY_CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
               "num_hidden_layers": 6, "use_cache": False}


def title_and_legend(stdout: str) -> list[str]:
    """The lines printed above the table's header row."""
    lines = stdout.splitlines()
    return lines[:[line.split()[:1] for line in lines].index(["figure"])]


def assert_converted_is_one_scan_of_the_same_steps(modes: dict, converted: str) -> None:
    loop, scan = modes["loop"], modes[converted]
    # The same weights and batch: the same losses (the oracle being the unconverted model).
    assert abs(scan["final_loss"] - loop["final_loss"]) < 1e-4, (scan, loop)
    assert loop["scan_traces"] == 0 and scan["scan_traces"] == 1
    # One stacked weight per kind instead of one per layer.
    assert scan["hlo_parameters"] < loop["hlo_parameters"]


def test_hf_family_runs_unconverted_and_converted_side_by_side(tmp_path, forked_workers):
    json_path = tmp_path / "figures.json"
    completed = compare_metrics("run", "--hf", "qwen3", "--layers", 2, "--hidden", 32,
                                "--steps", STEPS, "--json", json_path)
    assert completed.returncode == 0, completed.stderr
    # torch_xla's scan_layers wrapper knows Llama's layer call only: left out, saying so.
    assert ("not running torch-xla-scan: the torch_xla scan_layers wrapper knows the layer call "
            "of llama models only, not qwen3") in completed.stderr.splitlines()
    modes = ["loop", "scan", "scan-device-data"]
    assert title_and_legend(completed.stdout) == [
        f"transformers qwen3 (built-in config): 2 layers, hidden 32, {STEPS} steps",
        "  loop: the model as transformers builds it (unconverted)",
        "  scan: the model converted by torch_xla_ext.stack_layers(model)",
        "  scan-device-data: that scan traced at every step, every stand-in copied from host"]
    assert [line for line in completed.stdout.splitlines()
            if line.startswith("figure")][0].split() == ["figure", *modes]
    figures = json.loads(json_path.read_text())
    assert list(figures["modes"]) == modes
    assert figures["settings"]["layers"] == 2 and figures["settings"]["hidden"] == 32
    assert_converted_is_one_scan_of_the_same_steps(figures["modes"], "scan")
    device_data = figures["modes"]["scan-device-data"]
    assert [step["scan_traces"] for step in device_data["steps"]] == [1] * STEPS
    assert abs(device_data["final_loss"] - figures["modes"]["loop"]["final_loss"]) < 1e-4


def test_hf_config_json_with_layers_overriding_its_depth(tmp_path, forked_workers):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    json_path = tmp_path / "figures.json"
    # The directory stands for its config.json.
    completed = compare_metrics("--hf", tmp_path, "--layers", 2, "--modes", "loop,scan",
                                "--steps", STEPS, "--json", json_path, "--op-times")
    assert completed.returncode == 0, completed.stderr
    assert title_and_legend(completed.stdout)[0] == (
        f"transformers llama ({tmp_path / 'config.json'}): 2 layers, hidden 32, {STEPS} steps")
    figures = json.loads(json_path.read_text())
    assert figures["settings"]["layers"] == 2
    assert_converted_is_one_scan_of_the_same_steps(figures["modes"], "scan")
    # Two layers, not the file's six: fewer weights than a six-layer loop would have.
    assert figures["modes"]["loop"]["hlo_parameters"] < 6 * 9
    # --op-times: the same products in both; only the scan reads slices of stacks.
    rows, busy = op_times_rows(completed.stdout.splitlines(), (
        "Where a step's time went, op by op (count and wall ms of each kind of op, per step, "
        "over 2 more steps):"))
    assert rows["dot"][0] == rows["dot"][2] != "0", rows
    assert rows["dynamic-slice_bitcast_fusion"][0] == "0", rows
    assert rows["dynamic-slice_bitcast_fusion"][2] != "0", rows
    assert [float(ms) > 0 for ms in busy] == [True, True]
    scan_ops = figures["modes"]["scan"]["op_times"]["kinds"]
    assert scan_ops["dot"][0] == figures["modes"]["loop"]["op_times"]["kinds"]["dot"][0]


FAMILY_LIST = ("llama, qwen3, gemma2, gemma3, qwen2-window, gpt2, mixtral, qwen3_moe, bert, "
               "vit, t5")


@pytest.mark.parametrize("config, args, message", [
    ("llamma", [], f"--hf 'llamma': expected the path of a config.json (or of a directory "
                   f"holding one) or a built-in family: {FAMILY_LIST}; there is no file llamma"),
    ("missing/config.json", [],
     f"built-in family: {FAMILY_LIST}; there is no file missing/config.json"),
    ("{written}", [], "is not a transformers config: its model_type is None"),
    ("{written}", ["--hidden", "64"], "--hidden 64: --hf '{written}' is a config.json, whose "
                                      "hidden_size is the width"),
    ("qwen3", ["--modes", "loop,torch-xla-scan"],
     "--modes torch-xla-scan: the torch_xla scan_layers wrapper knows the layer call of llama "
     "models only, not qwen3"),
    ("llama", ["--hidden", "30"], "--hidden 30: the built-in configs have 4 heads"),
    ("llama", ["--workload", "my:build"], "argument --workload: not allowed with argument --hf"),
])
def test_bad_hf_configs_name_the_culprit(tmp_path, config, args, message):
    written = tmp_path / "not_a_config.json"
    written.write_text(json.dumps({"hidden_size": 32}))
    completed = compare_metrics("--hf", config.format(written=written), *args)
    assert completed.returncode == 2
    assert message.format(written=written) in completed.stderr
    assert "Traceback" not in completed.stderr and "running" not in completed.stderr
