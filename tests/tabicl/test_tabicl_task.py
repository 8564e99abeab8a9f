"""The TabICL pretraining task: loss, masking, frozen stages, evaluation baselines."""

import jax
import numpy as np
import pytest

from lhc import train
from lhc.tabicl import task as pretrain
from lhc.train import config as config_lib

# One train size (64 * U(0.5, 0.6) rounded down to 32) keeps this to a single compile.
FAST = [
    "num_steps=3",
    "batch_size=4",
    "eval_tables=4",
    "log_every=1",
    "progress_bar=False",
    "tensorboard=False",
    "prior.num_rows=64",
    "prior.max_features=6",
    "prior.prior_type=mlp_scm",
    "prior.min_train_fraction=0.5",
    "prior.max_train_fraction=0.6",
    "prior.train_size_multiple=32",
]


def test_masked_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=(2, 5)).astype(np.int32)
    labels[1, 3:] = -1
    loss, accuracy, count = pretrain.masked_cross_entropy(logits, labels)
    valid = labels >= 0
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, np.maximum(labels, 0)[..., None], -1)[..., 0]
    assert float(loss) == pytest.approx(nll[valid].mean(), rel=1e-5)
    assert float(accuracy) == pytest.approx((logits.argmax(-1) == labels)[valid].mean())
    assert int(count) == valid.sum()


def test_baselines_on_a_separable_table():
    train_x = [-3.0, -2.0, -1.0, -0.5, 1.0, 2.0, 3.0]  # labels 0 0 0 0 1 1 1: majority 0
    test_x = [-2.5, 2.5, -1.5, 1.5, 2.2]  # labels 0 1 0 1 1
    X = np.zeros((1, 12, 2), np.float32)
    X[0, :, 0] = train_x + test_x
    y = (X[0, :, 0] > 0).astype(np.int32)[None]
    batch = {
        "X": X,
        "y": y,
        "train_size": np.array([7]),
        "seq_len": np.array([12]),
        "num_features": np.array([1]),
    }
    assert pretrain.majority_class_accuracy(batch) == pytest.approx(2 / 5)
    batch["num_classes"] = np.array([2])
    # training counts 4 and 3, add-one smoothed: 5/9 and 4/9; test labels 0 1 0 1 1
    want = -(2 * np.log(5 / 9) + 3 * np.log(4 / 9)) / 5
    assert pretrain.class_frequency_loss(batch) == pytest.approx(want)
    assert pretrain.logistic_regression_accuracy(batch) == 1.0


@pytest.mark.slow
def test_short_pretraining_runs_and_freezing_holds(tmp_path):
    config = config_lib.load_config(
        "tabicl_pretrain.py:tiny",
        FAST + ["optimizer.frozen=('col_embedder', 'row_interactor')"],
    )
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["eval/class_frequency_loss"] > 0
    # a softmax over a subset that holds the label gives it more mass, row by row
    assert summary["eval/loss_own_classes"] <= summary["eval/loss"] + 1e-6
    for key in ("eval/accuracy", "eval/logreg_accuracy", "eval/majority_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
    assert np.isfinite(summary["train/loss"])
    _, params, step = train.restore_params(config, str(tmp_path))
    assert step == 3
    initial = train.build_experiment(config).init_state(int(config.seed))["params"]
    for name in ("col_embedder", "row_interactor"):
        jax.tree.map(np.testing.assert_array_equal, initial[name], params[name])
    moved = jax.tree.leaves(
        jax.tree.map(
            lambda a, b: float(np.abs(a - b).max()),
            initial["icl_predictor"],
            params["icl_predictor"],
        )
    )
    assert max(moved) > 0


def test_prior_and_model_mismatch_is_a_clear_error(tmp_path):
    config = config_lib.load_config("tabicl_pretrain.py:tiny", FAST + ["model.max_classes=4"])
    with pytest.raises(ValueError, match="prior.max_classes \\(10\\) exceeds"):
        train.train_and_evaluate(config, str(tmp_path))
