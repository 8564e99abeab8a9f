"""Tests of the TabICL synthetic prior (lhc.tabicl.prior and its SCM/Reg2Cls modules)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import warnings

import numpy as np
import pytest
import threadpoolctl
from scipy import stats

from lhc.tabicl import prior_reg2cls, prior_scm
from lhc.tabicl.prior import (
    CURRICULUM,
    LABEL_PAD,
    SAMPLED_HPARAMS,
    MetaBeta,
    MetaChoice,
    MetaChoiceMixed,
    MetaTruncNormLogScaled,
    PriorConfig,
    SCMHparams,
    TableSpec,
    curriculum_stage,
    generate_table,
    iterate_batches,
    max_features_for_rows,
    meta_sample_hparams,
    sample_batch,
    sample_hparams,
    sample_num_classes,
)

SMALL = PriorConfig(batch_size=16, num_rows=256, max_features=20)

# The tree-SCM (and so the default "mix_scm" prior) needs the optional xgboost.
needs_xgboost = pytest.mark.skipif(
    importlib.util.find_spec("xgboost") is None, reason="xgboost (lhc[prior]) not installed"
)


@pytest.fixture(scope="module")
def mixed_batches():
    """64 mix-SCM tables of 256 rows and at most 20 features."""
    pytest.importorskip("xgboost")
    return [sample_batch(SMALL, 11, step) for step in range(4)]


def _tables(batches):
    for batch in batches:
        for b in range(batch["X"].shape[0]):
            n, d, t = batch["seq_len"][b], batch["num_features"][b], batch["train_size"][b]
            yield batch["X"][b, :n, :d], batch["y"][b, :n], int(t), batch, b


# ----------------------------------------------------------------------------- batches


@needs_xgboost
def test_batch_shapes_dtypes_and_padding():
    config = PriorConfig(batch_size=6, num_rows=96, max_features=12, tables_per_group=2)
    batch = sample_batch(config, 0, 0)
    assert set(batch) == {"X", "y", "train_size", "seq_len", "num_features", "num_classes"}
    assert batch["X"].shape == (6, 96, 12) and batch["X"].dtype == np.float32
    assert batch["y"].shape == (6, 96) and batch["y"].dtype == np.int32
    for key in ("train_size", "seq_len", "num_features", "num_classes"):
        assert batch[key].shape == (6,) and batch[key].dtype == np.int32, key
    assert (batch["seq_len"] == 96).all()
    for b in range(6):
        d = batch["num_features"][b]
        assert 1 <= d <= 12
        np.testing.assert_array_equal(batch["X"][b, :, d:], 0.0)


@needs_xgboost
def test_rows_per_group_pads_rows_and_shares_lengths_in_a_group():
    config = PriorConfig(
        batch_size=6,
        num_rows=128,
        min_rows=32,
        log_rows=True,
        rows_per_group=True,
        tables_per_group=2,
        max_features=8,
        row_multiple=16,
        min_train_fraction=0.5,
    )
    batch = sample_batch(config, 1, 0)
    seq_len, train_size = batch["seq_len"], batch["train_size"]
    assert batch["X"].shape[1] == math.ceil(seq_len.max() / 16) * 16
    assert len(set(seq_len.tolist())) > 1, "groups should draw their own row counts"
    np.testing.assert_array_equal(seq_len[0::2], seq_len[1::2])
    np.testing.assert_array_equal(train_size[0::2], train_size[1::2])
    assert ((32 <= seq_len) & (seq_len < 128)).all()
    assert ((train_size >= 0.5 * seq_len - 1) & (train_size <= 0.9 * seq_len)).all()
    for b in range(6):
        np.testing.assert_array_equal(batch["y"][b, seq_len[b] :], LABEL_PAD)
        np.testing.assert_array_equal(batch["X"][b, seq_len[b] :], 0.0)
        assert (batch["y"][b, : seq_len[b]] >= 0).all()


@needs_xgboost
def test_same_seed_and_step_give_the_same_batch_and_others_differ():
    config = PriorConfig(batch_size=4, num_rows=64, max_features=6)
    first = sample_batch(config, 3, 5)
    again = sample_batch(config, 3, 5)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key], err_msg=key)
    assert not np.array_equal(first["X"], sample_batch(config, 3, 6)["X"])
    assert not np.array_equal(first["X"], sample_batch(config, 4, 5)["X"])
    # A resumed iterator sees the same data; a generator seeded the same way does too.
    resumed = next(iterate_batches(config, 3, start_step=5))
    from_rng = sample_batch(config, np.random.default_rng([3, 5]))
    for key in first:
        np.testing.assert_array_equal(first[key], resumed[key], err_msg=key)
        np.testing.assert_array_equal(first[key], from_rng[key], err_msg=key)


def test_every_table_is_a_valid_classification_table(mixed_batches):
    num_columns = num_unit_std = 0
    for x, y, train_size, batch, b in _tables(mixed_batches):
        assert np.isfinite(x).all()
        assert 0 < train_size < len(y)
        num_classes = batch["num_classes"][b]
        assert 2 <= num_classes <= SMALL.max_classes
        assert y.min() == 0 and y.max() == num_classes - 1
        np.testing.assert_array_equal(np.unique(y[:train_size]), np.arange(num_classes))
        np.testing.assert_array_equal(np.unique(y[train_size:]), np.arange(num_classes))
        assert (x.max(axis=0) > x.min(axis=0)).all(), "constant feature kept"
        # Standardized (ddof=1) after the 4-sigma clip, clipped at +-100. A column whose
        # clipped std fell below 1e-6 keeps a std below 1 (as in the reference).
        assert np.abs(x).max() <= 100.0
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(x64.mean(axis=0), 0.0, atol=1e-5)
        std = x64.std(axis=0, ddof=1)
        assert (std <= 1.0 + 1e-4).all()
        num_columns += len(std)
        num_unit_std += int((np.abs(std - 1.0) < 1e-3).sum())
    assert num_unit_std >= 0.95 * num_columns


def test_features_are_shared_within_subgroups(mixed_batches):
    # Tables in a group of 4 share prior type and feature count before constant columns
    # are dropped, so a group's feature counts are close; across groups they vary.
    counts = np.concatenate([b["num_features"] for b in mixed_batches]).reshape(-1, 4)
    assert (counts.max(axis=1) - counts.min(axis=1) <= np.maximum(2, counts.max(axis=1) // 2)).all()
    assert len(np.unique(counts.max(axis=1))) > 4


def test_class_count_distribution():
    rng = np.random.default_rng(0)
    draws = np.array([sample_num_classes(rng, 10) for _ in range(20_000)])
    frequencies = np.bincount(draws, minlength=11) / len(draws)
    assert frequencies[:2].sum() == 0
    # P(K=2) = 1/2 + 1/2 * 1/9; P(K=k) = 1/18 for k = 3..10 (binomial sd <= 0.0036).
    assert abs(frequencies[2] - (0.5 + 0.5 / 9)) < 0.02
    np.testing.assert_allclose(frequencies[3:], 1 / 18, atol=0.01)


def test_generated_tables_are_mostly_binary(mixed_batches):
    num_classes = np.concatenate([b["num_classes"] for b in mixed_batches])
    # Drawn K=2 in 56% of tables, and some larger K lose empty classes: expect ~0.55-0.65
    # (the reference gives 0.57 on the same settings); 64 tables, sd ~0.06.
    assert 0.35 < np.mean(num_classes == 2) < 0.85
    assert num_classes.max() >= 5


@needs_xgboost
def test_a_linear_classifier_beats_chance():
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score

    # 96 tables with independent hyperparameters, so the mean is over independent draws.
    config = SMALL.replace(batch_size=32, tables_per_group=1)
    batches = [sample_batch(config, 0, step) for step in range(3)]
    rng = np.random.default_rng(0)
    real, control = [], []
    for x, y, train_size, _, _ in _tables(batches):
        chance = 1.0 / (y.max() + 1)  # balanced accuracy of any predictor blind to x
        # The control breaks the row pairing of x and y: no signal left.
        for features, scores in ((x, real), (x[rng.permutation(len(x))], control)):
            # One BLAS thread: tiny fits on a shared 2-core machine otherwise thrash.
            with warnings.catch_warnings(), threadpoolctl.threadpool_limits(limits=1):
                warnings.simplefilter("ignore")
                model = LogisticRegression(max_iter=100).fit(features[:train_size], y[:train_size])
                predictions = model.predict(features[train_size:])
                scores.append(balanced_accuracy_score(y[train_size:], predictions) - chance)
    # Measured over seeds 0-7 (128 tables each): +0.041..+0.064 over chance, control
    # -0.004..+0.003. The reference prior gives the same weak-but-real linear signal.
    assert np.mean(real) > 0.02
    assert abs(np.mean(control)) < 0.015
    assert np.mean(real) > np.mean(control) + 0.02


@needs_xgboost
def test_prior_types_and_tree_only_batches():
    config = PriorConfig(batch_size=4, num_rows=128, max_features=6, prior_type="tree_scm")
    batch = sample_batch(config, 2, 0)
    assert (batch["num_classes"] >= 2).all()
    assert np.isfinite(batch["X"]).all()


def test_mlp_prior_works_without_xgboost(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgboost", None)  # makes `import xgboost` fail
    batch = sample_batch(
        PriorConfig(batch_size=2, num_rows=64, max_features=5, prior_type="mlp_scm"), 0
    )
    assert (batch["num_classes"] >= 2).all()
    with pytest.raises(ImportError, match="xgboost"):
        prior_scm.tree_layer(np.random.default_rng(0), np.zeros((8, 2)), 1, 2, 1)


def test_generate_table_rejects_until_valid():
    spec = TableSpec(
        seq_len=40,
        train_size=20,
        num_features=3,
        num_classes=10,
        prior_type="mlp_scm",
        hparams=SCMHparams(num_layers=3, hidden_dim=8),
        multiclass_type="rank",
    )
    x, y = generate_table(np.random.default_rng(0), spec)
    assert x.shape[0] == 40 and 1 <= x.shape[1] <= 3
    assert set(np.unique(y[:20])) == set(np.unique(y[20:]))
    impossible = dataclasses.replace(spec, train_size=40)
    with pytest.raises(RuntimeError, match="no usable table"):
        generate_table(np.random.default_rng(0), impossible, max_attempts=3)


def test_constant_features_are_dropped(monkeypatch):
    import lhc.tabicl.prior as prior_module

    original = prior_module.regression_to_classification

    def with_constant_columns(rng, x, y, *args, **kwargs):
        x, labels = original(rng, x, y, *args, **kwargs)
        return np.concatenate([np.full((len(x), 1), 2.5), x, np.zeros((len(x), 1))], axis=1), labels

    monkeypatch.setattr(prior_module, "regression_to_classification", with_constant_columns)
    spec = TableSpec(
        seq_len=60,
        train_size=30,
        num_features=3,
        num_classes=2,
        prior_type="mlp_scm",
        hparams=SCMHparams(num_layers=2, hidden_dim=8, sampling="uniform", is_causal=False),
        multiclass_type="rank",
    )
    x, _ = generate_table(np.random.default_rng(0), spec)
    assert x.shape[1] == 3
    assert (x.max(axis=0) > x.min(axis=0)).all()


# ----------------------------------------------------------------------------- config


def test_config_validation():
    with pytest.raises(ValueError, match="prior_type"):
        PriorConfig(prior_type="dummy")
    with pytest.raises(ValueError, match="min_train_fraction"):
        PriorConfig(min_train_fraction=0.9, max_train_fraction=0.5)
    with pytest.raises(ValueError, match="min_rows"):
        PriorConfig(num_rows=100, min_rows=200)
    with pytest.raises(ValueError, match="unknown fields"):
        PriorConfig().replace(seq_len=5)
    with pytest.raises(ValueError, match="config"):
        sample_batch({"batch_size": 2}, 0, 0)
    with pytest.raises(ValueError, match="seed_or_rng"):
        sample_batch(PriorConfig(batch_size=1, num_rows=16), "0", 0)
    assert PriorConfig().replace(batch_size=3).batch_size == 3


def test_curriculum_matches_the_paper():
    stage1, stage2, stage3 = CURRICULUM
    assert curriculum_stage(2) is stage2 and curriculum_stage("stage3") is stage3
    assert (stage1.num_steps, stage1.learning_rate, stage1.schedule) == (
        100_000,
        1e-4,
        "cosine_warmup",
    )
    assert stage1.warmup_fraction == 0.02
    assert (stage1.prior.num_rows, stage1.prior.min_rows, stage1.prior.batch_size) == (
        1024,
        None,
        512,
    )
    assert (stage2.prior.min_rows, stage2.prior.num_rows, stage2.learning_rate) == (
        1000,
        40_000,
        2e-5,
    )
    assert (stage2.prior.min_train_fraction, stage2.prior.max_train_fraction) == (0.5, 0.9)
    assert (stage3.prior.min_rows, stage3.prior.num_rows, stage3.learning_rate) == (
        40_000,
        60_000,
        2e-6,
    )
    assert stage3.frozen == ("col", "row") and stage1.frozen == stage2.frozen == ()
    assert max_features_for_rows(1024, 100) == 100 and max_features_for_rows(45_000, 100) == 30
    with pytest.raises(ValueError, match="stage"):
        curriculum_stage(4)


# ----------------------------------------------------------------------------- hyperparameters


def test_hyperparameter_samples_respect_their_ranges():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(300):
        group = meta_sample_hparams(rng)
        rows.append(sample_hparams(rng, group))
    for row in rows:
        assert row["num_layers"] >= 2 and isinstance(row["num_layers"], int)
        assert row["hidden_dim"] >= 4 and row["num_causes"] >= 1
        assert row["init_std"] >= 0 and row["noise_std"] >= 0
        assert 0 <= row["mlp_dropout_prob"] <= 0.9
        assert row["sampling"] in ("normal", "mixed", "uniform")
        assert row["multiclass_type"] in ("value", "rank")
        probs = np.asarray(row["activation_probs"])
        assert probs.shape == (56,) and abs(probs.sum() - 1) < 1e-9
    # The meta means are log-uniform in [min_mean, max_mean]: the median layer count
    # sits between the extremes, and both extremes occur.
    layers = np.array([row["num_layers"] for row in rows])
    assert layers.min() == 2 and layers.max() >= 8 and 3 <= np.median(layers) <= 6


def test_meta_choice_shares_a_value_within_a_group():
    rng = np.random.default_rng(1)
    group = meta_sample_hparams(rng)
    values = [sample_hparams(rng, group) for _ in range(5)]
    for key in ("is_causal", "sampling", "multiclass_type", "activation_probs"):
        assert len({str(v[key]) for v in values}) == 1, key
    assert len({v["hidden_dim"] for v in values} | {v["init_std"] for v in values}) > 2


# ----------------------------------------------------------------------------- SCM parts


def test_simple_activations_known_values():
    names = list(prior_scm.SIMPLE_ACTIVATIONS)
    assert len(names) == 18 and len(prior_scm.BASE_ACTIVATIONS) == 28
    assert len(prior_scm.ACTIVATION_CHOICES) == 56
    x = np.array([-2.0, -1.0, 0.0, 1.0, 25.0], np.float32)
    act = prior_scm.SIMPLE_ACTIVATIONS
    np.testing.assert_allclose(act["leaky_relu"](x)[:2], [-0.02, -0.01], rtol=1e-6)
    np.testing.assert_allclose(act["selu"](x)[3], 1.0507009873554805, rtol=1e-6)
    np.testing.assert_allclose(
        act["softplus"](x), np.log1p(np.exp(x.astype(np.float64))), rtol=1e-6
    )
    np.testing.assert_array_equal(act["sign"](x), [-1, -1, 1, 1, 1])
    np.testing.assert_array_equal(act["unit_interval_indicator"](x), [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(act["relu6"](x), [0, 0, 0, 1, 6])
    np.testing.assert_array_equal(act["hardtanh"](x), [-1, -1, 0, 1, 1])
    np.testing.assert_allclose(act["elu"](x)[:2], np.expm1([-2.0, -1.0]), rtol=1e-6)
    np.testing.assert_allclose(act["silu"](x), x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6)
    for name in names:
        assert act[name](x).dtype == np.float32, name


def test_random_fourier_function_interpolation_is_accurate():
    rng = np.random.default_rng(0)
    for _ in range(3):
        function = prior_scm.RandomFourierFunction.sample(rng)
        x = rng.standard_normal((600, 40)).astype(np.float32) ** 3  # long tails, wide grid
        z = prior_scm.standardize_columns(x).astype(np.float64).reshape(-1)
        exact = sum(
            w * np.sin(f * z + b)
            for f, b, w in zip(
                *(a.astype(np.float64) for a in (function.freqs, function.phases, function.weights))
            )
        )
        np.testing.assert_allclose(function(x).reshape(-1), exact, atol=1e-4 * np.abs(exact).max())


def test_activation_sampling_distributions():
    rng = np.random.default_rng(0)
    activations = [prior_scm.ScaledActivation.sample(rng, "tanh") for _ in range(3000)]
    log_scales = np.log([a.scale for a in activations])
    shifts = np.array([a.shift for a in activations])
    # log scale ~ N(0, 2^2), shift ~ N(0, 1); sd of the sample sd ~ 2 / sqrt(6000).
    assert abs(log_scales.std() - 2.0) < 0.1 and abs(log_scales.mean()) < 0.15
    assert abs(shifts.std() - 1.0) < 0.05 and abs(shifts.mean()) < 0.08
    # All mass on "random_choice": uniform over the 28 base activations, 10 of which are
    # the random Fourier function.
    probs = np.zeros(len(prior_scm.ACTIVATION_CHOICES))
    probs[-1] = 1.0
    names = [prior_scm.sample_activation(rng, probs).name for _ in range(2800)]
    assert abs(np.mean([n == prior_scm.RANDOM_FUNCTION for n in names]) - 10 / 28) < 0.04
    assert set(names) == set(prior_scm.BASE_ACTIVATIONS)


def test_block_dropout_weights_are_block_diagonal():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(30):
        weight = prior_scm._block_dropout_weight(rng, (40, 30), init_std=2.0)
        # Nonzero exactly on n equal diagonal blocks, n in 1..ceil(sqrt(30)) = 6.
        layouts = {}
        for n in range(1, 7):
            mask = np.zeros((40, 30), bool)
            for b in range(n):
                mask[b * (40 // n) : (b + 1) * (40 // n), b * (30 // n) : (b + 1) * (30 // n)] = (
                    True
                )
            layouts[n] = mask
        matches = [n for n, mask in layouts.items() if np.array_equal(weight != 0, mask)]
        assert len(matches) == 1
        seen.add(matches[0])
    assert seen == set(range(1, 7))


def test_mlp_scm_shapes_and_modes():
    rng = np.random.default_rng(0)
    hp = SCMHparams(num_layers=3, hidden_dim=10, sampling="uniform", is_causal=False)
    x, y = prior_scm.mlp_scm(rng, 50, 4, hp)
    assert x.shape == (50, 4) and y.shape == (50,) and x.dtype == np.float32
    assert ((0 <= x) & (x < 1)).all(), "non-causal X are the uniform causes"
    causal = dataclasses.replace(
        hp, is_causal=True, num_causes=2, in_clique=True, y_is_effect=False
    )
    x, y = prior_scm.mlp_scm(rng, 50, 7, causal)
    assert x.shape == (50, 7) and not ((0 <= x) & (x < 1)).all()


def test_mixed_causes_hold_categorical_columns():
    rng = np.random.default_rng(0)
    found_discrete = False
    for _ in range(20):
        causes = prior_scm.sample_causes(rng, 300, 6, "mixed")
        assert causes.shape == (300, 6) and causes.dtype == np.float32
        found_discrete |= any(len(np.unique(c)) <= 20 for c in causes.T)
    assert found_discrete


@needs_xgboost
def test_tree_layer_is_piecewise_constant():
    rng = np.random.default_rng(0)
    x = np.sort(rng.standard_normal(500)).astype(np.float32)[:, None]
    for depth, trees in ((2, 1), (3, 2), (4, 4)):
        out = prior_scm.tree_layer(rng, x, 3, depth, trees)
        assert out.shape == (500, 3)
        # Along one sorted input, each tree switches leaf at most 2^depth - 1 times.
        changes = np.any(np.diff(out, axis=0) != 0, axis=1).sum()
        assert changes <= trees * (2**depth - 1), (depth, trees, changes)
        assert len(np.unique(out, axis=0)) <= min(500, (2**depth) ** trees)


@needs_xgboost
def test_tree_scm_sizes():
    rng = np.random.default_rng(0)
    sizes = np.array([prior_scm.sample_tree_size(rng) for _ in range(2000)])
    assert sizes[:, 0].min() == 2 and sizes[:, 0].max() == 4
    assert sizes[:, 1].min() == 1 and sizes[:, 1].max() == 4
    # P(depth = 2) = P(Exp(mean 2) < 1) = 1 - exp(-1/2) ~ 0.39.
    assert abs(np.mean(sizes[:, 0] == 2) - (1 - math.exp(-0.5))) < 0.04
    x, y = prior_scm.tree_scm(rng, 120, 5, SCMHparams(noise_std=0.0))
    assert x.shape == (120, 5) and y.shape == (120,)
    assert len(np.unique(y)) < 120


# ----------------------------------------------------------------------------- Reg2Cls


def test_outlier_removing_and_standard_scaling():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 2))
    x[0, 0] = 1e6
    clipped = prior_reg2cls.outlier_removing(x)
    inliers = x[1:, 0]
    assert clipped[0, 0] == pytest.approx(inliers.mean() + 4 * inliers.std(ddof=1), rel=1e-3)
    np.testing.assert_array_equal(clipped[1:], x[1:])
    scaled = prior_reg2cls.standard_scaling(x)
    np.testing.assert_allclose(scaled[:, 1].mean(), 0, atol=1e-12)
    np.testing.assert_allclose(scaled[:, 1].std(ddof=1), 1, rtol=1e-12)
    # A lone 1 among n zeros standardizes to (n - 1) / sqrt(n): > 100 needs n > 10^4.
    spike = np.zeros((20_001, 1))
    spike[0] = 1.0
    assert prior_reg2cls.standard_scaling(spike).max() == 100.0
    expected = 999 / np.sqrt(1000)
    assert prior_reg2cls.standard_scaling(spike[:1000]).max() == pytest.approx(expected, rel=1e-9)


def test_assign_classes_and_permutation():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(500)
    for mode in ("rank", "value"):
        classes = prior_reg2cls.assign_classes(rng, values, 5, mode, ordered_prob=1.0)
        assert classes.min() >= 0 and classes.max() <= 4
        # Unpermuted classes are monotone in the value (possibly reversed).
        order = np.argsort(values)
        steps = np.diff(classes[order])
        assert (steps >= 0).all() or (steps <= 0).all()
    labels = prior_reg2cls.permute_classes(rng, np.array([5, 7, 7, 9, 5]))
    assert sorted(set(labels.tolist())) == [0, 1, 2]
    assert labels[0] == labels[4] and labels[1] == labels[2]
    with pytest.raises(ValueError, match="num_classes"):
        prior_reg2cls.assign_classes(rng, values, 1)


def test_regression_to_classification_binned_columns_take_few_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 8))
    y = x @ rng.standard_normal(8)
    x_out, labels = prior_reg2cls.regression_to_classification(rng, x, y, 4, "rank", cat_prob=1.0)
    assert x_out.shape == (300, 8)
    assert min(len(np.unique(c)) for c in x_out.T) < 300  # some column binned w.h.p.
    assert set(labels.tolist()) <= {0, 1, 2, 3}


# ----------------------------------------------------------------------------- reference parity


@pytest.mark.parity
def test_activations_match_reference():
    torch = pytest.importorskip("torch")
    pytest.importorskip("tabicl")
    from tabicl.prior import activations as ref

    simple = ref.get_activations(random=False, scale=False, diverse=False)
    assert len(simple) == len(prior_scm.SIMPLE_ACTIVATIONS)
    x = np.concatenate([np.linspace(-30, 30, 601), np.random.default_rng(0).standard_normal(400)])
    x = x.astype(np.float32)
    for (name, ours), ref_cls in zip(prior_scm.SIMPLE_ACTIVATIONS.items(), simple):
        expected = ref_cls()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(ours(x), expected, rtol=1e-5, atol=1e-6, err_msg=name)

    full = ref.get_activations(random=True, scale=True, diverse=True)
    assert len(full) == len(prior_scm.ACTIVATION_CHOICES)
    base = [f.act_class for f in full[:28]]
    assert base[:18] == simple and all(c is ref.RandomFunctionActivation for c in base[18:])
    # The "diverse" factories draw from the whole (self-including) list: uniform over base.
    assert all(isinstance(f, ref.RandomChoiceFactory) and f.act_classes is full for f in full[28:])


@pytest.mark.parity
def test_random_and_scaled_activations_match_reference():
    torch = pytest.importorskip("torch")
    pytest.importorskip("tabicl")
    from tabicl.prior import activations as ref

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for shape in ((8, 3), (400, 30)):  # direct and interpolated evaluation
        x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
        reference = ref.RandomFunctionActivation()
        ours = prior_scm.RandomFourierFunction(
            freqs=reference.freqs.numpy(),
            phases=reference.bias.numpy(),
            weights=reference.l2_weights.numpy(),
        )
        expected = reference(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(ours(x), expected, atol=2e-4 * np.abs(expected).max())

        scaled = ref.StdRandomScaleFactory(torch.nn.Tanh)()
        expected = scaled(torch.from_numpy(x)).numpy()
        random_scale = scaled[1]
        ours = prior_scm.ScaledActivation(
            "tanh", scale=float(random_scale.scale), shift=float(random_scale.bias)
        )
        np.testing.assert_allclose(ours(x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parity
def test_hyperparameter_specs_match_reference():
    pytest.importorskip("tabicl")
    from tabicl.prior.prior_config import DEFAULT_FIXED_HP, DEFAULT_SAMPLED_HP

    renamed = {"mlp_activations": "activation_probs"}
    assert {renamed.get(k, k) for k in DEFAULT_SAMPLED_HP} == set(SAMPLED_HPARAMS)
    for ref_name, ref_spec in DEFAULT_SAMPLED_HP.items():
        ours = SAMPLED_HPARAMS[renamed.get(ref_name, ref_name)]
        kind = ref_spec["distribution"]
        if kind == "meta_trunc_norm_log_scaled":
            assert isinstance(ours, MetaTruncNormLogScaled), ref_name
            assert (ours.min_mean, ours.max_mean) == (ref_spec["min_mean"], ref_spec["max_mean"])
            assert (ours.round, ours.lower_bound) == (ref_spec["round"], ref_spec["lower_bound"])
            assert (ours.min_std, ours.max_std) == (0.01, 1.0)
        elif kind == "meta_choice":
            assert type(ours) is MetaChoice, ref_name
            assert list(ours.choices) == list(ref_spec["choice_values"])
            assert (ours.weight_low, ours.weight_high) == (-3.0, 5.0)
        elif kind == "meta_choice_mixed":
            assert isinstance(ours, MetaChoiceMixed) and len(ours.choices) == len(
                ref_spec["choice_values"]
            )
            assert (ours.weight_low, ours.weight_high) == (-5.0, 6.0)
        elif kind == "meta_beta":
            assert isinstance(ours, MetaBeta)
            assert (ours.scale, ours.min, ours.max) == (
                ref_spec["scale"],
                ref_spec["min"],
                ref_spec["max"],
            )
        else:
            raise AssertionError(f"unexpected reference distribution {kind}")

    config = PriorConfig()
    assert tuple(DEFAULT_FIXED_HP["mix_probs"]) == config.mix_probs
    assert DEFAULT_FIXED_HP["cat_prob"] == config.cat_prob
    assert DEFAULT_FIXED_HP["multiclass_ordered_prob"] == 0.0
    assert (
        DEFAULT_FIXED_HP["tree_depth_lambda"] == DEFAULT_FIXED_HP["tree_n_estimators_lambda"] == 0.5
    )
    assert not DEFAULT_FIXED_HP["balanced"] and not DEFAULT_FIXED_HP["scale_by_max_features"]


@pytest.mark.parity
def test_hyperparameter_distributions_match_reference():
    """Two-sample KS tests of our draws against the reference sampler's (groups of one)."""
    pytest.importorskip("tabicl")
    torch = pytest.importorskip("torch")
    from tabicl.prior.hp_sampling import HpSamplerList
    from tabicl.prior.prior_config import DEFAULT_SAMPLED_HP

    names = ("num_causes", "num_layers", "hidden_dim", "init_std", "noise_std", "mlp_dropout_prob")
    specs = {name: DEFAULT_SAMPLED_HP[name] for name in names}
    np.random.seed(0)
    torch.manual_seed(0)
    reference = {name: [] for name in names}
    for _ in range(400):
        group = HpSamplerList(specs, device="cpu").sample()
        for name in names:
            reference[name].append(group[name]())
    rng = np.random.default_rng(0)
    ours = {name: [] for name in names}
    for _ in range(400):
        values = {name: SAMPLED_HPARAMS[name].meta_sample(rng)(rng) for name in names}
        for name in names:
            ours[name].append(values[name])
    for name in names:
        result = stats.ks_2samp(reference[name], ours[name])
        assert result.pvalue > 1e-3, (name, result)


