"""lhc bench pencil at toy size: both ways draw the same tokens, the table prints and the
JSON file holds the rows. The timer reports chosen seconds (the real ones are only
checked to be positive), so the rates and the speedup are checked against closed forms."""

import json
import math

import pytest

from lhc.pencil import bench

from ..support import fixed_timings


def test_bench_rows(capsys, tmp_path, monkeypatch):
    path = tmp_path / "pencil.json"
    measured = fixed_timings(monkeypatch, timed=[0.5, 3.0])  # rewind, then recompute
    flags = "--size tiny --contexts 40 --new-tokens 6 --batch 2"
    result = bench.main([*flags.split(), "--json", str(path)])
    (row,) = result["rows"]
    assert row["same_tokens"] and row["context"] == 40 and row["batch"] == 2
    assert row["new_tokens"] == 6 and row["reductions"] >= 0
    assert len(measured) == 2 and all(0 < s < math.inf for s in measured)
    # No stop tokens: each of the 2 sequences generates all 6 tokens, 12 tokens in 0.5 s
    # rewinding and in 3 s recomputing, a speedup of 6.
    assert (row["rewind_s"], row["recompute_s"]) == (0.5, 3.0)
    assert row["rewind_tokens_per_s"] == pytest.approx(24)
    assert row["recompute_tokens_per_s"] == pytest.approx(4)
    assert row["speedup"] == pytest.approx(6)
    out = capsys.readouterr().out
    assert "| 40 | 6 x 2 | 24.0 | 4.00 | 6.0x |" in out and "device: " in out
    assert json.loads(path.read_text())["rows"] == [row]


def test_bad_contexts_are_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "40,x"])
    assert "--contexts: expected comma-separated ints, got '40,x'" in capsys.readouterr().err
