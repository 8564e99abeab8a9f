"""``TabICLClassifier``: scikit-learn interface to TabICL, a drop-in for ``tabicl`` 0.1.4."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.preprocessing import LabelEncoder
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, column_or_1d

from lhc.tabicl.checkpoint import load_model
from lhc.tabicl.inference import DEFAULT_MEMORY_BUDGET_MB, predict_logits
from lhc.tabicl.model import TabICL
from lhc.tabicl.preprocessing import (
    FEATURE_SHUFFLE_METHODS,
    NORM_METHODS,
    FeatureEncoder,
    Preprocessor,
    constant_feature_mask,
    ensemble_members,
)

try:  # scikit-learn >= 1.6
    from sklearn.utils.validation import validate_data as _validate_data
except ImportError:  # pragma: no cover - older scikit-learn

    def _validate_data(estimator, X, y="no_validation", reset=True, **kwargs):
        estimator._check_feature_names(X, reset=reset)
        estimator._check_n_features(X, reset=reset)
        return X if isinstance(y, str) else (X, y)


HF_REPO = "jingang/TabICL-clf"
CHECKPOINT_VERSIONS = (
    "tabicl-classifier-v1.1-0506.ckpt",
    "tabicl-classifier-v1-0208.ckpt",
    "tabicl-classifier.ckpt",
)
PRETRAINING_MAX_FEATURES = 100


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int):
    del mtime_ns, size  # part of the cache key: a rewritten file is read again
    config, params = load_model(path)
    return config, jax.tree.map(jnp.asarray, params)


def _load(path: Path):
    stat = path.stat()
    return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


class TabICLClassifier(ClassifierMixin, BaseEstimator):
    """Tabular in-context learning classifier (TabICL, ICML 2025) on JAX.

    ``fit`` only stores the preprocessed training data and loads the network; all model
    compute happens in ``predict_proba``, where an ensemble of views of the data (feature
    orders x class offsets x normalisations) runs through TabICL and the members'
    logits are averaged. Preprocessing, ensembling and aggregation are those of
    ``tabicl.TabICLClassifier`` 0.1.4, so with the same ``random_state`` both build the
    same ensemble.

    Args:
        n_estimators: ensemble members (fewer when the data allow fewer distinct views).
        norm_methods: one of or a list of "none", "power", "quantile", "quantile_rtdl",
            "robust"; None means ["none", "power"].
        feat_shuffle_method: "latin" (default), "random", "shift" or "none".
        class_shift: cyclic class offsets across members.
        outlier_threshold: z-score of the soft outlier clipping.
        softmax_temperature: temperature of the final softmax.
        average_logits: average logits (True) or probabilities (False) of members.
        use_hierarchical: allow more classes than the model's ``max_classes`` through
            the class hierarchy; otherwise that is a ValueError.
        use_amp: bfloat16 compute on GPU/TPU (as the reference's autocast on CUDA);
            float32 on CPU either way.
        batch_size: ensemble members per network call (None: all at once).
        model_path: an official ``.ckpt`` file or an Orbax directory written by
            ``lhc.tabicl.convert_to_orbax`` (which needs no torch at predict time); it
            must exist (the official package downloads to a missing one). None looks up
            ``checkpoint_version`` in the Hugging Face cache.
        allow_auto_download: download ``checkpoint_version`` from the Hugging Face Hub
            (``jingang/TabICL-clf``) when it is not found (needs ``huggingface_hub``).
        checkpoint_version: file name of the official checkpoint to look up.
        random_state: seed of the ensemble (Python ``random.Random``, as the reference).
        verbose: print what happens.
        mesh: a ``jax.sharding.Mesh``; ensemble members of a call are sharded over its
            batch axes (``data``, ``fsdp``) and parameters replicated.
        memory_budget_mb: bound on the per-chunk working sets of inference (rows,
            columns and query rows are processed in chunks that fit it; chunks also stay
            near a CPU cache's size, ``lhc.tabicl.inference.CACHE_BUDGET_MB``) and the
            size of the rows one network call takes.

    The reference's ``device``, ``n_jobs`` and ``inference_config`` do not apply: JAX
    places work by ``mesh`` (default device otherwise) and chunking replaces the
    reference's GPU memory manager.

    Ensembles: with the same ``random_state`` the members (feature orders, class
    offsets, normalisations) are the reference's, and ``predict_proba`` equals the
    reference's run with ``batch_size=1``. With several members per batch the reference
    computes column embeddings once per batch and re-orders them for the other members
    with the inverse of the intended relative order (``ColEmbedding.map_feature_shuffle``),
    so its results depend on ``batch_size``; lhc's do not.

    Input handling (differences from the reference are marked *):

    - pandas DataFrames: categorical/string/boolean columns are ordinal-encoded (missing
      and categories unseen in ``fit`` -> -1) and put first, numeric columns are
      mean-imputed; other dtypes are dropped. Column names and count must match ``fit``
      (ValueError otherwise); an array passed after a DataFrame fit is read by position
      with sklearn's warning.
    - NaN in a numeric array is mean-imputed with the training means (*the reference
      raises a ValueError). A column without any observed training value is dropped.
    - inf anywhere: ValueError naming the column (the reference's message names none).
    - Constant training columns are dropped; if all columns are constant, ``fit`` raises
      a ValueError (*the reference crashes with an IndexError).
    - A single class: ``predict_proba`` returns probability 1 (as the reference, which
      runs the network for it; *lhc skips the network).
    - More than ``max_classes`` classes with ``use_hierarchical=False``: ValueError.
    - More than 100 (non-constant) features: a warning, since the checkpoints were
      pretrained with at most 100 (the reference says nothing); the computation is
      exact for any count.
    - A test matrix with another number of columns than in ``fit``: ValueError; 1-D
      input, 0 rows, non-numeric arrays or continuous targets: ValueError.
    """

    def __init__(
        self,
        n_estimators: int = 32,
        norm_methods: str | list[str] | None = None,
        feat_shuffle_method: str = "latin",
        class_shift: bool = True,
        outlier_threshold: float = 4.0,
        softmax_temperature: float = 0.9,
        average_logits: bool = True,
        use_hierarchical: bool = True,
        use_amp: bool = True,
        batch_size: int | None = 8,
        model_path: str | os.PathLike | None = None,
        allow_auto_download: bool = True,
        checkpoint_version: str = "tabicl-classifier-v1.1-0506.ckpt",
        random_state: int | None = 42,
        verbose: bool = False,
        mesh=None,
        memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    ):
        self.n_estimators = n_estimators
        self.norm_methods = norm_methods
        self.feat_shuffle_method = feat_shuffle_method
        self.class_shift = class_shift
        self.outlier_threshold = outlier_threshold
        self.softmax_temperature = softmax_temperature
        self.average_logits = average_logits
        self.use_hierarchical = use_hierarchical
        self.use_amp = use_amp
        self.batch_size = batch_size
        self.model_path = model_path
        self.allow_auto_download = allow_auto_download
        self.checkpoint_version = checkpoint_version
        self.random_state = random_state
        self.verbose = verbose
        self.mesh = mesh
        self.memory_budget_mb = memory_budget_mb

    # ------------------------------------------------------------------ fit

    def fit(self, X, y):
        """Loads the network and prepares the ensemble views of the training data.

        Args:
            X: ``[n_samples, n_features]`` array-like or DataFrame.
            y: ``[n_samples]`` class labels.

        Returns:
            self.
        """
        if y is None:
            raise ValueError(
                f"{type(self).__name__} requires y to be passed, but the target y is None"
            )
        X = _as_table(X)
        X, y = _validate_data(self, X, y, skip_check_array=True)
        y = column_or_1d(y, warn=True)
        check_classification_targets(y)
        if len(y) != _num_rows(X):
            raise ValueError(f"X has {_num_rows(X)} rows but y has {len(y)} labels")
        norm_methods = self._check_params()

        self.model_config_, self.params_ = _load(self._resolve_model_path())
        self.y_encoder_ = LabelEncoder()
        y_encoded = self.y_encoder_.fit_transform(y)
        self.classes_ = self.y_encoder_.classes_
        self.n_classes_ = len(self.classes_)
        if self.n_classes_ > self.model_config_.max_classes and not self.use_hierarchical:
            raise ValueError(
                f"The number of classes ({self.n_classes_}) exceeds the max number of classes "
                f"({self.model_config_.max_classes}) natively supported by the model; set "
                "use_hierarchical=True"
            )

        self.X_encoder_ = FeatureEncoder().fit(X)
        X_numeric = self.X_encoder_.transform(X)
        if X_numeric.shape[0] < 1:
            raise ValueError("fit needs at least one training row")
        self.feature_mask_ = constant_feature_mask(X_numeric)
        num_features = int(self.feature_mask_.sum())
        if num_features == 0:
            raise ValueError(
                f"all {X_numeric.shape[1]} feature(s) are constant (or empty) in the training "
                "data; TabICL needs at least one varying feature"
            )
        if num_features > PRETRAINING_MAX_FEATURES:
            warnings.warn(
                f"{num_features} features: the TabICL checkpoints were pretrained with at most "
                f"{PRETRAINING_MAX_FEATURES}; predictions may degrade",
                UserWarning,
                stacklevel=2,
            )
        X_kept = X_numeric[:, self.feature_mask_]
        self.y_train_ = y_encoded.astype(np.int64)
        self.members_ = ensemble_members(
            num_features=num_features,
            num_classes=self.n_classes_,
            n_estimators=self.n_estimators,
            norm_methods=norm_methods,
            feat_shuffle_method=self.feat_shuffle_method,
            class_shift=self.class_shift,
            random_state=self.random_state,
        )
        self.preprocessors_ = {}
        for member in self.members_:
            if member.norm_method not in self.preprocessors_:
                self.preprocessors_[member.norm_method] = Preprocessor(
                    member.norm_method, self.outlier_threshold, self.random_state
                ).fit(X_kept)
        if self.verbose:
            print(
                f"TabICLClassifier: {len(self.members_)} members, {num_features} features, "
                f"{self.n_classes_} classes, {len(self.y_train_)} training rows"
            )
        return self

    def _check_params(self) -> list[str]:
        if (
            isinstance(self.n_estimators, bool)
            or not isinstance(self.n_estimators, (int, np.integer))
            or self.n_estimators < 1
        ):
            raise ValueError(f"n_estimators must be a positive int, got {self.n_estimators!r}")
        methods = self.norm_methods or ["none", "power"]
        methods = [methods] if isinstance(methods, str) else list(methods)
        for method in methods:
            if method not in NORM_METHODS:
                raise ValueError(f"unknown norm_methods entry {method!r}; expected {NORM_METHODS}")
        if self.feat_shuffle_method not in FEATURE_SHUFFLE_METHODS:
            raise ValueError(
                f"unknown feat_shuffle_method {self.feat_shuffle_method!r}; expected "
                f"{FEATURE_SHUFFLE_METHODS}"
            )
        if not self.softmax_temperature > 0:
            raise ValueError(f"softmax_temperature must be > 0, got {self.softmax_temperature}")
        if not self.outlier_threshold > 0:
            raise ValueError(f"outlier_threshold must be > 0, got {self.outlier_threshold}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool)
            or int(self.batch_size) != self.batch_size
            or self.batch_size < 1
        ):
            raise ValueError(f"batch_size must be None or a positive int, got {self.batch_size!r}")
        if not self.memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb must be > 0, got {self.memory_budget_mb}")
        return methods

    def _resolve_model_path(self) -> Path:
        if self.model_path is not None:
            if Path(self.model_path).exists():
                return Path(self.model_path)
            raise FileNotFoundError(
                f"model_path {str(self.model_path)!r}: no such file or directory; expected an "
                f"official .ckpt file or an Orbax directory (lhc.tabicl.convert_to_orbax), or "
                f"model_path=None for {self.checkpoint_version!r} from the Hugging Face cache"
            )
        if self.checkpoint_version not in CHECKPOINT_VERSIONS:
            raise ValueError(
                f"invalid checkpoint_version {self.checkpoint_version!r}; expected one of "
                f"{CHECKPOINT_VERSIONS}"
            )
        try:
            from huggingface_hub import hf_hub_download
        except ImportError as err:
            raise FileNotFoundError(
                f"checkpoint {self.checkpoint_version!r} is not in the Hugging Face cache; pass "
                "model_path= (a .ckpt file or an Orbax directory) or install huggingface_hub"
            ) from err
        try:
            return Path(
                hf_hub_download(
                    HF_REPO,
                    self.checkpoint_version,
                    local_files_only=not self.allow_auto_download,
                )
            )
        except Exception as err:
            raise FileNotFoundError(
                f"checkpoint {self.checkpoint_version!r} not available in the Hugging Face cache "
                f"(allow_auto_download={self.allow_auto_download}): {type(err).__name__}; pass "
                f"model_path= (a .ckpt file or an Orbax directory)"
            ) from err

    # ------------------------------------------------------------------ predict

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``[n_samples, n_classes]`` (columns in ``classes_`` order)."""
        check_is_fitted(self, "members_")
        X = _as_table(X)
        X = _validate_data(self, X, reset=False, skip_check_array=True)
        X_test = self.X_encoder_.transform(X)[:, self.feature_mask_]
        if X_test.shape[0] < 1:
            raise ValueError("predict needs at least one row")
        if self.n_classes_ == 1:
            return np.ones((X_test.shape[0], 1), np.float32)

        config, params = self.model_config_, self.params_
        on_cpu = jax.default_backend() == "cpu"
        model = TabICL(config, dtype=jnp.bfloat16 if self.use_amp and not on_cpu else jnp.float32)
        num_classes = self.n_classes_
        total = None
        for method, preprocessor in self.preprocessors_.items():
            members = [m for m in self.members_ if m.norm_method == method]
            table = np.concatenate([preprocessor.X_train_, preprocessor.transform(X_test)])
            offsets = np.array([m.class_offset for m in members])
            y_members = (self.y_train_[None, :] + offsets[:, None]) % num_classes
            outputs = predict_logits(
                model,
                params,
                table.astype(np.float32),
                y_members,
                feature_permutations=np.array([m.feature_order for m in members]),
                return_logits=self.average_logits,
                softmax_temperature=self.softmax_temperature,
                batch_size=self.batch_size,
                memory_budget_mb=self.memory_budget_mb,
                mesh=self.mesh,
                verbose=self.verbose,
            )
            for offset, out in zip(offsets, outputs):
                # Member outputs are in shifted class order: class c sits at (c + offset) % K.
                out = np.concatenate([out[..., offset:], out[..., :offset]], axis=-1)
                total = out if total is None else total + out
        average = total / np.float32(len(self.members_))
        if self.average_logits:
            average = average / np.float32(self.softmax_temperature)
            average = np.exp(average - average.max(axis=-1, keepdims=True))
            average = average / average.sum(axis=-1, keepdims=True)
        return average / average.sum(axis=1, keepdims=True)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True  # NaN cells are imputed with the training means
        return tags

    def predict(self, X) -> np.ndarray:
        """Most probable class of each row, in the label space of ``y``."""
        proba = self.predict_proba(X)
        return self.y_encoder_.inverse_transform(np.argmax(proba, axis=1))


def _as_table(X):
    """A DataFrame as it is, any other array-like as a NumPy array; sparse and 1-D input
    are refused."""
    if scipy.sparse.issparse(X):
        raise TypeError(
            "TabICLClassifier: sparse input is not supported (TabICL reads every cell); "
            "pass a dense array, e.g. X.toarray()"
        )
    if not hasattr(X, "columns"):  # not a DataFrame: lists, array-likes, object arrays
        X = np.asarray(X)
    if isinstance(X, np.ndarray) and X.ndim == 1:
        raise ValueError("The provided input X is one-dimensional. Reshape your data.")
    return X


def _num_rows(X) -> int:
    return X.shape[0] if hasattr(X, "shape") else len(X)
