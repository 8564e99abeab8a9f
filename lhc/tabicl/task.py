"""TabICL pretraining on the synthetic prior, as a task of ``lhc train``.

Each step draws a batch of prior tables (``lhc.tabicl.prior``); the network sees the
first ``N`` rows of every table with their labels and predicts the labels of the other
rows; the loss is cross-entropy over all ``max_classes`` logits, as in the reference
pretraining. All tables of a batch share ``N`` (the reference's rule), which the prior
rounds to a multiple of ``train_size_multiple`` so the jitted step compiles only a few
shapes: the batch carries ``y_train: [B, N]`` and ``y_test: [B, T - N]`` so ``N`` is a
shape, not a value.

Evaluation draws held-out prior tables and reports the network's accuracy beside a
logistic regression fitted on each table's training rows.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from lhc.parallel import global_batch
from lhc.tabicl import prior as prior_lib
from lhc.tabicl.config import TabICLConfig
from lhc.tabicl.model import TabICL
from lhc.train.tasks import Task

_EVAL_SEED_OFFSET = 7_919_113  # a data stream disjoint from training


def prior_config_from(config) -> prior_lib.PriorConfig:
    """``PriorConfig`` from ``config.prior`` with ``batch_size = config.batch_size``."""
    fields = dict(config.prior)
    for key, value in fields.items():
        if isinstance(value, list):
            fields[key] = tuple(value)
    try:
        return prior_lib.PriorConfig(batch_size=int(config.batch_size), **fields)
    except TypeError as error:
        raise ValueError(f"config.prior: {error}") from error


def _split(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Prior batch -> model inputs with the shared train size as a shape."""
    train_sizes = np.unique(batch["train_size"])
    if len(train_sizes) != 1:
        raise ValueError(
            f"tables of a pretraining batch must share their train size, got {train_sizes}"
        )
    num_train = int(train_sizes[0])
    num_features = batch["num_features"]
    feature_mask = np.arange(batch["X"].shape[2])[None, :] < num_features[:, None]
    return {
        "X": batch["X"],
        "y_train": batch["y"][:, :num_train],
        "y_test": batch["y"][:, num_train:],  # LABEL_PAD (-1) marks padded rows
        "feature_mask": feature_mask,
        "num_classes": batch["num_classes"],
    }


def masked_cross_entropy(logits, labels):
    """Mean cross-entropy and accuracy over rows with a label >= 0.

    Args:
      logits: float32[B, Q, C].
      labels: int32[B, Q]; negative marks padding.

    Returns:
      ``(loss, accuracy, num_rows)``.
    """
    valid = labels >= 0
    safe = jnp.where(valid, labels, 0)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    count = jnp.maximum(valid.sum(), 1)
    loss = jnp.where(valid, nll, 0.0).sum() / count
    correct = (jnp.argmax(logits, axis=-1) == labels) & valid
    return loss, correct.sum() / count, valid.sum()


