"""scripts/bench_nested.py at small sizes: both modes, forked workers, give
the same loss, and the table has each inner length's times and ratios."""
import re

from benchmark_scripts import forked_workers  # noqa: F401 (a fixture)
import bench_nested  # noqa: E402


def test_both_modes_train_to_the_same_loss_and_each_length_has_its_ratios(forked_workers,
                                                                          capsys):
    bench_nested.main(["--inner", "1,3", "--groups", "2", "--width", "16"])
    printed = capsys.readouterr().out
    assert "losses equal: yes" in printed, printed
    number = r"\d+\.\d+"
    for inner in (1, 3):
        assert re.search(rf"^{inner}(?: +{number}){{6}}$", printed, re.MULTILINE), printed
    assert re.search(rf"^nested: compile at inner 3 / at inner 1: {number}$", printed,
                     re.MULTILINE), printed
