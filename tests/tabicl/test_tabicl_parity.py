"""lhc's TabICL against the reference implementation ``tabicl==0.1.4`` (float32, CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.tabicl import (
    TabICL,
    TabICLClassifier,
    TabICLConfig,
    chunked,
    inference,
    params_to_state_dict,
    predict_logits,
    state_dict_to_params,
)

torch = pytest.importorskip("torch")
tabicl = pytest.importorskip("tabicl")

pytestmark = pytest.mark.parity

ATOL = 1e-4


def _reference_eval(model, X, y, **kwargs):
    with torch.no_grad():
        out = model(torch.from_numpy(X), torch.from_numpy(y.astype(np.float32)), **kwargs)
    return out.numpy()


def _convert(reference, config: dict):
    config = TabICLConfig(**config)
    return TabICL(config), state_dict_to_params(config, reference.state_dict())


@pytest.mark.parametrize("classes", [3, 10])
def test_eval_logits_and_probabilities_match(small_reference, small_lhc, classes, tabicl_helpers):
    rng = np.random.default_rng(classes)
    X = tabicl_helpers.random_table(rng, 2, 90, 7)
    y = tabicl_helpers.random_labels(rng, 2, 64, classes)
    model, params = small_lhc
    np.testing.assert_allclose(
        predict_logits(model, params, X, y), _reference_eval(small_reference, X, y), atol=ATOL
    )
    probs = predict_logits(model, params, X, y, return_logits=False, softmax_temperature=0.7)
    want = _reference_eval(small_reference, X, y, return_logits=False, softmax_temperature=0.7)
    np.testing.assert_allclose(probs, want, atol=ATOL)


def test_chunked_inference_with_a_tiny_budget_matches(small_reference, small_lhc, tabicl_helpers):
    """Columns, rows, ICL queries and test rows all split into many chunks."""
    rng = np.random.default_rng(5)
    X = tabicl_helpers.random_table(rng, 1, 40 + 300, 6)
    y = tabicl_helpers.random_labels(rng, 1, 40, 4)
    model, params = small_lhc
    plan = inference.plan_chunks(
        model.config,
        num_tables=1,
        num_features=6,
        num_train=40,
        num_members=1,
        memory_budget_mb=1e-3,
    )
    assert (plan.col_chunk, plan.row_chunk, plan.query_chunk, plan.test_chunk) == (1, 1, 1, 256)
    got = predict_logits(model, params, X, y, memory_budget_mb=1e-3)
    np.testing.assert_allclose(got, _reference_eval(small_reference, X, y), atol=ATOL)


def test_hierarchical_classification_matches(small_reference, small_lhc, tabicl_helpers):
    """23 classes with max_classes=10: a root over 3 groups, then leaves."""
    rng = np.random.default_rng(23)
    X = tabicl_helpers.random_table(rng, 2, 100, 5)
    y = tabicl_helpers.random_labels(rng, 2, 80, 23)
    model, params = small_lhc
    for return_logits in (True, False):
        got = predict_logits(model, params, X, y, return_logits=return_logits)
        want = _reference_eval(small_reference, X, y, return_logits=return_logits)
        assert got.shape == (2, 20, 23)
        np.testing.assert_allclose(got, want, atol=ATOL)


@pytest.mark.parametrize("classes", [4, 12])
def test_non_default_config_matches(classes, tabicl_helpers):
    """Post-norm, ReLU, odd head counts, rope base 1e3; 12 > 5 classes is a 3-level tree."""
    reference = tabicl_helpers.make_reference_model(tabicl_helpers.OTHER_CONFIG, seed=3)
    model, params = _convert(reference, tabicl_helpers.OTHER_CONFIG)
    rng = np.random.default_rng(classes)
    X = tabicl_helpers.random_table(rng, 2, 70, 9)
    y = tabicl_helpers.random_labels(rng, 2, 50, classes)
    np.testing.assert_allclose(
        predict_logits(model, params, X, y), _reference_eval(reference, X, y), atol=ATOL
    )


def test_feature_permuted_members_match(small_reference, small_lhc, tabicl_helpers):
    """Members sharing one table in different column orders (ensemble views)."""
    rng = np.random.default_rng(7)
    X = tabicl_helpers.random_table(rng, 1, 60, 6)[0]
    perms = np.stack([rng.permutation(6) for _ in range(3)])
    y = tabicl_helpers.random_labels(rng, 3, 45, 3)
    model, params = small_lhc
    got = predict_logits(model, params, X, y, feature_permutations=perms)
    # The reference's feature_shuffles shortcut mis-permutes (see the classifier test), so
    # compare with the explicitly permuted tables.
    want = _reference_eval(small_reference, np.stack([X[:, p] for p in perms]), y)
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_intermediate_tensors_match(small_reference, small_lhc, tabicl_helpers):
    rng = np.random.default_rng(11)
    X = tabicl_helpers.random_table(rng, 2, 50, 5)
    train_size, num_cls = 35, tabicl_helpers.SMALL_CONFIG["row_num_cls"]
    model, params = small_lhc
    with torch.no_grad():
        ref_embeddings = small_reference.col_embedder(torch.from_numpy(X), train_size=train_size)
        ref_rows = small_reference.row_interactor(ref_embeddings.clone()).numpy()
    ref_embeddings = ref_embeddings.numpy()
    embeddings = model.apply(
        {"params": params}, jnp.asarray(X), train_size, method=TabICL.column_embeddings
    )
    # The reference's first C slots are placeholders for the CLS tokens.
    np.testing.assert_allclose(embeddings, ref_embeddings[:, :, num_cls:], atol=ATOL, rtol=1e-5)
    rows = model.apply(
        {"params": params},
        jnp.asarray(ref_embeddings[:, :, num_cls:]),
        method=TabICL.row_representations,
    )
    np.testing.assert_allclose(rows, ref_rows, atol=ATOL, rtol=1e-5)
    # The chunked path: summaries of the training rows, then any rows on their own.
    summaries = chunked.train_summaries(
        model,
        params,
        jnp.asarray(np.swapaxes(X[:, :train_size], 1, 2)),
        jnp.ones(train_size, bool),
        col_chunk=3,
    )
    chunked_rows = chunked.embed_rows(
        model,
        params,
        jnp.asarray(X),
        summaries,
        jnp.zeros((2, 5), bool),
        jnp.arange(2),
        jnp.tile(jnp.arange(5), (2, 1)),
        jnp.ones(5, bool),
        row_chunk=16,
    )
    np.testing.assert_allclose(chunked_rows, ref_rows, atol=ATOL, rtol=1e-5)


def test_skip_marker_cells_and_columns_match(small_reference, small_lhc, tabicl_helpers):
    """-100 is the reference's skip marker: a cell of -100 and an all -100 column."""
    rng = np.random.default_rng(13)
    X = tabicl_helpers.random_table(rng, 2, 60, 5)
    X[0, 3, 1] = X[1, 50, 2] = -100.0
    X[1, :, 4] = -100.0
    y = tabicl_helpers.random_labels(rng, 2, 40, 3)
    model, params = small_lhc
    np.testing.assert_allclose(
        predict_logits(model, params, X, y), _reference_eval(small_reference, X, y), atol=ATOL
    )


