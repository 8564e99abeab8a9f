"""The cache protocol: sliding-window ring against full caches and the numpy reference,
truncation in slots and in positions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.lm.cache import Cache, SlidingWindowKVCache, init_sliding_window_cache

WINDOW = 5
CONFIG = lm.LMConfig.tiny(sliding_window=WINDOW, max_len=64)


@functools.partial(jax.jit, static_argnums=0)
def _apply(config, params, tokens, positions, cache):
    return lm.Transformer(config).apply({"params": params}, tokens, positions, cache)


def _feed(config, params, cache, tokens, positions, bounds):
    pieces = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        logits, cache = _apply(
            config, params, tokens[:, start:stop], positions[:, start:stop], cache
        )
        pieces.append(np.asarray(logits))
    return np.concatenate(pieces, axis=1), cache


def test_protocol_is_runtime_checkable():
    ring = init_sliding_window_cache(CONFIG, 1, WINDOW, 8)
    assert isinstance(ring, Cache) and isinstance(lm.init_cache(CONFIG, 1, 8), Cache)
    assert ring.capacity is None and ring.slots == 8
    # A model whose layers all slide gets a ring once max_len exceeds window + headroom.
    model = lm.Transformer(CONFIG.replace(max_len=512))
    assert isinstance(model.init_cache(2, 512), SlidingWindowKVCache)
    assert isinstance(model.init_cache(2, 16), lm.KVCache)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_sliding_window_ring_equals_full_cache_and_numpy(numpy_lm, scan_layers, held_block):
    config = CONFIG.replace(scan_layers=scan_layers)
    params = lm.random_params(CONFIG)
    if scan_layers:
        params = lm.stack_layer_params(params, config.num_layers)
    batch, length, pad = 2, 30, 3
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, length)), jnp.int32)
    positions = np.broadcast_to(np.arange(length), (batch, length)).copy()
    positions[1] = np.arange(length) - pad  # sequence 1 is left-padded by 3
    positions[1, :pad] = -1
    positions = jnp.asarray(positions, jnp.int32)
    # Chunks longer than slots - window + 1 = 4 read the ring beside their own keys;
    # shorter ones write first; single steps far past the window.
    bounds = [0, 7, 8, 11, 18, 19, 20, 23, 30]  # chunks of 7, 1 and 3 tokens
    ring_logits, ring = _feed(
        config,
        params,
        init_sliding_window_cache(config, batch, WINDOW, 8),
        tokens,
        positions,
        bounds,
    )
    full_logits, full = _feed(
        config, params, lm.init_cache(config, batch, length), tokens, positions, bounds
    )
    np.testing.assert_allclose(ring_logits, full_logits, atol=1e-5)
    np.testing.assert_array_equal(ring.lengths, [length, length])
    assert ring.slots == 8 and ring.shape[3] == 8  # the ring never grew
    for b, first in ((0, 0), (1, pad)):
        expected = numpy_lm.forward(
            CONFIG, lm.random_params(CONFIG), np.asarray(tokens[b, first:]), window=WINDOW
        )
        np.testing.assert_allclose(ring_logits[b, first:], expected, atol=1e-4)
    # Without the window the logits differ: the test sees the mask.
    unwindowed = numpy_lm.forward(CONFIG, lm.random_params(CONFIG), np.asarray(tokens[0]))
    assert np.abs(unwindowed[WINDOW:] - ring_logits[0, WINDOW:]).max() > 1e-2
    np.testing.assert_array_equal(ring.next_positions(), full.next_positions())


def test_ring_truncation_within_headroom_is_exact_beyond_it_is_refused(numpy_lm):
    params = lm.random_params(CONFIG)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (1, 24)), jnp.int32)
    positions = jnp.arange(24, dtype=jnp.int32)[None]
    _, ring = _feed(
        CONFIG,
        params,
        init_sliding_window_cache(CONFIG, 1, WINDOW, 8),
        tokens,
        positions,
        [0, 10, 20],
    )
    # Back by slots - window + 1 = 4 tokens, then append 4 others: as if never appended.
    ring = ring.truncate(16)
    assert bool(ring.complete[0])
    new = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (1, 4)), jnp.int32)
    logits, _ = _apply(CONFIG, params, new, jnp.arange(16, 20, dtype=jnp.int32)[None], ring)
    sequence = np.concatenate([np.asarray(tokens[0, :16]), np.asarray(new[0])])
    expected = numpy_lm.forward(CONFIG, params, sequence, window=WINDOW)[16:]
    np.testing.assert_allclose(logits[0], expected, atol=1e-4)
    # By position: forget positions >= 18 of the 20 held, i.e. two tokens.
    _, again = _feed(
        CONFIG, params, init_sliding_window_cache(CONFIG, 1, WINDOW, 8), tokens, positions, [0, 20]
    )
    np.testing.assert_array_equal(again.truncate_at_position(18).lengths, [18])
    # Back by 5: the key at position 15 - window + 1 = 11 is gone.
    _, ring = _feed(
        CONFIG, params, init_sliding_window_cache(CONFIG, 1, WINDOW, 8), tokens, positions, [0, 20]
    )
    broken = ring.truncate(15)
    assert not bool(broken.complete[0])
    with pytest.raises(ValueError, match="keys the next query needs are gone"):
        lm.Transformer(CONFIG).apply({"params": params}, new[:, :1], jnp.array([[15]]), broken)
    logits, _ = _apply(CONFIG, params, new[:, :1], jnp.array([[15]], jnp.int32), broken)
    assert np.isnan(np.asarray(logits)).all()


def test_truncate_at_position_with_left_padding():
    config = lm.LMConfig.tiny(max_len=32)
    params = lm.random_params(config)
    tokens = jnp.ones((2, 8), jnp.int32)
    positions = jnp.array([[0, 1, 2, 3, 4, 5, 6, 7], [-1, -1, -1, 0, 1, 2, 3, 4]], jnp.int32)
    _, cache = _apply(config, params, tokens, positions, lm.init_cache(config, 2, 12))
    cut = cache.truncate_at_position(jnp.array([5, 2]))
    # Sequence 1 keeps its 3 padding slots and positions 0, 1: five slots.
    np.testing.assert_array_equal(cut.lengths, [5, 5])
    np.testing.assert_array_equal(cut.next_positions(), [5, 2])
    np.testing.assert_array_equal(cut.positions[1, :6], [-1, -1, -1, 0, 1, -1])
    # Position 0 forgets every real token.
    np.testing.assert_array_equal(cache.truncate_at_position(0).next_positions(), [0, 0])
    # Under jit, with a traced position.
    jitted = jax.jit(lambda c, p: c.truncate_at_position(p))(cache, jnp.array([7, 4]))
    np.testing.assert_array_equal(jitted.lengths, [7, 7])


def test_sliding_window_config_validation():
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        lm.LMConfig.tiny(sliding_window=0)
    with pytest.raises(ValueError, match="full_attention_layers must lie in"):
        lm.LMConfig.tiny(sliding_window=4, full_attention_layers=(2,))
    with pytest.raises(ValueError, match="needs a sliding_window"):
        lm.LMConfig.tiny(full_attention_layers=(0,))
    # Mixed windows scan in groups of their period (here the two layers themselves).
    mixed = lm.LMConfig.tiny(sliding_window=4, full_attention_layers=(0,), scan_layers=True)
    assert mixed.layer_period == 2
    assert lm.LMConfig.tiny(num_layers=6, sliding_window=4).layer_period == 1
    periodic = lm.LMConfig.tiny(num_layers=8, sliding_window=4, full_attention_layers=(2, 5))
    assert periodic.layer_period == 3  # and the last two layers outside the groups
    config = lm.LMConfig.tiny(sliding_window=4, full_attention_layers=[1])
    assert config.layer_window(0) == 4 and config.layer_window(1) is None
    assert lm.LMConfig.from_dict(config.to_dict()) == config
    full = lm.Transformer(lm.LMConfig.tiny())
    with pytest.raises(ValueError, match="needs a model whose layers all attend within a window"):
        full.apply(
            {"params": lm.random_params(lm.LMConfig.tiny())},
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            init_sliding_window_cache(lm.LMConfig.tiny(), 1, 4, 8),
        )
