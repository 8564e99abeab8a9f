"""The benchmark command end to end on a tiny network (two fresh processes)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.parity
def test_bench_runs_both_implementations(tmp_path, capsys):
    pytest.importorskip("tabicl")
    from lhc.tabicl.bench import main

    out = tmp_path / "bench.json"
    results = main(
        [
            "--sizes",
            "40",
            "--n-estimators",
            "1",
            "--test-rows",
            "12",
            "--features",
            "4",
            "--classes",
            "3",
            "--tiny-model",
            "--warmup",
            "1",
            "--stages",
            "--json",
            str(out),
        ]
    )
    (row,) = results["rows"]
    assert (row["n_train"], row["n_estimators"]) == (40, 1)
    for impl in ("reference", "lhc"):
        assert row[impl]["predict_s"] > 0 and row[impl]["peak_rss_mb"] > 0, row[impl]
    # lhc reads the Orbax conversion and never imports torch.
    assert row["lhc"]["torch_imported"] is False and row["reference"]["torch_imported"] is True
    # One member, no shuffles or offsets differ: the same probabilities.
    assert row["max_abs_proba_diff"] < 1e-4
    assert row["time_ratio"] > 0 and row["memory_ratio"] > 0
    # --stages times lhc's jitted stages inside its timed call.
    stages = row["lhc"]["stages_s"]
    assert set(stages) == {"train_summaries", "embed_cells", "embed_rows", "icl_logits"}
    assert all(t > 0 for t in stages.values())
    assert sum(stages.values()) <= row["lhc"]["predict_s"]
    assert "stages_s" not in row["reference"]
    written = json.loads(out.read_text())
    assert written["rows"][0]["n_train"] == 40 and written["settings"]["sizes"] == [40]
    printed = capsys.readouterr().out
    assert "| train rows | n_est | ref s | lhc s | ref/lhc |" in printed
    assert "lhc stages at 40 rows x 1: train_summaries" in printed and "device: " in printed


def test_table_tells_a_skipped_implementation_from_a_failed_one():
    from lhc.tabicl.bench import table

    rows = [
        {"n_train": 100, "n_estimators": 1, "lhc": {"predict_s": 2.5, "peak_rss_mb": 900.0}},
        {"n_train": 200, "n_estimators": 8, "reference": {"error": "exit 1"}, "lhc": {}},
    ]
    skipped, failed = table(rows).splitlines()[2:]
    cells = lambda line: [cell.strip() for cell in line.strip("|").split(" | ")]  # noqa: E731
    # train rows, n_est, ref s, lhc s, ratio, ref MB, lhc MB, ratio, max|dp|
    assert cells(skipped) == ["100", "1", "not run", "2.50", "", "not run", "900", "", ""]
    assert cells(failed) == ["200", "8", "fail", "fail", "", "fail", "fail", "", ""]


def test_bad_impls_are_a_clear_error(capsys):
    from lhc.tabicl.bench import main

    with pytest.raises(SystemExit):
        main(["--impls", "lhc,torch"])
    assert "--impls entries must be in ('reference', 'lhc'), got 'torch'" in capsys.readouterr().err
