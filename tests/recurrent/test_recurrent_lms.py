"""The recurrent LMs (Mamba-2, GLA) on the causal-LM protocol: incremental use of their
state cache equals one full forward pass; padding, truncation, generation and
speculative decoding."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.lm.cache import Cache
from lhc.lm.speculative import ModelDrafter, speculative_generate
from lhc.recurrent.config import GLAConfig, Mamba2Config
from lhc.recurrent.gla_lm import GLALM
from lhc.recurrent.mamba2 import Mamba2LM

MODELS = {
    "mamba2": Mamba2LM(
        Mamba2Config(
            vocab_size=41,
            num_layers=2,
            embed_dim=32,
            head_dim=8,
            state_dim=8,
            num_groups=2,
            chunk_size=4,
            rollback=5,
            max_len=128,
        )
    ),
    "gla": GLALM(
        GLAConfig(
            vocab_size=41,
            num_layers=2,
            embed_dim=32,
            num_heads=2,
            key_dim=8,
            value_dim=16,
            gate_rank=4,
            mlp_dim=48,
            chunk_size=4,
            rollback=5,
            max_len=128,
        )
    ),
}
PROMPTS = [[3, 9, 27, 17, 5, 25, 1, 30, 2], [5], [40, 1, 2, 7], [11, 13]]


def make_params(model, seed, scale=3.0):
    tokens = jnp.zeros((1, 1), jnp.int32)
    params = model.init(jax.random.key(seed), tokens, tokens)["params"]
    # Larger weights than at initialisation, so that predictions depend on the context.
    return jax.tree.map(lambda x: x * scale if x.ndim == 2 else x, nn.meta.unbox(params))


@functools.partial(jax.jit, static_argnums=0)
def full_logits(model, params, tokens, positions):
    return model.apply({"params": params}, tokens, positions)[0]


@functools.partial(jax.jit, static_argnums=0)
def apply(model, params, tokens, positions, cache):
    return model.apply({"params": params}, tokens, positions, cache)


def arange(batch, start, stop):
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (batch, stop - start))


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]


def test_cache_follows_the_protocol(model):
    cache = model.init_cache(2, 16)
    assert isinstance(cache, Cache) and cache.capacity is None


def test_calls_of_any_length_through_the_cache_equal_one_forward(model):
    """Appends of 9 (chunked head + token-by-token tail), 1 and 9 tokens."""
    params = make_params(model, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 41, (2, 19)), jnp.int32)
    want = full_logits(model, params, tokens, arange(2, 0, 19))
    cache, got, start = model.init_cache(2, 19), [], 0
    for size in (9, 1, 9):
        logits, cache = apply(
            model, params, tokens[:, start : start + size], arange(2, start, start + size), cache
        )
        got.append(logits)
        start += size
    np.testing.assert_allclose(jnp.concatenate(got, 1), want, rtol=2e-4, atol=2e-4)
    assert float(jnp.std(want[:, -1])) > 0.5  # the logits are far from flat


def test_padding_anywhere_leaves_the_state_alone(model):
    params = make_params(model, 1)
    row = jnp.asarray([[4, 8, 15, 16, 23, 1, 7]], jnp.int32)
    want = full_logits(model, params, row, arange(1, 0, 7))
    # The same tokens with padding before, between and after them, through the cache.
    layout = [-1, 0, 1, -1, -1, 2, 3, 4, -1, 5, 6, -1]
    tokens = jnp.asarray([[row[0, p] if p >= 0 else 0 for p in layout]], jnp.int32)
    positions = jnp.asarray([layout], jnp.int32)
    logits, cache = apply(model, params, tokens[:, :6], positions[:, :6], model.init_cache(1, 12))
    logits2, _ = apply(model, params, tokens[:, 6:], positions[:, 6:], cache)
    got = jnp.concatenate([logits, logits2], 1)[0, np.array(layout) >= 0]
    np.testing.assert_allclose(got, want[0], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(
        full_logits(model, params, tokens, positions)[0, np.array(layout) >= 0],
        want[0],
        rtol=2e-4,
        atol=2e-4,
    )


def test_truncation_within_the_rollback_equals_recomputation(model):
    params = make_params(model, 2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 41, (2, 12)), jnp.int32)
    _, cache = apply(model, params, tokens[:, :4], arange(2, 0, 4), model.init_cache(2, 12))
    _, cache = apply(
        model, params, tokens[:, 4:12], arange(2, 4, 12), cache
    )  # 8 tokens, rollback 5
    other = jnp.array([[1, 2], [3, 4]], jnp.int32)
    for keep in (12, 10, 7):  # 0, 2 and 5 tokens back
        logits, _ = apply(model, params, other, arange(2, keep, keep + 2), cache.truncate(keep))
        sequence = jnp.concatenate([tokens[:, :keep], other], axis=1)
        np.testing.assert_allclose(
            logits,
            full_logits(model, params, sequence, arange(2, 0, keep + 2))[:, keep:],
            rtol=2e-4,
            atol=2e-4,
        )
    np.testing.assert_array_equal(cache.truncate_at_position(jnp.array([9, 11])).lengths, [9, 11])
    logits, _ = apply(model, params, other, arange(2, 6, 8), cache.truncate(6))  # 6 back: gone
    assert np.isnan(np.asarray(logits)).all()


def greedy_by_recomputation(model, params, prompts, steps):
    sequences = [list(p) for p in prompts]
    for _ in range(steps):
        width = 24
        tokens = np.zeros((len(sequences), width), np.int32)
        positions = np.full((len(sequences), width), -1, np.int32)
        for b, seq in enumerate(sequences):  # left-padded
            tokens[b, width - len(seq) :] = seq
            positions[b, width - len(seq) :] = np.arange(len(seq))
        logits = np.asarray(full_logits(model, params, tokens, positions))[:, -1]
        for b, token in enumerate(logits.argmax(-1)):
            sequences[b].append(int(token))
    return np.array([s[len(p) :] for s, p in zip(sequences, prompts)])


def test_generation_and_speculative_decoding_equal_greedy_recomputation(model):
    params = make_params(model, 3)
    want = greedy_by_recomputation(model, params, PROMPTS, 8)
    assert len(np.unique(want)) > 4
    out = lm.generate(model, params, PROMPTS, max_new_tokens=8, prefill_chunk=4)
    np.testing.assert_array_equal(out.tokens, want)
    noise = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(5), x.shape), params)
    spec = speculative_generate(
        model,
        params,
        ModelDrafter(model, refeed=True),
        noise,
        PROMPTS,
        max_new_tokens=8,
        num_draft=3,
    )
    np.testing.assert_array_equal(spec.tokens, want)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="must be a multiple of head_dim"):
        Mamba2Config(vocab_size=8, embed_dim=12, head_dim=16)
    with pytest.raises(ValueError, match="rollback must be an int >= 0"):
        Mamba2Config(vocab_size=8, rollback=-1)
    with pytest.raises(ValueError, match="GLAConfig.key_dim must be a positive int, got 0"):
        GLAConfig(vocab_size=8, key_dim=0)


def test_a_training_cache_without_rollback_carries_any_initial_state(model):
    """A rollback-0 cache holding random states (what noise initialisation and state
    passing start from): two calls through it equal one call through a cache with the
    default rollback (its chunked head and stepped tail) from the same states."""
    params = make_params(model, 4)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 41, (2, 19)), jnp.int32)
    r = np.random.default_rng(3)

    def start(cache):
        states = {
            k: v.at[:, :, 0].set(r.normal(size=v[:, :, 0].shape)) for k, v in cache.states.items()
        }
        return cache.replace(states=states)

    light = start(model.init_cache(2, rollback=0))
    assert all(v.shape[2] == 1 for v in light.states.values())
    full = model.init_cache(2)
    full = full.replace(
        states={k: v.at[:, :, 0].set(light.states[k][:, :, 0]) for k, v in full.states.items()}
    )
    want, _ = apply(model, params, tokens, arange(2, 0, 19), full)
    first, light = apply(model, params, tokens[:, :9], arange(2, 0, 9), light)
    second, _ = apply(model, params, tokens[:, 9:], arange(2, 9, 19), light)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), want, rtol=2e-4, atol=2e-4)
    zero, _ = apply(model, params, tokens, arange(2, 0, 19), model.init_cache(2))
    assert not np.allclose(zero, want, atol=1e-2)  # the initial state matters