@pytest.mark.parametrize("remat", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_training_forward_and_gradients_match_with_padding(
    small_reference, small_lhc, tabicl_helpers, remat
):
    """Padded features (the reference's ``d``) and padded training rows (masked)."""
    rng = np.random.default_rng(17)
    X = tabicl_helpers.random_table(rng, 3, 60, 6)
    num_features = np.array([6, 4, 2])
    y_train = tabicl_helpers.random_labels(rng, 3, 40, 3)
    y_test = rng.integers(0, 3, size=(3, 20))
    model, params = small_lhc
    model = TabICL(model.config, remat_policy=remat)

    small_reference.train()
    try:
        X_ref = torch.from_numpy(X).requires_grad_(False)
        logits_ref = small_reference(
            X_ref, torch.from_numpy(y_train.astype(np.float32)), d=torch.from_numpy(num_features)
        )
        loss_ref = torch.nn.functional.cross_entropy(
            logits_ref.reshape(-1, 10), torch.from_numpy(y_test.reshape(-1))
        )
        small_reference.zero_grad()
        loss_ref.backward()
        grads_ref = {
            name: p.grad.numpy()
            for name, p in small_reference.named_parameters()
            if p.grad is not None
        }
    finally:
        small_reference.eval()

    feature_mask = np.arange(6)[None, :] < num_features[:, None]
    # Pad 8 extra training rows (garbage labels and cells) that the mask must hide.
    X_pad = np.concatenate([X[:, :40], rng.normal(size=(3, 8, 6)), X[:, 40:]], axis=1)
    y_pad = np.concatenate([y_train, rng.integers(0, 10, size=(3, 8))], axis=1)
    train_mask = np.arange(48) < 40

    def loss(params):
        logits = model.apply(
            {"params": params},
            jnp.asarray(X_pad, jnp.float32),
            jnp.asarray(y_pad),
            feature_mask=jnp.asarray(feature_mask),
            train_mask=jnp.asarray(np.tile(train_mask, (3, 1))),
        )
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(y_test)[..., None], -1)), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    jaxpr = str(jax.make_jaxpr(loss)(params))
    assert ("remat" in jaxpr) == (remat != "none")
    np.testing.assert_allclose(logits, logits_ref.detach().numpy(), atol=ATOL)
    np.testing.assert_allclose(float(value), loss_ref.item(), rtol=1e-5)
    grads = params_to_state_dict(TabICLConfig(**tabicl_helpers.SMALL_CONFIG), grads)
    assert set(grads_ref) <= set(grads)
    for name, want in grads_ref.items():
        scale = max(np.abs(want).max(), 1e-3)
        np.testing.assert_allclose(grads[name], want, atol=1e-4 * scale, err_msg=name)


