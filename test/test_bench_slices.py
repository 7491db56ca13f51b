"""scripts/bench_slices.py at tiny shapes: a row per number of rows, each with
the three passes' times, their ratios, and the scans' results equal to the
loop's."""
import re

import benchmark_scripts  # noqa: F401 (first: it puts scripts/ on the import path)
import bench_slices


def test_each_row_count_times_the_three_passes_and_their_results_agree(capsys):
    bench_slices.main(["--layers", "3", "--hidden", "16", "--rows", "1,4", "--repeats", "2"])
    printed = capsys.readouterr().out
    assert re.search(r"^CPU: 3 layers of h \+ tanh\(linear\(h, w\)\), w \[16, 16\] f32", printed,
                     re.MULTILINE), printed
    number = r"\d+\.\d+"
    for rows in (1, 4):
        row = re.search(rf"^{rows} +{number} +{number} +{number} +({number}) +({number}) +(\S+)$",
                        printed, re.MULTILINE)
        assert row, printed
        assert float(row.group(3)) <= 1e-5, printed


def test_markdown_prints_the_table_as_markdown(capsys):
    bench_slices.main(["--layers", "2", "--hidden", "8", "--rows", "2", "--repeats", "1",
                       "--markdown"])
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("| rows | loop ms | scan ms | scan unroll ms | scan / loop | "
                         "scan unroll / loop | max abs diff |")
    assert lines[header + 1] == "|---|---:|---:|---:|---:|---:|---:|"
    assert lines[header + 2].startswith("| 2 | ")
