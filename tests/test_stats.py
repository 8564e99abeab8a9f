"""lhc.stats: result files, intervals and tables, against hand-written files, scipy and
tables written out by hand."""

import json

import numpy as np
import pytest

from lhc import stats


def test_records_append_and_read_back_and_a_cut_last_line_is_dropped(tmp_path):
    path = tmp_path / "results" / "run.jsonl"
    assert stats.read_records(path) == []
    stats.append_records(path, [{"id": 1, "score": 0.5}, json.dumps({"id": 2})])
    stats.append_records(path, [])
    assert path.read_text() == '{"id": 1, "score": 0.5}\n{"id": 2}\n'
    with open(path, "a") as handle:
        handle.write('{"id": 3, "sco')  # an interrupted write
    assert stats.read_records(path) == [{"id": 1, "score": 0.5}, {"id": 2}]
    assert path.read_text() == '{"id": 1, "score": 0.5}\n{"id": 2}\n'


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON record"):
        stats.read_records(path)


def test_wilson_interval_matches_scipy():
    from scipy.stats import binomtest

    for k, n in ((0, 5), (1, 12), (17, 20), (40, 40)):
        want = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert stats.wilson_interval(k, n) == pytest.approx((want.low, want.high), abs=2e-4)
    assert stats.wilson_interval(0, 0) == (0.0, 1.0)


def test_mcnemar_matches_scipys_binomial_test_on_the_disagreements():
    from scipy.stats import binomtest

    rng = np.random.default_rng(0)
    for n, p_first, p_second in ((40, 0.7, 0.4), (25, 0.5, 0.5), (200, 0.62, 0.55)):
        first, second = rng.random(n) < p_first, rng.random(n) < p_second
        got = stats.mcnemar(first.tolist(), second.tolist())
        only_first, only_second = int(np.sum(first & ~second)), int(np.sum(second & ~first))
        assert (got["only_first"], got["only_second"], got["items"]) == (only_first, only_second, n)
        want = binomtest(only_first, only_first + only_second, 0.5).pvalue
        assert got["p_value"] == pytest.approx(want, rel=1e-9)
    assert stats.mcnemar([True, False], [True, False])["p_value"] == 1.0
    with pytest.raises(ValueError, match="mcnemar: expected the same items"):
        stats.mcnemar([True], [True, False])


def test_markdown_table_formats_and_aligns():
    rows = [
        {"name": "a", "ratio": 1.5, "share": 0.25, "n": 1200},
        {"name": "b", "ratio": 0.333, "n": 7, "flag": True},
    ]
    table = stats.markdown_table(
        [
            ("name", "name"),
            ("ratio", "ratio", ".2fx"),
            ("share", "share", "%"),
            ("n", "n", ","),
            ("flag", "flag"),
        ],
        rows,
    )
    assert table.splitlines() == [
        "| name | ratio | share | n | flag |",
        "|---|---:|---:|---:|---|",
        "| a | 1.50x | 25% | 1,200 |  |",
        "| b | 0.33x |  | 7 | True |",
    ]
