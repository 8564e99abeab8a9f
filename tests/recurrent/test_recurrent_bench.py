"""lhc bench recurrent at toy size: both ways give the same outputs and the table prints
(timings are printed, never checked)."""

import pytest

from lhc.recurrent import bench


def test_bench_rows(capsys):
    rows = bench.main(["--lengths", "40", "--chunk-size", "16", "--repeats", "1",
                       "--positions", "10,100000", "--steps", "2", "--size", "tiny"])  # fmt: skip
    rows, decode = rows[:2], rows[2:]
    assert [(r["recurrence"], r["length"]) for r in rows] == [("ssd", 40), ("gla", 40)]
    assert [(r["model"], r["position"]) for r in decode] == [
        ("mamba2", 10), ("mamba2", 100000), ("gla", 10), ("gla", 100000)
    ]  # fmt: skip
    assert all(r["ms_per_token"] > 0 and r["cache_bytes"] > 0 for r in decode)
    for row in rows:
        assert (
            row["same_outputs"] and row["chunked_tokens_per_s"] > 0 and row["scan_tokens_per_s"] > 0
        )
        assert row["speedup"] == row["chunked_tokens_per_s"] / row["scan_tokens_per_s"]
    assert "| ssd | 40 x 2 |" in capsys.readouterr().out


def test_bad_lengths_are_a_clear_error():
    with pytest.raises(SystemExit, match="--lengths must be comma-separated ints, got 'a,b'"):
        bench.main(["--lengths", "a,b"])
