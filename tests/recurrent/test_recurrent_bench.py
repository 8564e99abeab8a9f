"""lhc bench recurrent at toy size: both ways give the same outputs, the tables print and
the JSON file holds the rows (timings are printed, never checked)."""

import json

import pytest

from lhc.recurrent import bench


def test_bench_rows(capsys, tmp_path):
    path = tmp_path / "recurrent.json"
    result = bench.main(["--lengths", "40", "--chunk-size", "16", "--repeats", "1",
                         "--positions", "10,100000", "--steps", "2", "--size", "tiny",
                         "--json", str(path)])  # fmt: skip
    rows, decode = result["rows"], result["decode"]
    assert [(r["recurrence"], r["length"], r["batch"]) for r in rows] == [
        ("ssd", 40, 2), ("gla", 40, 2)
    ]  # fmt: skip
    assert [(r["model"], r["position"]) for r in decode] == [
        ("mamba2", 10), ("mamba2", 100000), ("gla", 10), ("gla", 100000)
    ]  # fmt: skip
    assert all(r["ms_per_token"] > 0 and r["cache_bytes"] > 0 for r in decode)
    for row in rows:
        assert row["same_outputs"] and row["chunked_s"] > 0 and row["scan_s"] > 0
        # 2 sequences of 40 tokens in each timed pass.
        assert row["chunked_tokens_per_s"] == pytest.approx(80 / row["chunked_s"])
        assert row["scan_tokens_per_s"] == pytest.approx(80 / row["scan_s"])
        assert row["speedup"] == pytest.approx(row["scan_s"] / row["chunked_s"])
    out = capsys.readouterr().out
    assert "| ssd | 40 x 2 |" in out and "| mamba2 | 10 |" in out and "device: " in out
    written = json.loads(path.read_text())
    assert written["rows"] == rows and written["decode"] == decode
    assert written["footer"].startswith("device: ")


def test_bad_lengths_are_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--lengths", "a,b"])
    assert "--lengths: expected comma-separated ints, got 'a,b'" in capsys.readouterr().err


def test_no_positions_no_decode_rows(capsys):
    result = bench.main(["--lengths", "8", "--chunk-size", "8", "--repeats", "1"])
    assert [r["length"] for r in result["rows"]] == [8, 8] and result["decode"] == []
