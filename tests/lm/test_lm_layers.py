"""A forward pass from a middle layer, attention probabilities of chosen queries, and
keys held per key/value head."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.nn.attention_ops import attention_segments

from ..support import inv_frequencies, random_params, rms_norm, rotate

CONFIG = lm.LMConfig.tiny(num_layers=3)


def _prefilled(model, params, tokens):
    """A cache holding ``tokens`` [B, P], and their logits."""
    batch, length = tokens.shape
    cache = model.init_cache(batch, 64)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    return model.apply({"params": params}, tokens, positions, cache)


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("start", [1, 2])
def test_a_pass_from_a_middle_layer_equals_the_full_pass(with_cache, start, traced):
    model, params = lm.Transformer(CONFIG), random_params(CONFIG, norms=0.2)
    rng = np.random.default_rng(1)
    prefix = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 5)), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 4)), jnp.int32)
    cache = _prefilled(model, params, prefix)[1] if with_cache else None
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32) + (5 if with_cache else 0), (2, 4))
    (full, _), state = model.apply(
        {"params": params}, tokens, positions, cache, mutable=["intermediates"]
    )
    entering = state["intermediates"][f"layers_{start}"]["layer_input"][0]
    if traced:  # one program for every start: layers below it skipped at run time
        part = _from_layer(model, params, positions, cache, entering, jnp.int32(start))
    else:
        part, _ = model.apply(
            {"params": params}, None, positions, cache, embeddings=entering, start_layer=start
        )
    np.testing.assert_allclose(part, full, rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _from_layer(model, params, positions, cache, entering, start):
    return model.apply(
        {"params": params}, None, positions, cache, embeddings=entering, start_layer=start
    )[0]


def test_logits_at_chosen_columns_equal_those_of_every_column():
    model, params = lm.Transformer(CONFIG), random_params(CONFIG, norms=0.2)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 6)), jnp.int32)
    cache = _prefilled(model, params, tokens[:, :2])[1]
    positions = jnp.broadcast_to(jnp.arange(2, 6, dtype=jnp.int32), (2, 4))
    columns = jnp.asarray([[3, 0, 1], [2, 2, 0]], jnp.int32)
    full, _ = model.apply({"params": params}, tokens[:, 2:], positions, cache)
    chosen, _ = model.apply({"params": params}, tokens[:, 2:], positions, cache, logits_at=columns)
    assert chosen.shape == (2, 3, CONFIG.vocab_size)
    for b in range(2):
        np.testing.assert_allclose(chosen[b], full[b, columns[b]], rtol=1e-6, atol=1e-6)


def test_a_traced_start_layer_compiles_once_for_every_start():
    model, params = lm.Transformer(CONFIG), random_params(CONFIG, norms=0.2)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    hidden = jnp.ones((1, 4, CONFIG.embed_dim))
    _from_layer.clear_cache()
    for start in range(CONFIG.num_layers):
        _from_layer(model, params, positions, None, hidden, jnp.int32(start))
    assert _from_layer._cache_size() == 1


def test_probed_attention_probabilities_match_a_numpy_reference():
    config = CONFIG
    model, params = lm.Transformer(config), random_params(config, norms=0.2)
    rng = np.random.default_rng(2)
    sequence = rng.integers(0, config.vocab_size, 9)
    cache = _prefilled(model, params, jnp.asarray(sequence[None, :6], jnp.int32))[1]
    probe = jnp.asarray([[0, 2]], jnp.int32)
    positions = jnp.arange(6, 9, dtype=jnp.int32)[None]
    _, state = model.apply(
        {"params": params},
        jnp.asarray(sequence[None, 6:], jnp.int32),
        positions,
        cache,
        probe=probe,
        mutable=["intermediates"],
    )
    probs = np.asarray(state["intermediates"]["layers_0"]["attention"]["attention_probs"][0])
    slots = cache.capacity
    assert probs.shape == (1, config.num_heads, 2, slots + 3)

    # Layer 0 in float64: RMS norm, projections, RoPE, causal softmax over the 9 tokens.
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    h = rms_norm(
        p["embed"]["embedding"][sequence], p["layers_0"]["attention_norm"]["scale"], config.norm_eps
    )
    freqs = inv_frequencies(config.head_dim, config.rope_theta)
    attention = p["layers_0"]["attention"]
    group = config.num_heads // config.num_kv_heads
    for n in range(config.num_heads):
        q = rotate(h @ attention["query"]["kernel"][:, n], np.arange(9), freqs)
        k = rotate(h @ attention["key"]["kernel"][:, n // group], np.arange(9), freqs)
        for row, t in enumerate([6, 8]):
            scores = k[: t + 1] @ q[t] / np.sqrt(config.head_dim)
            expected = np.exp(scores - scores.max())
            expected /= expected.sum()
            # Columns: the cache's slots (6 held, the rest empty), then the call's 3 keys.
            got = np.concatenate([probs[0, n, row, :6], probs[0, n, row, slots : slots + t - 5]])
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
            assert np.all(probs[0, n, row, 6:slots] == 0)
            assert np.all(probs[0, n, row, slots + t - 5 :] == 0)


def test_keys_held_per_head_attend_like_each_head_alone():
    rng = np.random.default_rng(3)
    batch, length, slots, heads, kv_heads, dim = 2, 3, 7, 4, 2, 8
    query = jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(batch, slots, kv_heads, dim)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(batch, slots, kv_heads, dim)), jnp.float32)
    new_keys = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    new_values = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    held = rng.permuted(np.tile(np.arange(slots), (batch, kv_heads, 1)), axis=-1)
    held = np.where(rng.random(held.shape) < 0.3, -1, held).astype(np.int32)  # [B, K, S]
    query_positions = jnp.asarray(np.tile(np.arange(slots, slots + length), (batch, 1)))
    got = attention_segments(
        query,
        [(keys, values, jnp.asarray(held)), (new_keys, new_values, query_positions)],
        query_positions,
        scale=0.3,
        window=6,
    )
    group = heads // kv_heads
    for k in range(kv_heads):
        alone = attention_segments(
            query[:, :, k * group : (k + 1) * group],
            [
                (keys[:, :, k : k + 1], values[:, :, k : k + 1], jnp.asarray(held[:, k])),
                (new_keys[:, :, k : k + 1], new_values[:, :, k : k + 1], query_positions),
            ],
            query_positions,
            scale=0.3,
            window=6,
        )
        np.testing.assert_allclose(got[:, :, k * group : (k + 1) * group], alone, rtol=1e-6)


def test_bad_start_layer_and_probe_are_refused():
    model, params = lm.Transformer(CONFIG), random_params(CONFIG, norms=0.2)
    tokens = jnp.zeros((1, 3), jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    hidden = jnp.zeros((1, 3, CONFIG.embed_dim))
    apply = lambda *a, **k: model.apply({"params": params}, *a, **k)
    with pytest.raises(ValueError, match="start_layer must be in"):
        apply(None, positions, embeddings=hidden, start_layer=3)
    with pytest.raises(ValueError, match="tokens=None"):
        apply(tokens, positions, start_layer=1)
    with pytest.raises(ValueError, match="int scalar array"):
        apply(None, positions, embeddings=hidden, start_layer=jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="sows nothing"):
        apply(
            None,
            positions,
            embeddings=hidden,
            start_layer=jnp.int32(1),
            mutable=["intermediates"],
        )
    with pytest.raises(ValueError, match="probe indices"):
        apply(tokens, positions, probe=jnp.asarray([[3]]))
    with pytest.raises(ValueError, match="probe must be int"):
        apply(tokens, positions, probe=jnp.asarray([3]))
    with pytest.raises(ValueError, match="logits_at indices"):
        apply(tokens, positions, logits_at=jnp.asarray([[3]]))
    with pytest.raises(ValueError, match="last_only or logits_at"):
        apply(tokens, positions, logits_at=jnp.asarray([[2]]), last_only=True)
    scanned = dataclasses.replace(CONFIG, scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers=False"):
        lm.Transformer(scanned).apply(
            {"params": random_params(scanned, norms=0.2)},
            None,
            positions,
            embeddings=hidden,
            start_layer=1,
        )
