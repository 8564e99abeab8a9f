"""lhc.stats: result files, intervals, bootstraps and tables, against hand-written files,
scipy, closed-form results and tables written out by hand."""

import gzip
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


def test_a_gz_results_file_is_gzip_of_the_same_lines_and_appends_keep_it_whole(tmp_path):
    path = tmp_path / "results" / "run.jsonl.gz"
    stats.append_records(path, [{"id": 1, "answer": "Yuki"}])
    stats.append_records(path, [{"id": 2, "answer": "Stuart"}, json.dumps({"id": 3})])
    text = '{"id": 1, "answer": "Yuki"}\n{"id": 2, "answer": "Stuart"}\n{"id": 3}\n'
    assert gzip.decompress(path.read_bytes()).decode() == text  # one stream, readable by gzip
    assert stats.read_records(path) == [json.loads(line) for line in text.splitlines()]
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.jsonl.gz"]
    first = path.read_bytes()
    path.unlink()
    stats.append_records(path, [json.loads(line) for line in text.splitlines()])
    assert path.read_bytes() == first  # no time stamp: the same records, the same bytes


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


# A percentile endpoint estimated from B resamples has a Monte Carlo standard deviation of
# about sqrt(q (1 - q) / B) / phi(z_q) standard errors of the statistic (q = 0.025 for a 95%
# interval; phi the normal density at the quantile z_q): 0.027 at B = 10,000 and 0.019 at
# 20,000, so 0.033 between two such estimates. Endpoints agree within 0.15 standard errors,
# about 4.5 of those deviations.
_ENDPOINT_TOLERANCE = 0.15


def _scipy_percentile_bootstrap(data, statistic, **kwargs):
    from scipy.stats import bootstrap

    result = bootstrap(
        data, statistic, method="percentile", n_resamples=20_000, random_state=1, **kwargs
    )
    interval = result.confidence_interval
    return (interval.low, interval.high), result.standard_error


def test_bootstrap_interval_of_a_mean_matches_scipy_and_normal_theory():
    values = np.random.default_rng(0).normal(3.0, 2.0, size=200)
    want, standard_error = _scipy_percentile_bootstrap((values,), np.mean)
    got = stats.bootstrap_interval(values)
    assert got == pytest.approx(want, abs=_ENDPOINT_TOLERANCE * standard_error)
    # Normal theory: the plug-in standard deviation differs from s by sqrt(199/200).
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
    normal = (values.mean() - half, values.mean() + half)
    assert got == pytest.approx(normal, abs=0.25 * standard_error)


def test_bootstrap_interval_of_another_statistic_matches_scipy():
    values = np.random.default_rng(1).exponential(size=150)
    # 4,000 resamples (np.std loops in Python): 0.033 standard errors of Monte Carlo error
    # at the 5% quantile, 0.036 between the two estimates.
    got = stats.bootstrap_interval(values, np.std, confidence=0.9, resamples=4_000)
    assert got[0] < np.std(values) < got[1]
    want, standard_error = _scipy_percentile_bootstrap((values,), np.std, confidence_level=0.9)
    assert got == pytest.approx(want, abs=_ENDPOINT_TOLERANCE * standard_error)


def test_groups_of_one_item_bootstrap_as_items():
    values = np.random.default_rng(2).normal(size=60)
    ids = [f"pair{i}" for i in range(60)]  # unique ids draw exactly as items do
    assert stats.bootstrap_interval(values, groups=ids, seed=3) == stats.bootstrap_interval(
        values, seed=3
    )
    median = stats.bootstrap_interval(values, np.median, resamples=2_000, seed=3)
    assert stats.bootstrap_interval(
        values, np.median, groups=ids, resamples=2_000, seed=3
    ) == pytest.approx(median, rel=1e-12)


@pytest.mark.parametrize("general", [False, True], ids=["mean", "any_statistic"])
def test_cluster_bootstrap_of_copied_items_is_the_bootstrap_of_the_originals(general):
    # Each of n values copied k times, each value's copies a group: a cluster resample of
    # n groups has the mean of n values drawn from the originals, so the interval is
    # scipy's of the originals; an item resample sees kn independent items and is too
    # narrow by sqrt(k).
    copies = 4
    values = np.random.default_rng(4).normal(size=200)
    copied, pairs = np.repeat(values, copies), np.repeat(np.arange(200), copies)
    want, standard_error = _scipy_percentile_bootstrap((values,), np.mean)
    statistic = (lambda items: float(np.mean(items))) if general else np.mean
    resamples = 4_000 if general else 10_000  # the general statistic loops in Python
    got = stats.bootstrap_interval(
        copied, statistic, groups=pairs.tolist(), resamples=resamples, seed=5
    )
    # 4,000 resamples: 0.042 standard errors of Monte Carlo error, 0.046 between the two.
    assert got == pytest.approx(want, abs=_ENDPOINT_TOLERANCE * standard_error)
    low, high = stats.bootstrap_interval(copied, seed=5)
    assert (high - low) * np.sqrt(copies) == pytest.approx(want[1] - want[0], rel=0.08)


