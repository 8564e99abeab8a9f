"""lhc bench recurrent at toy size: both ways give the same outputs, the tables print and
the JSON file holds the rows. The timer reports chosen seconds (the real ones are only
checked to be positive), so the rates and speedups are checked against closed forms."""

import json
import math

import pytest

from lhc.recurrent import bench

from ..support import fixed_timings


def test_bench_rows(capsys, tmp_path, monkeypatch):
    path = tmp_path / "recurrent.json"
    # Seconds of the chunked and the scan pass of each row, in the order they are timed.
    measured = fixed_timings(monkeypatch, timed=[0.5, 3.0, 0.25, 2.0])
    flags = "--lengths 40 --chunk-size 16 --repeats 1 --positions 10,100000 --steps 2 --size tiny"
    result = bench.main([*flags.split(), "--json", str(path)])
    rows, decode = result["rows"], result["decode"]
    assert [(r["recurrence"], r["length"], r["batch"]) for r in rows] == [
        ("ssd", 40, 2),
        ("gla", 40, 2),
    ]
    assert [(r["model"], r["position"]) for r in decode] == [
        ("mamba2", 10),
        ("mamba2", 100000),
        ("gla", 10),
        ("gla", 100000),
    ]
    assert all(r["ms_per_token"] > 0 and r["cache_bytes"] > 0 for r in decode)
    assert len(measured) == 4 and all(0 < s < math.inf for s in measured)
    # 2 sequences of 40 tokens in each timed pass: 80 / 0.5 = 160 tokens/s chunked, 80 / 3
    # scan, a speedup of 3 / 0.5 = 6; then 320, 40 and 8.
    want = [(0.5, 3.0, 160, 80 / 3, 6.0), (0.25, 2.0, 320, 40, 8.0)]
    for row, (chunked_s, scan_s, chunked_rate, scan_rate, speedup) in zip(rows, want):
        assert row["same_outputs"] and (row["chunked_s"], row["scan_s"]) == (chunked_s, scan_s)
        assert row["chunked_tokens_per_s"] == pytest.approx(chunked_rate)
        assert row["scan_tokens_per_s"] == pytest.approx(scan_rate)
        assert row["speedup"] == pytest.approx(speedup)
    out = capsys.readouterr().out
    assert (
        "| ssd | 40 x 2 | 160 | 27 | 6.0x |" in out and "| gla | 40 x 2 | 320 | 40 | 8.0x |" in out
    )
    assert "| mamba2 | 10 |" in out and "device: " in out
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