class PretrainTask(Task):
    """Pretrains ``lhc.tabicl.TabICL`` on prior tables.

    Config keys used: ``model`` (``TabICLConfig`` fields), ``prior`` (``PriorConfig``
    fields except ``batch_size``), ``batch_size``, ``seed``, ``eval_tables``; the
    optimizer's ``frozen`` list freezes stages (``col_embedder``, ``row_interactor``)
    as in the reference's third curriculum stage.
    """

    def make_model(self):
        try:
            model_config = TabICLConfig.from_dict(self.config.model)
        except ValueError as error:
            raise ValueError(f"config.model: {error}") from error
        self.prior_config = prior_config_from(self.config)
        self._eval_cache = None  # (batch, baselines), built at the first evaluation
        if self.prior_config.max_classes > model_config.max_classes:
            raise ValueError(
                f"config.prior.max_classes ({self.prior_config.max_classes}) exceeds "
                f"config.model.max_classes ({model_config.max_classes})"
            )
        return TabICL(model_config)

    def _make_batch(self, seed, index, rows):
        return _split(prior_lib.sample_batch(self.prior_config, seed, index, tables=rows))

    def batch_spec(self, batch_size):
        prior = self.prior_config
        rows, features = prior.num_rows, prior.max_features
        num_train = rows // 2
        return {
            "X": jax.ShapeDtypeStruct((batch_size, rows, features), jnp.float32),
            "y_train": jax.ShapeDtypeStruct((batch_size, num_train), jnp.int32),
            "y_test": jax.ShapeDtypeStruct((batch_size, rows - num_train), jnp.int32),
            "feature_mask": jax.ShapeDtypeStruct((batch_size, features), jnp.bool_),
            "num_classes": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def init_params(self, rng):
        X = jnp.zeros((1, 3, self.prior_config.max_features), jnp.float32)
        y_train = jnp.zeros((1, 2), jnp.int32)
        return self.model.init(rng, X, y_train)["params"]

    def train_iterator(self, process_index, process_count):
        return self.indexed_iterator(self._make_batch, process_index, process_count)

    def _logits(self, params, batch, rng=None):
        deterministic = rng is None or float(self.model.config.dropout) == 0.0
        return self.model.apply(
            {"params": params},
            batch["X"],
            batch["y_train"],
            feature_mask=batch["feature_mask"],
            deterministic=deterministic,
            rngs=None if deterministic else {"dropout": rng},
        )

    def loss(self, params, batch, rng):
        logits = self._logits(params, batch, rng)
        loss, accuracy, _ = masked_cross_entropy(logits, batch["y_test"])
        return loss, {"accuracy": accuracy}

    def _eval_metrics(self, params, batch):
        """Loss over all classes, and loss and accuracy among each table's own classes.

        Inference (``TabICLClassifier``) keeps only a table's own classes; the own-class
        loss is the one to compare with ``class_frequency_loss``.
        """
        logits = self._logits(params, batch)
        loss, _, _ = masked_cross_entropy(logits, batch["y_test"])
        classes = jnp.arange(logits.shape[-1])
        own = classes[None, None, :] < batch["num_classes"][:, None, None]
        restricted = jnp.where(own, logits, -jnp.inf)
        own_loss, accuracy, _ = masked_cross_entropy(restricted, batch["y_test"])
        return loss, own_loss, accuracy

    def evaluate(self, params):
        """Accuracy on ``config.eval_tables`` held-out prior tables vs logistic regression."""
        batch, baselines = self._eval_data()
        loss, own_loss, accuracy = jax.device_get(self._eval_step(params, batch))
        return {
            "eval/loss": float(loss),
            "eval/loss_own_classes": float(own_loss),
            "eval/accuracy": float(accuracy),
            **baselines,
        }

    def _eval_data(self):
        """The evaluation tables (this process's share, on the mesh) and the baselines on
        all of them; drawn and fitted once, since they do not change during a run."""
        if self._eval_cache is None:
            num_tables = int(self.config.eval_tables)
            process_count = jax.process_count()
            if num_tables % process_count:
                raise ValueError(
                    f"config.eval_tables ({num_tables}) must be divisible by the number of "
                    f"processes ({process_count})"
                )
            eval_prior = dataclasses.replace(self.prior_config, batch_size=num_tables)
            full = prior_lib.sample_batch(eval_prior, int(self.config.seed) + _EVAL_SEED_OFFSET, 0)
            local = num_tables // process_count
            start = jax.process_index() * local
            mine = {key: value[start : start + local] for key, value in full.items()}
            baselines = {
                "eval/logreg_accuracy": logistic_regression_accuracy(full),
                "eval/majority_accuracy": majority_class_accuracy(full),
                "eval/class_frequency_loss": class_frequency_loss(full),
            }
            batch = global_batch(_split(mine), self.mesh, self.rules)
            self._eval_cache = (batch, baselines)
            self._eval_step = jax.jit(self._eval_metrics)
        return self._eval_cache


def majority_class_accuracy(batch: dict[str, np.ndarray]) -> float:
    """Test-row accuracy of predicting each table's most frequent training label."""
    correct = total = 0
    for b in range(batch["X"].shape[0]):
        num_train, seq_len = int(batch["train_size"][b]), int(batch["seq_len"][b])
        majority = np.bincount(batch["y"][b, :num_train]).argmax()
        correct += int((batch["y"][b, num_train:seq_len] == majority).sum())
        total += seq_len - num_train
    return correct / max(total, 1)


def class_frequency_loss(batch: dict[str, np.ndarray]) -> float:
    """Cross-entropy of predicting each table's training-label frequencies for every test row.

    The loss a model reaches by counting labels and ignoring the features; the network's
    ``eval/loss`` below it means it reads the features. Counts are add-one smoothed, so a
    class absent from the training rows costs a finite amount.
    """
    total_nll = total = 0.0
    for b in range(batch["X"].shape[0]):
        num_train, seq_len = int(batch["train_size"][b]), int(batch["seq_len"][b])
        counts = np.bincount(batch["y"][b, :num_train], minlength=int(batch["num_classes"][b]))
        probs = (counts + 1) / (counts.sum() + len(counts))
        test = batch["y"][b, num_train:seq_len]
        total_nll += float(-np.log(probs[test]).sum())
        total += len(test)
    return total_nll / max(total, 1)


def logistic_regression_accuracy(batch: dict[str, np.ndarray]) -> float:
    """Test-row accuracy of a logistic regression fitted on each table's training rows.

    Pools the test rows of all tables (each table weighs by its number of test rows),
    the same averaging as the network's ``eval/accuracy``.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    correct = total = 0
    for b in range(batch["X"].shape[0]):
        num_train, seq_len = int(batch["train_size"][b]), int(batch["seq_len"][b])
        features = int(batch["num_features"][b])
        X = batch["X"][b, :seq_len, :features]
        y = batch["y"][b, :seq_len]
        scaler = StandardScaler().fit(X[:num_train])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence warnings on tiny tables
            model = LogisticRegression(max_iter=1000).fit(
                scaler.transform(X[:num_train]), y[:num_train]
            )
        predictions = model.predict(scaler.transform(X[num_train:]))
        correct += int((predictions == y[num_train:]).sum())
        total += seq_len - num_train
    return correct / max(total, 1)
