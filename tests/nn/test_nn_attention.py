"""Attention: masks, grouped-query heads, dispatch and the cached layer, against brute force."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from lhc import nn as lnn

from ..support import random_params


def _brute_force_attention(q, k, v, q_pos, k_pos, slopes=None, window=None):
    """Loops over batch, head and query; numpy float64 (ALiBi biases with ``slopes``, a
    sliding ``window``)."""
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    out = np.zeros((batch, length, num_heads, head_dim))
    for b in range(batch):
        for n in range(num_heads):
            kv_head = n * num_kv_heads // num_heads
            for t in range(length):
                if q_pos[b, t] < 0:
                    continue
                visible = [
                    s
                    for s in range(k.shape[1])
                    if 0 <= k_pos[b, s] <= q_pos[b, t]
                    and (window is None or q_pos[b, t] - k_pos[b, s] < window)
                ]
                if not visible:
                    continue
                scores = np.array([q[b, t, n] @ k[b, s, kv_head] for s in visible]) / np.sqrt(
                    head_dim
                )
                if slopes is not None:
                    scores -= slopes[n] * np.array([q_pos[b, t] - k_pos[b, s] for s in visible])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[b, t, n] = sum(wi * v[b, s, kv_head] for wi, s in zip(w, visible))
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_dot_product_attention_matches_brute_force(num_heads, num_kv_heads):
    rng = np.random.default_rng(num_heads * 10 + num_kv_heads)
    batch, length, slots, head_dim = 2, 5, 9, 4
    q = rng.normal(size=(batch, length, num_heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, slots, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, slots, num_kv_heads, head_dim)).astype(np.float32)
    # Keys in shuffled slot order with padding and empty slots; queries include padding
    # and a query that sees no key at all.
    k_pos = np.array([[3, -1, 0, 5, 1, 2, -1, 4, 6], [-1, -1, 0, 1, 2, 3, 4, 5, 6]])
    q_pos = np.array([[-1, 2, 4, 5, 6], [-1, -1, 1, 5, 6]])
    k_pos[1, 2] = 2  # position 0 absent for sequence 1
    q_pos[1, 2] = 0  # so this query sees nothing
    got = lnn.dot_product_attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos)))
    expected = _brute_force_attention(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert np.all(np.asarray(got)[0, 0] == 0) and np.all(np.asarray(got)[1, 2] == 0)


def test_alibi_attention_matches_brute_force():
    rng = np.random.default_rng(3)
    batch, length, slots, num_heads, num_kv_heads, head_dim = 2, 4, 7, 4, 2, 4
    q = rng.normal(size=(batch, length, num_heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, slots, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, slots, num_kv_heads, head_dim)).astype(np.float32)
    k_pos = np.array([[4, 0, 6, 1, -1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    q_pos = np.array([[3, 4, 5, 6], [-1, 2, 5, 6]])
    # ALiBi's slopes for a power of two: 2^-2, 2^-4, ... (start = ratio = 2^(-8/N)).
    slopes = lnn.alibi_slopes(num_heads)
    np.testing.assert_allclose(slopes, [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    got = lnn.dot_product_attention(
        *map(jnp.asarray, (q, k, v, q_pos, k_pos)), alibi_slopes=slopes * 4
    )
    expected = _brute_force_attention(q, k, v, q_pos, k_pos, slopes=slopes * 4)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match="ALiBi .* needs impl='xla'"):
        lnn.dot_product_attention(q, k, v, q_pos, k_pos, impl="chunked", alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        lnn.dot_product_attention(q, k, v, q_pos, k_pos, alibi_slopes=slopes[:2])


def test_attention_mask_rule():
    q_pos = jnp.array([[-1, 0, 2]])
    k_pos = jnp.array([[0, -1, 1, 2, 3]])
    expected = np.array([[[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 1, 1, 0]]], dtype=bool)
    np.testing.assert_array_equal(lnn.attention_mask(q_pos, k_pos), expected)


def test_attention_dispatch_and_validation():
    q = jnp.ones((1, 2, 4, 8))
    kv = jnp.ones((1, 3, 2, 8))
    pos_q, pos_k = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        lnn.dot_product_attention(q, kv, kv, pos_q, pos_k, impl="no-such-kernel")
    with pytest.raises(ValueError, match="multiple"):
        lnn.dot_product_attention(q, jnp.ones((1, 3, 3, 8)), jnp.ones((1, 3, 3, 8)), pos_q, pos_k)
    with pytest.raises(ValueError, match="key_positions"):
        lnn.dot_product_attention(q, kv, kv, pos_q, pos_q)

    calls = []

    def recording_impl(query, key, value, query_positions, key_positions, *, scale):
        calls.append(scale)
        return jnp.zeros_like(query)

    lnn.register_attention_impl("test-recording", recording_impl, overwrite=True)
    assert "test-recording" in lnn.attention_impls()
    out = lnn.dot_product_attention(q, kv, kv, pos_q, pos_k, impl="test-recording")
    assert calls == [8**-0.5] and out.shape == q.shape
    with pytest.raises(ValueError, match="already registered"):
        lnn.register_attention_impl("test-recording", recording_impl)


def test_write_slots_per_sequence():
    buffer = np.zeros((3, 6, 2), np.float32)
    update = np.arange(3 * 2 * 2, dtype=np.float32).reshape(3, 2, 2) + 1
    start = np.array([0, 4, 1])
    got = np.asarray(lnn.write_slots(jnp.asarray(buffer), jnp.asarray(update), jnp.asarray(start)))
    expected = buffer.copy()
    for b in range(3):
        expected[b, start[b] : start[b] + 2] = update[b]
    np.testing.assert_array_equal(got, expected)


def test_attention_layer_cached_equals_uncached_and_params_are_named():
    layer = lnn.Attention(num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    rng = np.random.default_rng(0)
    batch, length = 2, 6
    x = jnp.asarray(rng.normal(size=(batch, length, 16)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    variables = jax.eval_shape(layer.init, jax.random.key(0), x, positions)
    names = jax.tree.map(
        lambda p: p.names, variables["params"], is_leaf=lambda p: isinstance(p, nn.Partitioned)
    )
    assert names["query"] == {"kernel": ("embed", "heads", "kv"), "bias": ("heads", "kv")}
    assert names["key"]["kernel"] == ("embed", "kv_heads", "kv")
    assert names["out"] == {"kernel": ("heads", "kv", "embed")}
    params = jax.tree.map(
        lambda leaf: jnp.asarray(rng.normal(size=leaf.shape) * 0.3, leaf.dtype),
        nn.meta.unbox(variables),
    )
    apply = jax.jit(layer.apply)
    full, no_cache = apply(params, x, positions)
    assert no_cache is None

    # A minimal cache of one layer through the LayerCache interface: keys and values
    # stacked [1, B, S, K, H], written at each sequence's length.
    slots = 10

    @struct.dataclass
    class Writer:
        start: jax.Array
        old_positions: jax.Array
        new_positions: jax.Array

        def read(self, layers, layer, keys, values):
            return lnn.KVView(
                layers[0][layer],
                layers[1][layer],
                self.old_positions,
                keys,
                values,
                self.new_positions,
            )

        def write(self, layers, layer, keys, values, *, after):
            return tuple(
                lnn.write_slots(store[layer], lnn.ordered_after(new, after), self.start)[None]
                for store, new in zip(layers, (keys, values))
            )

    def cached_call(params, x, positions, layers, slot_positions, lengths):
        writer = Writer(lengths, slot_positions, positions)
        handle = lnn.LayerCache(writer=writer, layers=layers, layer=0)
        out, handle = layer.apply(params, x, positions, handle)
        return out, handle.layers, lnn.write_slots(slot_positions, positions, lengths)

    cached_call = jax.jit(cached_call)
    layers = (jnp.zeros((1, batch, slots, 2, 8)), jnp.zeros((1, batch, slots, 2, 8)))
    slot_positions = jnp.full((batch, slots), -1, jnp.int32)
    outs, lengths = [], jnp.zeros((batch,), jnp.int32)
    for start, stop in [(0, 4), (4, 5), (5, 6)]:
        out, layers, slot_positions = cached_call(
            params, x[:, start:stop], positions[:, start:stop], layers, slot_positions, lengths
        )
        outs.append(out)
        lengths = lengths + (stop - start)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)


@pytest.mark.parametrize("impl", ["chunked", "flash"])
def test_registered_memory_efficient_impls_match_xla_in_the_model(impl):
    """The model with the chunked XLA or the Pallas (interpreted) implementation gives the
    logits of the materialising one, with padding and a window, cached and not."""
    from lhc import lm

    config = lm.LMConfig.tiny(max_len=32, sliding_window=6)
    params = random_params(config, scale=0.3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 11)), jnp.int32)
    positions = jnp.array([list(range(11)), [-1] * 3 + list(range(8))], jnp.int32)

    @jax.jit
    def run_all(params):
        outputs = []
        for attention_impl in ("xla", impl):
            model = lm.Transformer(config.replace(attention_impl=attention_impl))
            full, _ = model.apply({"params": params}, tokens, positions)
            cache = model.init_cache(2, 16)
            first, cache = model.apply({"params": params}, tokens[:, :7], positions[:, :7], cache)
            rest, _ = model.apply({"params": params}, tokens[:, 7:], positions[:, 7:], cache)
            outputs.append((full, jnp.concatenate([first, rest], axis=1)))
        return outputs

    (want_full, want_cached), (got_full, got_cached) = run_all(params)
    np.testing.assert_allclose(got_full, want_full, atol=2e-5)
    np.testing.assert_allclose(got_cached, want_cached, atol=2e-5)


@pytest.mark.parametrize("window, block", [(5, 4), (9, 16), (1, 3)])
def test_banded_self_attention_equals_windowed_attention(window, block):
    rng = np.random.default_rng(window)
    batch, length, num_heads, num_kv_heads, head_dim = 2, 23, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(batch, length, num_heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, length, num_kv_heads, head_dim)), jnp.float32)
    # Row 0 from position 0; row 1 from 0 after 2 padding slots, with padding at the end.
    positions = np.tile(np.arange(length), (batch, 1))
    positions[1] = np.concatenate([[-1, -1], np.arange(length - 5), [-1, -1, -1]])
    positions = jnp.asarray(positions, jnp.int32)
    slopes = lnn.alibi_slopes(num_heads)
    for alibi in (None, slopes):
        expected = lnn.dot_product_attention(
            q, k, v, positions, positions, window=window, alibi_slopes=alibi
        )
        got = lnn.banded_self_attention(
            q, k, v, positions, window=window, alibi_slopes=alibi, block=block
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize("alibi", [False, True])
def test_attention_with_blocked_prefix_matches_brute_force_and_skips_empty_blocks(alibi):
    from lhc.nn.blocked_prefix import attention_with_blocked_prefix

    rng = np.random.default_rng(7)
    batch, length, num_heads, num_kv_heads, head_dim, slots, new = 2, 4, 4, 2, 4, 21, 3
    q = rng.normal(size=(batch, length, num_heads, head_dim)).astype(np.float32)
    keys = rng.normal(size=(batch, num_kv_heads, slots, head_dim)).astype(np.float32)
    values = rng.normal(size=(batch, num_kv_heads, slots, head_dim)).astype(np.float32)
    # Per-head prefix positions with holes; the last held slot is 13 (head 1 of sequence
    # 0), so with blocks of 8 only slots 0-15 may be read: NaN after them must not show.
    positions = np.full((batch, num_kv_heads, slots), -1)
    positions[:, :, :10] = rng.permutation(10)
    positions[0, 0, 3:6] = -1
    positions[0, 1, 13] = 11
    values[:, :, 16:] = np.nan
    keys[:, :, 16:] = np.nan
    new_keys = rng.normal(size=(batch, new, num_kv_heads, head_dim)).astype(np.float32)
    new_values = rng.normal(size=(batch, new, num_kv_heads, head_dim)).astype(np.float32)
    new_positions = np.array([[12, 13, 14], [12, -1, 13]])
    q_pos = np.array([[12, 13, 14, -1], [0, 12, 13, 20]])
    slopes = lnn.alibi_slopes(num_heads) if alibi else None
    got = attention_with_blocked_prefix(
        jnp.asarray(q),
        (jnp.asarray(keys), jnp.asarray(values), jnp.asarray(positions)),
        [(jnp.asarray(new_keys), jnp.asarray(new_values), jnp.asarray(new_positions))],
        jnp.asarray(q_pos),
        scale=head_dim**-0.5,
        alibi_slopes=slopes,
        block=8,
    )
    # Brute force per key/value head (each has its own prefix positions).
    group = num_heads // num_kv_heads
    expected = np.zeros(q.shape)
    for head in range(num_kv_heads):
        heads = slice(head * group, (head + 1) * group)
        k = np.concatenate([np.swapaxes(keys, 1, 2)[:, :, head], new_keys[:, :, head]], 1)
        v = np.concatenate([np.swapaxes(values, 1, 2)[:, :, head], new_values[:, :, head]], 1)
        k_pos = np.concatenate([positions[:, head], new_positions], 1)
        expected[:, :, heads] = _brute_force_attention(
            q[:, :, heads],
            k[:, :, None],
            v[:, :, None],
            q_pos,
            k_pos,
            None if slopes is None else slopes[heads],
        )
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_blocked_prefix_reads_only_the_window_and_differentiates_like_the_dense_path():
    """A cache in slot order read by a chunk of later tokens with a window: the blocks
    wholly before the window (NaN here) are never read, the result is brute force's, and
    the gradient is the dense path's."""
    from lhc.nn.attention_ops import attention_segments
    from lhc.nn.blocked_prefix import attention_with_blocked_prefix

    rng = np.random.default_rng(3)
    batch, num_heads, num_kv_heads, head_dim, slots, new, window = 2, 4, 2, 4, 43, 4, 9
    # Positions 0..40 in slots 0..40 (row 1: two padding slots first); 43 slots are five
    # blocks of 8 and a last one clamped to start at slot 35.
    held = 41
    keys = rng.normal(size=(batch, num_kv_heads, slots, head_dim)).astype(np.float32)
    values = rng.normal(size=(batch, num_kv_heads, slots, head_dim)).astype(np.float32)
    positions = np.full((batch, slots), -1)
    positions[0, :held] = np.arange(held)
    positions[1, 2:held] = np.arange(held - 2)
    new_positions = np.array([[41, 42, 43, 44], [39, 40, 41, -1]])
    # The lowest query position is 39, so keys at positions <= 30 are out of the window:
    # with blocks of 8, blocks 0-2 (slots 0-23) are never read.
    keys[:, :, :24] = np.nan
    values[:, :, :24] = np.nan
    q = rng.normal(size=(batch, new, num_heads, head_dim)).astype(np.float32)
    new_keys = rng.normal(size=(batch, new, num_kv_heads, head_dim)).astype(np.float32)
    new_values = rng.normal(size=(batch, new, num_kv_heads, head_dim)).astype(np.float32)
    segment = (jnp.asarray(new_keys), jnp.asarray(new_values), jnp.asarray(new_positions))

    def blocked(q, keys, values):
        prefix = (keys, values, jnp.asarray(positions))
        return attention_with_blocked_prefix(
            q, prefix, [segment], jnp.asarray(new_positions), scale=0.5, window=window, block=8
        )

    got = blocked(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values))
    k = np.concatenate([np.swapaxes(keys, 1, 2), new_keys], 1)
    v = np.concatenate([np.swapaxes(values, 1, 2), new_values], 1)
    k_pos = np.concatenate([positions, new_positions], 1)
    expected = _brute_force_attention(q, k, v, new_positions, k_pos, window=window)
    np.testing.assert_allclose(got, expected, atol=1e-5)

    # Gradients against the dense formula on finite inputs.
    finite_keys, finite_values = (np.nan_to_num(x) for x in (keys, values))

    def dense(q, keys, values):
        first = (jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), jnp.asarray(positions))
        return attention_segments(
            q, [first, segment], jnp.asarray(new_positions), scale=0.5, window=window
        )

    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    args = (jnp.asarray(q), jnp.asarray(finite_keys), jnp.asarray(finite_values))
    grads = jax.grad(lambda *a: jnp.sum(blocked(*a) * weights), argnums=(0, 1, 2))(*args)
    expected_grads = jax.grad(lambda *a: jnp.sum(dense(*a) * weights), argnums=(0, 1, 2))(*args)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, atol=1e-5)
