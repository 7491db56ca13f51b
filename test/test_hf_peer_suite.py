"""scripts/hf_peer_suite.py on a handful of transformers' own ModelTesterMixin
tests of Llama, read from the transformers sdist (downloaded into the cache
at the first run, scripts/hf_peer_sdist.py: where it cannot be, the test
fails saying why): both modes report each test, the regressions and the base
failures are exactly the tests whose outcomes say so, and the counts add up.
The command line runs in pytest's process, its workers forked
(benchmark_scripts.py). The regressions are whatever they are today: the
assertions on them hold whether or not a change to the conversion fixes one;
the one test that converting broke until now is asserted to pass."""
import re

import pytest

from benchmark_scripts import forked_workers  # noqa: F401 (a fixture)
import hf_peer_sdist
import hf_peer_suite

# A test that passes unconverted, one that also converts no model, one that
# fails on XLA unconverted (torch's checkpoint looks for a `torch.xla` module),
# and one skipped in both (hf_peer_testers.py skips it).
PASSES_UNCONVERTED = "test_hidden_states_output"
CONVERTS_NOTHING = "test_model_main_input_name"
FAILS_UNCONVERTED = "test_training_gradient_checkpointing_use_reentrant_true"
SKIPPED = "test_generation_tester_mixin_inheritance"
# A test that converting broke until the scan's backward gave the retained
# gradients of the layers' hidden states and attentions the for loop's.
RETAINS_GRADIENTS = "test_retain_grad_hidden_states_attentions"
CHOSEN = (PASSES_UNCONVERTED, CONVERTS_NOTHING, FAILS_UNCONVERTED, SKIPPED, RETAINS_GRADIENTS)
ROW = re.compile(r"^(test_\w+) +llama +(pass|FAIL|skip) +(pass|FAIL|skip) +(\d+)$", re.M)


def test_both_modes_report_each_test_and_the_regressions_are_the_tests_converting_broke(
        forked_workers, capsys):
    hf_peer_suite.main(["--families", "llama", "--jobs", "1",
                        *(argument for name in CHOSEN for argument in ("--tests", name))])
    printed = capsys.readouterr().out
    rows = {name: (unconverted, converted, int(models))
            for name, unconverted, converted, models in ROW.findall(printed)}
    assert set(rows) == set(CHOSEN), printed
    assert rows[PASSES_UNCONVERTED][0] == "pass" and rows[PASSES_UNCONVERTED][2] > 0, printed
    assert rows[CONVERTS_NOTHING] == ("pass", "pass", 0), printed
    assert rows[FAILS_UNCONVERTED][:2] == ("FAIL", "FAIL"), printed
    assert rows[SKIPPED] == ("skip", "skip", 0), printed
    assert rows[RETAINS_GRADIENTS][:2] == ("pass", "pass") and rows[RETAINS_GRADIENTS][2] > 0, \
        printed

    regressions = sorted(re.findall(r"^  llama (test_\w+): (.+)$",
                                    section(printed, "regressions"), re.M))
    assert [name for name, _ in regressions] == sorted(
        name for name, (unconverted, converted, _) in rows.items()
        if (unconverted, converted) == ("pass", "FAIL")), printed
    assert all(message.strip() for _, message in regressions), printed
    assert re.search(rf"^  1: AttributeError: module 'torch' has no attribute 'xla'\n"
                     rf" +llama {FAILS_UNCONVERTED}$", section(printed, "base failures"),
                     re.M), printed

    tally = {mode: [sum(outcomes[index] == outcome for outcomes in rows.values())
                    for outcome in ("pass", "FAIL", "skip")] for index, mode in enumerate(
                        hf_peer_suite.MODES)}
    assert (f"llama: unconverted {tally['unconverted'][0]} pass, {tally['unconverted'][1]} fail, "
            f"{tally['unconverted'][2]} skip; converted {tally['converted'][0]} pass, "
            f"{tally['converted'][1]} fail, {tally['converted'][2]} skip; "
            f"{len(regressions)} regressions") in printed, printed


def section(printed: str, heading: str) -> str:
    """The lines after the line starting with `heading`, up to a blank line."""
    return re.search(rf"^{heading}.*\n((?:.+\n)*)", printed, re.M).group(1)


def result(outcome: str, message: str = "") -> dict:
    return {"outcome": outcome, "message": message, "converted": 1}


def test_the_comparison_sorts_each_test_by_its_two_outcomes():
    unconverted = {"broken": result("pass"), "fails_in_both": result("FAIL", "E: unconverted"),
                   "fixed": result("FAIL", "E: before"), "now_skipped": result("pass"),
                   "same": result("pass"), "skipped": result("skip", "no GPU"),
                   "missing": result("pass")}
    converted = {"broken": result("FAIL", "E: converted"),
                 "fails_in_both": result("FAIL", "E: converted too"), "fixed": result("pass"),
                 "now_skipped": result("skip", "why"), "same": result("pass"),
                 "skipped": result("skip", "no GPU")}
    found = hf_peer_suite.comparison({"unconverted": unconverted, "converted": converted})
    assert found == {
        "regressions": [("broken", "E: converted")],
        "base_failures": [("fails_in_both", "E: unconverted"), ("fixed", "E: before")],
        "other_changes": [("fails_in_both", "FAIL -> FAIL: E: converted too"),
                          ("fixed", "FAIL -> pass"), ("now_skipped", "pass -> skip: why"),
                          ("missing", "pass -> not run")],
    }


def test_a_sdist_that_cannot_be_downloaded_ends_the_script_saying_why(monkeypatch, tmp_path,
                                                                      capsys):
    monkeypatch.setenv(hf_peer_sdist.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(hf_peer_sdist, "installed_version", lambda: "0.0.0")
    with pytest.raises(SystemExit) as exited:
        hf_peer_suite.main(["--families", "llama"])
    message = str(exited.value)
    assert message.startswith("hf_peer_suite.py: error: could not download the source "
                              "distribution of transformers 0.0.0"), message
    assert str(tmp_path) in message and hf_peer_sdist.CACHE_VARIABLE in message, message
    assert not list(tmp_path.iterdir())  # the download's scratch folder is gone
