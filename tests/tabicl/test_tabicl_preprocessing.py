"""lhc's preprocessing and ensemble construction against ``tabicl.sklearn.preprocessing``."""

from __future__ import annotations

import numpy as np
import pytest

from lhc.tabicl.preprocessing import (
    FeatureEncoder,
    Preprocessor,
    constant_feature_mask,
    ensemble_members,
    feature_orders,
)

reference = pytest.importorskip("tabicl.sklearn.preprocessing")

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("method", ["latin", "random", "shift", "none"])
@pytest.mark.parametrize("num_features", [1, 2, 4, 5, 13, 40])
@pytest.mark.parametrize("seed", [0, 42])
def test_feature_orders_match(method, num_features, seed):
    for n_estimators in (1, 7):
        want = reference.FeatureShuffler(num_features, method, random_state=seed).shuffle(
            n_estimators
        )
        got = feature_orders(num_features, method, n_estimators, seed)
        assert [list(order) for order in got] == [list(order) for order in want]


def test_latin_squares_are_latin():
    orders = np.array(feature_orders(9, "latin", 32, 3))
    assert orders.shape == (9, 9)
    for line in (*orders, *orders.T):
        assert sorted(line) == list(range(9))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_estimators=32),
        dict(n_estimators=7, norm_methods=["power", "none", "robust"], class_shift=False),
        dict(n_estimators=40, feat_shuffle_method="shift"),
        dict(n_estimators=3, feat_shuffle_method="random", random_state=None),
    ],
)
def test_ensemble_members_match(kwargs):
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(50, 6)), rng.integers(0, 4, 50)
    kwargs = {"norm_methods": ["none", "power"], "random_state": 42, **kwargs}
    if kwargs["random_state"] is None:
        kwargs["random_state"] = 123  # None seeds from the OS: fix it for both
    generator = reference.EnsembleGenerator(**kwargs).fit(X, y)
    members = ensemble_members(
        num_features=6,
        num_classes=4,
        n_estimators=kwargs["n_estimators"],
        norm_methods=kwargs["norm_methods"],
        feat_shuffle_method=kwargs.get("feat_shuffle_method", "latin"),
        class_shift=kwargs.get("class_shift", True),
        random_state=kwargs["random_state"],
    )
    for method, configs in generator.ensemble_configs_.items():
        mine = [(list(m.feature_order), m.class_offset) for m in members if m.norm_method == method]
        assert mine == [(list(order), offset) for order, offset in configs]
    assert len(members) == sum(len(c) for c in generator.ensemble_configs_.values())


@pytest.mark.parametrize("method", ["none", "power", "quantile", "quantile_rtdl", "robust"])
def test_preprocessing_pipelines_match(method):
    rng = np.random.default_rng(1)
    X = np.concatenate(
        [
            rng.normal(size=(300, 2)),
            rng.lognormal(size=(300, 2)) * 50,
            rng.integers(0, 3, (300, 1)),
        ],
        axis=1,
    )
    X[5, 0] = 1e4  # an outlier
    X_train, X_test = X[:200], X[200:].copy()
    X_test[0, 1] = -1e6  # far outside the training range
    want = reference.PreprocessingPipeline(method, 4.0, random_state=42).fit(X_train)
    got = Preprocessor(method, 4.0, random_state=42).fit(X_train)
    np.testing.assert_allclose(got.X_train_, want.X_transformed_, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        got.transform(X_test), want.transform(X_test), rtol=1e-10, atol=1e-12
    )


def test_feature_encoding_of_dataframes_matches():
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(2)
    n = 40
    frame = pd.DataFrame(
        {
            "x": rng.normal(size=n),
            "city": pd.Categorical(rng.choice(["a", "b", None], size=n)),
            "k": rng.integers(0, 5, n),
            "name": rng.choice(["p", "q"], size=n).astype(object),
            "ok": rng.choice([True, False], size=n),
            "when": pd.date_range("2020-01-01", periods=n),
        }
    )
    frame.loc[[1, 7], "x"] = np.nan
    test = frame.copy()
    test.loc[0, "name"] = "unseen"
    want = reference.TransformToNumerical().fit(frame)
    got = FeatureEncoder().fit(frame)
    np.testing.assert_array_equal(got.transform(frame), want.transform(frame))
    np.testing.assert_array_equal(got.transform(test), want.transform(test))


def test_constant_feature_mask_matches():
    X = np.array([[1, 2, 3, 4], [1, 5, 3, 4], [1, 2, 3, 5]], float)
    want = reference.UniqueFeatureFilter().fit(X).features_to_keep_
    np.testing.assert_array_equal(constant_feature_mask(X), want)
    np.testing.assert_array_equal(constant_feature_mask(X[:1]), [True] * 4)
