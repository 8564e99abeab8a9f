"""lhc bench pencil at toy size: both ways draw the same tokens, the table prints and the
JSON file holds the rows (timings are printed, never checked)."""

import json

import pytest

from lhc.pencil import bench


def test_bench_rows(capsys, tmp_path):
    path = tmp_path / "pencil.json"
    result = bench.main(["--size", "tiny", "--contexts", "40", "--new-tokens", "6", "--batch", "2",
                         "--json", str(path)])  # fmt: skip
    (row,) = result["rows"]
    assert row["same_tokens"] and row["context"] == 40 and row["batch"] == 2
    assert row["new_tokens"] == 6 and row["reductions"] >= 0
    # No stop tokens: each of the 2 sequences generates all 6 tokens.
    assert row["rewind_tokens_per_s"] == pytest.approx(12 / row["rewind_s"])
    assert row["recompute_tokens_per_s"] == pytest.approx(12 / row["recompute_s"])
    assert row["speedup"] == pytest.approx(row["recompute_s"] / row["rewind_s"])
    out = capsys.readouterr().out
    assert "| 40 | 6 x 2 |" in out and "device: " in out
    assert json.loads(path.read_text())["rows"] == [row]


def test_bad_contexts_are_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "40,x"])
    assert "--contexts: expected comma-separated ints, got '40,x'" in capsys.readouterr().err