# ----------------------------------------------------------------------------- classifier


def _datasets():
    from sklearn import datasets

    return {
        "iris": datasets.load_iris,
        "wine": datasets.load_wine,
        "breast_cancer": datasets.load_breast_cancer,
        "digits": datasets.load_digits,
    }


def _split(name):
    from sklearn.model_selection import train_test_split

    X, y = _datasets()[name](return_X_y=True)
    return train_test_split(X, y, test_size=0.3, random_state=0, stratify=y)


def _reference_classifier(path, **kwargs):
    return tabicl.TabICLClassifier(
        model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kwargs
    )


DETERMINISTIC = dict(n_estimators=1, feat_shuffle_method="none", class_shift=False)


@pytest.mark.parametrize(
    "name, norm",
    [
        ("iris", "none"),
        ("wine", "power"),
        pytest.param("breast_cancer", "robust", marks=pytest.mark.slow),
    ],
)
def test_classifier_predict_proba_matches(small_ckpt, name, norm):
    X_train, X_test, y_train, _ = _split(name)
    kwargs = dict(DETERMINISTIC, norm_methods=norm)
    want = _reference_classifier(small_ckpt, **kwargs).fit(X_train, y_train).predict_proba(X_test)
    clf = TabICLClassifier(model_path=small_ckpt, **kwargs).fit(X_train, y_train)
    np.testing.assert_allclose(clf.predict_proba(X_test), want, atol=ATOL)
    ref_labels = _reference_classifier(small_ckpt, **kwargs).fit(X_train, y_train).predict(X_test)
    np.testing.assert_array_equal(clf.predict(X_test), ref_labels)


@pytest.mark.slow
def test_classifier_hierarchy_on_digits_matches(tmp_path, tabicl_helpers):
    """digits has 10 classes; with max_classes=3 they form a 3-level tree (groups 4/3/3)."""
    config = dict(tabicl_helpers.SMALL_CONFIG, max_classes=3)
    path = tabicl_helpers.save_reference(
        tabicl_helpers.make_reference_model(config, seed=5), config, tmp_path / "m3.ckpt"
    )
    X_train, X_test, y_train, _ = _split("digits")
    want = _reference_classifier(path, **DETERMINISTIC).fit(X_train, y_train).predict_proba(X_test)
    clf = TabICLClassifier(model_path=path, **DETERMINISTIC).fit(X_train, y_train)
    np.testing.assert_allclose(clf.predict_proba(X_test), want, atol=ATOL)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_estimators=8),
        dict(
            n_estimators=5,
            norm_methods=["none", "power", "robust"],
            average_logits=False,
            feat_shuffle_method="random",
            softmax_temperature=1.3,
        ),
    ],
)
def test_ensemble_matches_the_reference_run_member_by_member(small_ckpt, kwargs):
    """Same random_state -> same views (Latin squares, class offsets, normalisations).

    The reference runs members one per batch here: with several members per batch its
    column-embedding shortcut gives members after the first the inverse of their
    relative feature order (next test).
    """
    X_train, X_test, y_train, _ = _split("iris")
    reference = _reference_classifier(small_ckpt, batch_size=1, **kwargs).fit(X_train, y_train)
    clf = TabICLClassifier(model_path=small_ckpt, batch_size=4, **kwargs).fit(X_train, y_train)
    np.testing.assert_allclose(
        clf.predict_proba(X_test), reference.predict_proba(X_test), atol=ATOL
    )


