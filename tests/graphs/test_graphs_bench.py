"""lhc bench graphs (alias range) at toy size: both ways agree, the table prints and the
JSON file holds the rows and settings (timings are printed, never checked)."""

import json

import pytest

from lhc import bench as harness
from lhc.graphs import bench


def test_bench_rows(capsys, tmp_path):
    path = tmp_path / "graphs.json"
    flags = "--sides 3 --hessian-sides 2 --layers 2 --width 8 --out-channels 2 --chunk-size 4"
    result = bench.main([*flags.split(), "--repeats", "1", "--json", str(path)])
    rows = result["rows"]
    assert [(r["kind"], r["side"], r["nodes"]) for r in rows] == [
        ("jacobian", 3, 9),
        ("hessian", 2, 4),
    ]
    for row in rows:
        assert row["relative_difference"] < 1e-5
        assert row["full_s"] > 0 and row["chunked_s"] > 0
        # XLA's figure holds at least the [N, N] float32 influence the call returns.
        for key in ("full_bytes", "chunked_bytes"):
            assert row[key] is None or row[key] >= 4 * row["nodes"] ** 2
    assert result["settings"] == dict(layers=2, width=8, out_channels=2, chunk_size=4, repeats=1)
    out = capsys.readouterr().out
    assert "2 layers, width 8, 2 output channels" in out
    assert "| influence | nodes | full s | chunked s | time ratio |" in out
    assert "| jacobian | 9 |" in out and "device: " in out
    written = json.loads(path.read_text())
    assert written["rows"] == rows and written["settings"] == result["settings"]


def test_range_is_an_alias_of_graphs():
    main, argv = harness.resolve("range", ["--sides", "3"])
    assert main is bench.main and argv == ["--sides", "3"]


def test_bad_sides_are_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--sides", "0,3"])
    assert "--sides: expected positive ints, got '0,3'" in capsys.readouterr().err