def test_paired_bootstrap_matches_scipys_paired_bootstrap():
    rng = np.random.default_rng(6)
    first = rng.normal(0.6, 1.0, size=200)
    second = 0.5 * first + rng.normal(0.2, 0.8, size=200)  # correlated, as paired scores are
    got = stats.paired_bootstrap(first, second)
    assert got["items"] == 200
    assert got["difference"] == pytest.approx(first.mean() - second.mean(), rel=1e-12)

    def difference(a, b, axis):
        return np.mean(a, axis=axis) - np.mean(b, axis=axis)

    want, standard_error = _scipy_percentile_bootstrap(
        (first, second), difference, paired=True, vectorized=True
    )
    assert (got["low"], got["high"]) == pytest.approx(
        want, abs=_ENDPOINT_TOLERANCE * standard_error
    )


def test_paired_bootstrap_p_value():
    rng = np.random.default_rng(7)
    # Right or wrong: a clear shift (80% against 50% right on 200 items).
    better, worse = rng.random(200) < 0.8, rng.random(200) < 0.5
    shifted = stats.paired_bootstrap(better.tolist(), worse.tolist())
    assert shifted["p_value"] < 1e-3 and shifted["low"] > 0
    # Identical methods: every resampled difference is zero.
    assert stats.paired_bootstrap(better, better)["p_value"] == 1.0
    # Symmetric noise: the differences are +-d, so the resampled means are symmetric about 0.
    noise = rng.normal(size=100)
    symmetric = stats.paired_bootstrap(np.r_[noise, -noise], np.r_[-noise, noise])
    assert symmetric["difference"] == pytest.approx(0, abs=1e-12)
    assert symmetric["p_value"] > 0.5
    # Differences of mean exactly 2 bootstrap standard errors: the normal-theory p-value
    # 2 (1 - Phi(2)) = 0.0455, within Monte Carlo error (0.003 at 10,000 resamples) and
    # the normal approximation of a mean of 400 normal items.
    from scipy.stats import norm

    differences = rng.normal(size=400)
    differences = (differences - differences.mean()) / differences.std()
    differences += 2 / np.sqrt(len(differences))
    moderate = stats.paired_bootstrap(differences, np.zeros_like(differences))
    assert moderate["p_value"] == pytest.approx(2 * norm.sf(2.0), abs=0.02)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: stats.bootstrap_interval([]), "values is empty"),
        (lambda: stats.bootstrap_interval([[1.0, 2.0]]), "values must be one-dimensional"),
        (lambda: stats.bootstrap_interval([1.0, 2.0], groups=[0]), "groups must name"),
        (lambda: stats.bootstrap_interval([1.0], confidence=0.0), "confidence must be"),
        (lambda: stats.bootstrap_interval([1.0], confidence=1.5), "confidence must be"),
        (lambda: stats.bootstrap_interval([1.0], resamples=0), "resamples must be"),
        (lambda: stats.paired_bootstrap([1.0, 2.0, 3.0], [1.0, 2.0]), "got 3 and 2 scores"),
        (lambda: stats.paired_bootstrap([], []), "first is empty"),
        (lambda: stats.paired_bootstrap([1.0], [1.0], groups=[0, 1]), "groups must name"),
    ],
)
def test_bootstrap_bad_inputs_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


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


@pytest.mark.parametrize("dof", [1, 3, 10, 60])
def test_chi_square_fit_matches_scipy(dof):
    rng = np.random.default_rng(dof)
    probabilities = rng.dirichlet(np.ones(dof + 1))
    observed = rng.multinomial(5000, probabilities)
    from scipy.stats import chisquare

    got = stats.chi_square_fit(observed, probabilities, min_expected=0)
    want = chisquare(observed, probabilities * 5000)
    assert got["dof"] == dof and got["cells"] == dof + 1
    assert got["statistic"] == pytest.approx(want.statistic, rel=1e-12)
    assert got["p_value"] == pytest.approx(want.pvalue, rel=1e-9, abs=1e-300)
    # Far from the distribution: a tiny p-value, as scipy's.
    shifted = stats.chi_square_fit(observed, np.roll(probabilities, 1), min_expected=0)
    want = chisquare(observed, np.roll(probabilities, 1) * 5000)
    assert shifted["p_value"] == pytest.approx(want.pvalue, rel=1e-6, abs=1e-300)


def test_chi_square_fit_pools_rare_cells():
    from scipy.stats import chisquare

    # The cells expected 3 and 4 times pool into one expected 7 times.
    got = stats.chi_square_fit([50, 40, 1, 4, 5], [50, 38, 3, 4, 5])
    want = chisquare([50, 40, 5, 5], [50, 38, 5, 7])
    assert got["cells"] == 4 and got["p_value"] == pytest.approx(want.pvalue, rel=1e-9)
    with pytest.raises(ValueError, match="fewer than two cells"):
        stats.chi_square_fit([3, 1], [3, 1])
