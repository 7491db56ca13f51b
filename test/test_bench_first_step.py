"""scripts/bench_first_step.py on a small Llama: each side trains in a
process of its own (forked, benchmark_scripts.py), the converted one as one
scan whose first step is split into the project's stages, which add up with
torch_xla's tracing, XLA's compile and the run to the step's wall time."""
import time

from benchmark_scripts import worker_figures  # puts scripts/ on the import path
import bench_first_step  # noqa: E402


def test_the_converted_first_step_splits_into_the_projects_stages(scenario_server):
    figures = {mode: worker_figures(scenario_server, "bench_first_step.py", "llama", mode,
                                    "--layers", "2")
               for mode in ("unconverted", "converted")}
    converted, unconverted = figures["converted"], figures["unconverted"]
    assert abs(converted["loss"] - unconverted["loss"]) < 1e-4, figures
    assert (converted["while loops"], unconverted["while loops"]) == (1, 0)
    assert converted["layer by layer"] == [] and unconverted["stages s"] == {}
    calls = converted["stage calls"]
    # One kind of call: recorded and planned once, its step traced once on placeholders,
    # differentiated once (the forward and backward steps lowered, and the inference step).
    assert (calls["record calls"], calls["plan"], calls["trace"], calls["differentiate"]) == (
        1, 1, 1, 1), calls
    assert set(converted["stages s"]) <= {label for label, _, _ in bench_first_step.STAGES}
    for side in figures.values():
        parts = side["ours s"] + side["torch_xla tracing s"] + side["XLA compile s"] + side["run s"]
        assert abs(parts - side["first step s"]) < 1e-6
        assert side["torch_xla tracing s"] > 0  # the stages are not counted twice
        assert side["compiles"] >= 1 and side["second step s"] < side["first step s"]


def test_a_stage_called_inside_another_counts_for_itself_only():
    clock = bench_first_step.StageClock()
    inner = clock.wrapped("inner", lambda: time.sleep(0.02))
    outer = clock.wrapped("outer", lambda: (time.sleep(0.02), inner(), inner()))
    started = time.perf_counter()
    outer()
    total = time.perf_counter() - started
    assert clock.calls == {"outer": 1, "inner": 2}
    assert clock.seconds["outer"] >= 0.02 and clock.seconds["inner"] >= 0.04
    assert abs(clock.seconds["outer"] + clock.seconds["inner"] - total) < 0.005