def test_reference_feature_shuffle_shortcut_depends_on_batching(small_reference, tabicl_helpers):
    """Documents the reference's ``ColEmbedding.map_feature_shuffle``: member i of a batch
    gets the first member's column embeddings gathered at ``[perm_i.index(f) for f in
    perm_0]`` where its own order needs ``[perm_0.index(f) for f in perm_i]``."""
    rng = np.random.default_rng(3)
    X = torch.from_numpy(tabicl_helpers.random_table(rng, 1, 30, 4)[0])
    first, other = [1, 2, 3, 0], [2, 3, 0, 1]  # relative order [1, 2, 3, 0], no involution
    tables = torch.stack([X[:, first], X[:, other]])
    num_cls = tabicl_helpers.SMALL_CONFIG["row_num_cls"]
    with torch.no_grad():
        shortcut = small_reference.col_embedder(
            tables, train_size=20, feature_shuffles=[first, other]
        )[1, :, num_cls:]
        direct = small_reference.col_embedder(tables, train_size=20)[:, :, num_cls:]
    used = [other.index(f) for f in first]
    needed = [first.index(f) for f in other]
    np.testing.assert_allclose(shortcut.numpy(), direct[0][:, used].numpy(), atol=1e-5)
    np.testing.assert_allclose(direct[1].numpy(), direct[0][:, needed].numpy(), atol=1e-5)
    assert not np.allclose(shortcut.numpy(), direct[1].numpy(), atol=1e-3)


def test_dataframe_with_categories_and_missing_values_matches(small_ckpt):
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    n = 120
    frame = pd.DataFrame(
        {
            "size": rng.normal(size=n),
            "color": pd.Categorical(rng.choice(["red", "green", "blue", None], size=n)),
            "count": rng.poisson(3, size=n).astype(float),
            "label_text": rng.choice(["a", "b", "c"], size=n).astype(object),
            "flag": rng.choice([True, False], size=n),
        }
    )
    frame.loc[rng.choice(n, 10, replace=False), "size"] = np.nan
    y = (frame["size"].fillna(0) + (frame["color"] == "red") > 0.3).astype(int).to_numpy()
    train, test = frame.iloc[:90], frame.iloc[90:].copy()
    test.loc[test.index[:3], "label_text"] = "unseen"
    kwargs = dict(n_estimators=4)
    want = _reference_classifier(small_ckpt, batch_size=1, **kwargs).fit(train, y[:90])
    clf = TabICLClassifier(model_path=small_ckpt, **kwargs).fit(train, y[:90])
    np.testing.assert_allclose(clf.predict_proba(test), want.predict_proba(test), atol=ATOL)


def test_bfloat16_compute_stays_close(small_reference, small_lhc, tabicl_helpers):
    """bfloat16 matmuls (use_amp on accelerators): softmax, norms and logits in float32."""
    rng = np.random.default_rng(29)
    X = tabicl_helpers.random_table(rng, 2, 90, 7)
    y = tabicl_helpers.random_labels(rng, 2, 64, 3)
    model, params = small_lhc
    bf16 = TabICL(model.config, dtype=jnp.bfloat16)
    got = predict_logits(bf16, params, X, y, return_logits=False)
    want = _reference_eval(small_reference, X, y, return_logits=False)
    assert got.dtype == np.float32
    # bfloat16 keeps 8 bits of mantissa; through 6 blocks the probabilities move by ~4e-3.
    np.testing.assert_allclose(got, want, atol=2e-2)
