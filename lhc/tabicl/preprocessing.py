"""Preprocessing and ensemble construction of the TabICL classifier.

The same algorithm as ``tabicl.sklearn.preprocessing`` (0.1.4), so that an ensemble
built with the same ``random_state`` is the same ensemble, member for member:

1. ``FeatureEncoder``: DataFrames get their categorical/string/boolean columns ordinal
   encoded (missing and unseen categories -> -1) *followed by* their numeric columns,
   mean-imputed; other dtypes are dropped. Arrays are mean-imputed (the reference rejects
   NaN in arrays). Infinite values are an error.
2. Constant training columns are dropped (``constant_feature_mask``).
3. Per normalisation method (``Preprocessor``): standardise with ``std + 1e-6`` and clip
   to +-100, then the method's transform ("none", "power" = Yeo-Johnson, "quantile",
   "quantile_rtdl", "robust"), then a two-pass ``outlier_threshold``-sigma soft clip
   ``max(lo - log1p|x|, x)``, ``min(hi + log1p|x|, x)``.
4. Ensemble members (``ensemble_members``): feature orders (a random Latin square, one row
   per feature; all circular shifts; random permutations; or none), class offsets (a
   shuffled ``range(K)``), their product shuffled, crossed with the normalisation
   methods and truncated to ``n_estimators``. Every random draw comes from Python's
   ``random.Random(random_state)`` in the reference's order.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.compose import ColumnTransformer, make_column_selector
from sklearn.impute import SimpleImputer
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import (
    OrdinalEncoder,
    PowerTransformer,
    QuantileTransformer,
    RobustScaler,
    StandardScaler,
)

NORM_METHODS = ("none", "power", "quantile", "quantile_rtdl", "robust")
FEATURE_SHUFFLE_METHODS = ("none", "shift", "random", "latin")
MAX_FEATURES_FOR_LATIN = 4000
_CATEGORICAL_DTYPES = ["string", "object", "category", "boolean"]


def _is_dataframe(X) -> bool:
    return hasattr(X, "columns") and hasattr(X, "dtypes")


def _float_values(frame) -> np.ndarray:
    return frame.to_numpy(dtype=np.float64, na_value=np.nan)


class FeatureEncoder:
    """Turns a DataFrame or array into a float64 matrix (fit on the training data).

    DataFrame columns come out categorical first (ordinal codes, -1 for missing and
    for categories unseen in fit), then numeric (mean-imputed); columns of other dtypes
    are dropped. Arrays must be numeric; NaN is mean-imputed. Columns without a single
    observed training value are dropped (with sklearn's warning).
    """

    def fit(self, X) -> FeatureEncoder:
        self.is_dataframe_ = _is_dataframe(X)
        if self.is_dataframe_:
            categorical = make_column_selector(dtype_include=_CATEGORICAL_DTYPES)(X)
            numeric = make_column_selector(dtype_include="number")(X)
            self._check_finite(_float_values(X[numeric]), list(numeric))
            self.transformer_ = ColumnTransformer(
                [
                    (
                        "categorical",
                        OrdinalEncoder(
                            dtype=np.int64,
                            handle_unknown="use_encoded_value",
                            unknown_value=-1,
                            encoded_missing_value=-1,
                        ),
                        [X.columns.get_loc(c) for c in categorical],
                    ),
                    ("continuous", SimpleImputer(), [X.columns.get_loc(c) for c in numeric]),
                ]
            )
            self.numeric_columns_ = list(numeric)
        else:
            X = self._as_float_array(X)
            self._check_finite(X, list(range(X.shape[1])))
            self.transformer_ = SimpleImputer()
        self.transformer_.fit(X)
        return self

    def transform(self, X) -> np.ndarray:
        if not self.is_dataframe_:
            X = self._as_float_array(X)
            self._check_finite(X, list(range(X.shape[1])))
        elif _is_dataframe(X):
            present = [c for c in self.numeric_columns_ if c in X.columns]
            self._check_finite(_float_values(X[present]), present)
        # A DataFrame-fitted encoder reads arrays by position (sklearn warns about names).
        return np.asarray(self.transformer_.transform(X), dtype=np.float64)

    @staticmethod
    def _as_float_array(X) -> np.ndarray:
        try:
            X = np.asarray(X, dtype=np.float64)
        except (TypeError, ValueError) as err:  # the same type: a dict cell is a TypeError
            raise type(err)(
                f"X must be numeric (pass a pandas DataFrame for categorical columns): {err}"
            ) from err
        if X.ndim != 2:
            raise ValueError(f"X must be 2-D [n_samples, n_features], got shape {X.shape}")
        return X

    @staticmethod
    def _check_finite(values: np.ndarray, names: list) -> None:
        infinite = np.isinf(values).any(axis=0) if values.size else np.zeros(0, bool)
        if infinite.any():
            bad = [names[i] for i in np.flatnonzero(infinite)][:5]
            raise ValueError(
                f"X contains infinity in column(s) {bad}; replace it (e.g. with NaN, which "
                "is mean-imputed) before calling TabICLClassifier"
            )


def constant_feature_mask(X: np.ndarray) -> np.ndarray:
    """Columns with more than one distinct training value (all columns if <= 1 row)."""
    if X.shape[0] <= 1:
        return np.ones(X.shape[1], bool)
    return np.array([len(np.unique(X[:, j])) > 1 for j in range(X.shape[1])], dtype=bool)


class _RTDLQuantileTransformer(TransformerMixin, BaseEstimator):
    """Quantile transform with per-feature jitter in fit (the RTDL group's recipe)."""

    def __init__(self, random_state=None, noise: float = 1e-3, n_quantiles: int = 1000):
        self.random_state = random_state
        self.noise = noise
        self.n_quantiles = n_quantiles

    def fit(self, X, y=None):
        n_quantiles = max(min(X.shape[0] // 30, self.n_quantiles), 10)
        self.normalizer_ = QuantileTransformer(
            output_distribution="normal",
            n_quantiles=n_quantiles,
            subsample=1_000_000_000,
            random_state=self.random_state,
        )
        stds = np.std(X, axis=0, keepdims=True)
        noise_std = self.noise / np.maximum(stds, self.noise)
        rng = np.random.default_rng(self.random_state)
        self.normalizer_.fit(X + noise_std * rng.standard_normal(X.shape))
        return self

    def transform(self, X):
        return self.normalizer_.transform(X)


def _make_normalizer(method: str, random_state):
    if method == "power":
        return PowerTransformer(method="yeo-johnson", standardize=True)
    if method == "quantile":
        return QuantileTransformer(output_distribution="normal", random_state=random_state)
    if method == "quantile_rtdl":
        return Pipeline(
            [("quantile_rtdl", _RTDLQuantileTransformer(random_state)), ("std", StandardScaler())]
        )
    if method == "robust":
        return RobustScaler(unit_variance=True)
    raise ValueError(f"unknown normalisation method {method!r}; expected one of {NORM_METHODS}")


class Preprocessor:
    """Standardise (clip +-100) -> normalise -> soft-clip outliers, fit on training rows.

    Attributes (after ``fit``):
        X_train_: the transformed training matrix (the reference reuses the fit pass).
    """

    def __init__(self, method: str = "power", outlier_threshold: float = 4.0, random_state=None):
        if method not in NORM_METHODS:
            raise ValueError(
                f"unknown normalisation method {method!r}; expected one of {NORM_METHODS}"
            )
        self.method = method
        self.outlier_threshold = outlier_threshold
        self.random_state = random_state

    def fit(self, X: np.ndarray) -> Preprocessor:
        X = np.asarray(X, dtype=np.float64)
        self.mean_ = np.mean(X, axis=0)
        self.scale_ = np.std(X, axis=0) + 1e-6
        scaled = self._standardize(X)
        if self.method == "none":
            self.normalizer_ = None
            normalized = scaled
        else:
            self.normalizer_ = _make_normalizer(self.method, self.random_state)
            self.scaled_min_ = np.min(scaled, axis=0, keepdims=True)
            self.scaled_max_ = np.max(scaled, axis=0, keepdims=True)
            normalized = self.normalizer_.fit_transform(scaled)
        self._fit_outlier_bounds(normalized)
        self.X_train_ = self._clip_outliers(normalized)
        return self

    def transform(self, X: np.ndarray) -> np.ndarray:
        scaled = self._standardize(np.asarray(X, dtype=np.float64))
        if self.normalizer_ is not None:
            try:
                scaled = self.normalizer_.transform(scaled)
            except ValueError:
                # Rare: a test value far outside the training range; clip to it and retry.
                scaled = self.normalizer_.transform(
                    np.clip(scaled, self.scaled_min_, self.scaled_max_)
                )
        return self._clip_outliers(scaled)

    def _standardize(self, X: np.ndarray) -> np.ndarray:
        return np.clip((X - self.mean_) / self.scale_, -100, 100)

    def _fit_outlier_bounds(self, X: np.ndarray) -> None:
        ddof = 1 if X.shape[0] > 1 else 0
        threshold = self.outlier_threshold
        mean = np.nanmean(X, axis=0)
        std = np.maximum(np.nanstd(X, axis=0, ddof=ddof), 1e-6)
        # Second pass without the first pass's outliers for robust bounds.
        outliers = (X < mean - threshold * std) | (X > mean + threshold * std)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cleaned = np.where(outliers, np.nan, X)
            mean = np.nanmean(cleaned, axis=0)
            std = np.maximum(np.nanstd(cleaned, axis=0, ddof=ddof), 1e-6)
        self.lower_ = mean - threshold * std
        self.upper_ = mean + threshold * std

    def _clip_outliers(self, X: np.ndarray) -> np.ndarray:
        X = np.maximum(-np.log1p(np.abs(X)) + self.lower_, X)
        return np.minimum(np.log1p(np.abs(X)) + self.upper_, X)


def latin_square_orders(num_features: int, rng: random.Random) -> list[list[int]]:
    """Rows of a random Latin square over ``range(num_features)``.

    The reference's construction (recursive insertion of a randomly chosen symbol along
    the diagonal, then shuffled rows and shuffled columns), drawing from ``rng`` in the
    same order, written as a loop.
    """
    remaining = list(range(num_features))
    chosen = []
    while len(remaining) > 1:
        symbol = rng.choice(remaining)
        remaining.remove(symbol)
        chosen.append(symbol)
    square = [remaining]
    for symbol in reversed(chosen):
        size = len(square) + 1
        square.append(square[0].copy())
        for i in range(size):
            square[i].insert(i, symbol)
    square = [row.copy() for row in square]
    rng.shuffle(square)
    columns = list(zip(*square))
    rng.shuffle(columns)
    return [list(column) for column in columns]


def feature_orders(
    num_features: int, method: str, n_estimators: int, random_state
) -> list[list[int]]:
    """Candidate feature orders of the ensemble (``FeatureShuffler.shuffle``)."""
    if method not in FEATURE_SHUFFLE_METHODS:
        raise ValueError(
            f"unknown feat_shuffle_method {method!r}; expected one of {FEATURE_SHUFFLE_METHODS}"
        )
    rng = random.Random(random_state)
    indices = list(range(num_features))
    if method == "latin" and num_features > MAX_FEATURES_FOR_LATIN:
        method = "random"
    if method == "none" or n_estimators == 1:
        return [indices]
    if method == "shift":
        return [indices[-i:] + indices[:-i] for i in range(num_features)]
    if method == "random":
        if num_features <= 5:
            every = [list(order) for order in itertools.permutations(indices)]
            return rng.sample(every, min(n_estimators, len(every)))
        return [rng.sample(indices, num_features) for _ in range(n_estimators)]
    return latin_square_orders(num_features, rng)


@dataclass(frozen=True)
class EnsembleMember:
    """One view of the data: its normalisation, feature order and class offset."""

    norm_method: str
    feature_order: tuple[int, ...]
    class_offset: int


def ensemble_members(
    *,
    num_features: int,
    num_classes: int,
    n_estimators: int,
    norm_methods: list[str],
    feat_shuffle_method: str,
    class_shift: bool,
    random_state,
) -> list[EnsembleMember]:
    """The ensemble members, grouped by normalisation method (first-use order).

    The reference groups by ``list(set(...))``, whose order varies between Python
    processes; the order only changes the summation order of the averaged logits.
    """
    orders = feature_orders(num_features, feat_shuffle_method, n_estimators, random_state)
    rng = random.Random(random_state)
    if class_shift and n_estimators > 1:
        offsets = rng.sample(range(num_classes), num_classes)
    else:
        offsets = [0]
    order_offset = list(itertools.product(orders, offsets))
    rng.shuffle(order_offset)
    chosen = list(itertools.product(order_offset, norm_methods))[:n_estimators]
    methods = list(OrderedDict.fromkeys(method for _, method in chosen))
    return [
        EnsembleMember(method, tuple(order), int(offset))
        for group in methods
        for (order, offset), method in chosen
        if method == group
    ]
