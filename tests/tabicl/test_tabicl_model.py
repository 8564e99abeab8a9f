"""TabICL network pieces against closed forms and numpy (no torch needed)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.tabicl import TabICLConfig, abstract_params
from lhc.tabicl.inference import (
    CACHE_BUDGET_MB,
    MIN_QUERY_CHUNK,
    bucket_size,
    class_groups,
    plan_chunks,
)
from lhc.tabicl.layers import interleaved_rope_tables, key_masked_attention, rotate_interleaved


def test_default_config_has_the_papers_parameter_count():
    params = nn.meta.unbox(abstract_params(TabICLConfig()))
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    # 27,051,666 in the reference, which also counts the 8 frozen rope frequencies that
    # lhc recomputes instead of storing.
    assert count == 27_051_666 - 8


def test_every_parameter_has_logical_axis_names():
    boxed = abstract_params(TabICLConfig(embed_dim=16, row_nhead=2, col_nhead=2, icl_nhead=2))
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves
    vocabulary = {"embed", "mlp", "heads", "kv", "norm", None}
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == len(leaf.value.shape)
        assert set(leaf.names) <= vocabulary, leaf.names


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(embed_dim=30, col_nhead=4), "col_nhead"),
        (dict(embed_dim=12, row_nhead=4), "even"),
        (dict(icl_nhead=3), "icl_nhead"),
        (dict(activation="swish"), "activation"),
        (dict(dropout=1.0), "dropout"),
        (dict(max_classes=1), "max_classes"),
        (dict(col_num_inds=0), "col_num_inds"),
        (dict(norm_first="yes"), "norm_first"),
    ],
)
def test_config_rejects_bad_values(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        TabICLConfig(**changes)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown TabICL config keys.*'embed_dims'"):
        TabICLConfig.from_dict({"embed_dims": 128})
    assert TabICLConfig.from_dict({"embed_dim": 64}).embed_dim == 64


def test_rope_is_a_complex_rotation_of_neighbouring_pairs():
    rng = np.random.default_rng(0)
    seq, heads, head_dim, base = 7, 3, 8, 100000.0
    x = rng.normal(size=(2, heads, seq, head_dim)).astype(np.float32)
    cos, sin = interleaved_rope_tables(seq, head_dim, base)
    got = np.asarray(rotate_interleaved(jnp.asarray(x), cos, sin))
    pairs = x[..., 0::2] + 1j * x[..., 1::2]
    angles = np.arange(seq)[:, None] * base ** (-np.arange(0, head_dim, 2) / head_dim)
    rotated = pairs * np.exp(1j * angles)[None, None, :, :]
    want = np.stack([rotated.real, rotated.imag], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(got, want, atol=1e-5)


def _numpy_attention(q, k, v, key_mask):
    """Loop reference; arrays are [batch, heads, length, head_dim]."""
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(q.shape[0]):
        for n in range(q.shape[1]):
            for i in range(q.shape[2]):
                keys = np.flatnonzero(key_mask[b])
                scores = np.array([q[b, n, i] @ k[b, n, j] for j in keys]) / np.sqrt(q.shape[-1])
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, n, i] = sum(w * v[b, n, j] for w, j in zip(weights, keys))
    return out


def test_attention_with_key_mask_matches_numpy():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 3, 5, 4)).astype(np.float32)
    k = rng.normal(size=(2, 3, 6, 4)).astype(np.float32)
    v = rng.normal(size=(2, 3, 6, 4)).astype(np.float32)
    key_mask = np.array([[1, 1, 0, 1, 0, 1], [0, 0, 0, 0, 1, 0]], bool)
    got = key_masked_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), key_mask)
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(q, k, v, key_mask), atol=1e-5)


def test_attention_with_no_visible_key_stays_finite():
    q = jnp.ones((1, 1, 2, 4))
    k = v = jnp.ones((1, 1, 3, 4))
    out = key_masked_attention(q, k, v, jnp.zeros((1, 3), bool))
    assert np.all(np.isfinite(np.asarray(out)))


def test_bucket_sizes_are_few_and_tight():
    sizes = np.arange(1, 5000)
    buckets = np.array([bucket_size(n) for n in sizes])
    assert np.all(buckets >= sizes)
    assert np.all(buckets[sizes > 16] <= np.ceil(sizes[sizes > 16] * 9 / 8))
    assert np.all(buckets[sizes <= 16] == sizes[sizes <= 16])
    # Eight sizes per octave above 16.
    assert len(np.unique(buckets[(sizes > 1024) & (sizes <= 2048)])) == 8
    assert all(bucket_size(b) == b for b in np.unique(buckets))


@pytest.mark.parametrize(
    "num_classes, max_classes, sizes",
    [
        (25, 10, [9, 8, 8]),
        (101, 10, [11, 10, 10, 10, 10, 10, 10, 10, 10, 10]),
        (11, 10, [6, 5]),
        (10, 3, [4, 3, 3]),
        (7, 10, [7]),
    ],
)
def test_class_groups_follow_the_reference_docstring(num_classes, max_classes, sizes):
    groups = class_groups(num_classes, max_classes)
    assert np.all(np.diff(groups) >= 0)  # contiguous
    assert np.bincount(groups).tolist() == sizes


def test_chunk_plan_shrinks_with_the_budget_and_the_problem():
    config = TabICLConfig()
    kw = dict(num_tables=1, num_features=32, num_members=4)
    small = plan_chunks(config, num_train=50_000, memory_budget_mb=64, **kw)
    large = plan_chunks(config, num_train=50_000, memory_budget_mb=4096, **kw)
    short = plan_chunks(config, num_train=1_000, memory_budget_mb=64, **kw)
    for field in ("col_chunk", "row_chunk", "query_chunk"):
        assert getattr(small, field) <= getattr(large, field)
    assert small.query_chunk < short.query_chunk
    # One ICL query chunk's scores+probs: 2 * B * heads * chunk * N floats within budget.
    assert 2 * 4 * config.icl_nhead * small.query_chunk * 50_000 * 4 <= 64 * 2**20
    # Beyond the CPU cache size the memory budget only grows the rows of a call; the
    # query chunk keeps MIN_QUERY_CHUNK rows while the memory budget allows.
    cache = plan_chunks(config, num_train=1_000, memory_budget_mb=CACHE_BUDGET_MB, **kw)
    wide = plan_chunks(config, num_train=1_000, memory_budget_mb=4096, **kw)
    assert (wide.col_chunk, wide.row_chunk) == (cache.col_chunk, cache.row_chunk)
    assert wide.query_chunk == max(cache.query_chunk, MIN_QUERY_CHUNK)
    assert wide.test_chunk > cache.test_chunk
    # The training cells' embeddings ([G, H, N, E] floats) are kept only within budget.
    assert large.keep_train_cells and not small.keep_train_cells


def _random_params(config, seed=0):
    rng = np.random.default_rng(seed)
    shapes = nn.meta.unbox(abstract_params(config))
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), jnp.float32), shapes)


def test_training_forward_dropout_is_random_and_off_when_deterministic():
    from lhc.tabicl import TabICL

    config = TabICLConfig(
        embed_dim=8,
        col_num_blocks=1,
        col_nhead=2,
        col_num_inds=4,
        row_num_blocks=1,
        row_nhead=2,
        row_num_cls=2,
        icl_num_blocks=1,
        icl_nhead=2,
        dropout=0.5,
    )
    model, params = TabICL(config), _random_params(config)
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.normal(size=(2, 12, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, size=(2, 8)), jnp.int32)

    def forward(params, key, deterministic):
        return model.apply(
            {"params": params}, X, y, deterministic=deterministic, rngs={"dropout": key}
        )

    forward = jax.jit(forward, static_argnums=2)
    # rbg keys compile much faster than threefry on CPU.
    keys = [jax.random.key(i, impl="unsafe_rbg") for i in range(2)]
    a, b = (np.asarray(forward(params, k, False)) for k in keys)
    c, d = (np.asarray(forward(params, k, True)) for k in keys)
    assert a.shape == (2, 4, config.max_classes) and np.all(np.isfinite(a))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(c, d)
    assert not np.allclose(a, c)


@pytest.mark.slow
def test_init_follows_torch_initialisation():
    from lhc.tabicl.model import init_params

    config = TabICLConfig(
        embed_dim=32,
        col_num_blocks=1,
        col_nhead=2,
        col_num_inds=64,
        row_num_blocks=1,
        row_nhead=2,
        row_num_cls=2,
        icl_num_blocks=1,
        icl_nhead=2,
    )
    params = init_params(config, jax.random.key(0, impl="unsafe_rbg"))
    col, icl = params["col_embedder"], params["icl_predictor"]
    block = icl["blocks_0"]
    # Zero-initialised residual branches (TabICL's init_weights).
    for leaf in jax.tree.leaves((block["attn"]["out"], block["linear2"])):
        assert not np.any(np.asarray(leaf))
    # torch.nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), kernel and bias.
    for tree, fan_in in ((block["linear1"], 64), (col["in_linear"], 1), (icl["y_encoder"], 10)):
        for leaf in jax.tree.leaves(tree):
            bound = 1 / np.sqrt(fan_in)
            assert np.abs(leaf).max() <= bound and np.abs(leaf).max() > 0.8 * bound
    # Xavier-uniform over the packed [3E, E] in_proj, zero in_proj bias.
    q = np.asarray(block["attn"]["query"]["kernel"])
    bound = np.sqrt(6 / (64 + 3 * 64))
    assert np.abs(q).max() <= bound and np.abs(q).max() > 0.8 * bound
    assert not np.any(np.asarray(block["attn"]["query"]["bias"]))
    # trunc_normal(std=0.02) inducing points, LayerNorm ones/zeros.
    assert abs(np.std(col["blocks_0"]["ind_vectors"]) - 0.02) < 0.002
    np.testing.assert_array_equal(block["norm1"]["scale"], 1.0)
    np.testing.assert_array_equal(block["norm1"]["bias"], 0.0)