@pytest.mark.parity
def test_reg2cls_statistics_match_reference():
    torch = pytest.importorskip("torch")
    pytest.importorskip("tabicl")
    from tabicl.prior import reg2cls as ref

    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 6)) * rng.uniform(0.1, 10, 6) + rng.uniform(-5, 5, 6)
    x[rng.integers(0, 500, 10), rng.integers(0, 6, 10)] = 1e4
    x[:, 5] = 3.0  # constant column
    x = x.astype(np.float32)
    expected = ref.outlier_removing(torch.from_numpy(x.copy()), threshold=4).numpy()
    np.testing.assert_allclose(prior_reg2cls.outlier_removing(x), expected, rtol=1e-4, atol=1e-4)
    expected = ref.standard_scaling(torch.from_numpy(expected)).numpy()
    ours = prior_reg2cls.standard_scaling(prior_reg2cls.outlier_removing(x))
    np.testing.assert_allclose(ours[:, :5], expected[:, :5], rtol=1e-3, atol=1e-3)


def test_table_subsets_equal_the_full_batch_and_train_sizes_round():
    config = PriorConfig(
        batch_size=6,
        num_rows=64,
        max_features=8,
        max_classes=4,
        train_size_multiple=16,
        prior_type="mlp_scm",
    )
    full = sample_batch(config, 3, 5)
    part = sample_batch(config, 3, 5, tables=[4, 1])
    for key in full:
        np.testing.assert_array_equal(full[key][[4, 1]], part[key])
    assert (full["train_size"] % 16 == 0).all() and (full["train_size"] >= 16).all()
    with pytest.raises(ValueError, match="tables: expected indices in \\[0, 6\\)"):
        sample_batch(config, 3, 5, tables=[6])
    with pytest.raises(ValueError, match="train_size_multiple"):
        PriorConfig(num_rows=64, train_size_multiple=64)
