"""lhc bench pencil at toy size: both ways draw the same tokens, and the table prints
(timings are printed, never checked)."""

from lhc.pencil import bench


def test_bench_rows(capsys):
    rows = bench.main(["--size", "tiny", "--contexts", "40", "--new-tokens", "6", "--batch", "2"])
    (row,) = rows
    assert row["same_tokens"] and row["context"] == 40 and row["batch"] == 2
    assert row["rewind_tokens_per_s"] > 0 and row["recompute_tokens_per_s"] > 0
    assert row["speedup"] == row["rewind_tokens_per_s"] / row["recompute_tokens_per_s"]
    assert "| 40 | 6 x 2 |" in capsys.readouterr().out
