"""Generation against step-by-step full forward passes without a cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm

from ..support import random_params

CONFIG = lm.LMConfig.tiny(vocab_size=64, max_len=64)
WIDTH = 32  # fixed width of the reference forward passes: one compile
# Random weights this large make the next-token distributions peaked and the argmax
# unambiguous.
SCALE = 0.5


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(config, params, tokens, lengths):
    """Full forward without a cache on right-padded sequences; logits at each last token."""
    positions = jnp.arange(tokens.shape[1])[None, :]
    positions = jnp.where(positions < lengths[:, None], positions, -1)
    logits, _ = lm.Transformer(config).apply({"params": params}, tokens, positions)
    return logits[jnp.arange(tokens.shape[0]), lengths - 1]


def _reference_decode(config, params, prompts, steps, sampling=None, tokens_given=None):
    """Greedy decoding by recomputing the whole sequence each step (or scoring given tokens).

    Returns tokens [B, steps], model log-probs [B, steps], processed probs of the chosen
    tokens [B, steps].
    """
    batch = len(prompts)
    sequences = [list(p) for p in prompts]
    tokens_out = np.zeros((batch, steps), np.int64)
    log_probs = np.zeros((batch, steps))
    processed = np.zeros((batch, steps))
    for step in range(steps):
        padded = np.zeros((batch, WIDTH), np.int32)
        for b, seq in enumerate(sequences):
            padded[b, : len(seq)] = seq
        lengths = np.array([len(s) for s in sequences], np.int32)
        logits = np.asarray(
            _last_logits(config, params, jnp.asarray(padded), jnp.asarray(lengths)), np.float64
        )
        lp = logits - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        if tokens_given is None:
            chosen = logits.argmax(-1)
        else:
            chosen = tokens_given[:, step]
        if sampling is not None:
            probs = np.asarray(lm.logits_to_probs(jnp.asarray(logits, jnp.float32), sampling))
            processed[:, step] = probs[np.arange(batch), chosen]
        tokens_out[:, step] = chosen
        log_probs[:, step] = lp[np.arange(batch), chosen]
        for b in range(batch):
            sequences[b].append(int(chosen[b]))
    return tokens_out, log_probs, processed


PROMPTS = [[5, 9, 1, 33, 2, 7], [12], [40, 41, 42]]


def test_greedy_generation_matches_recomputation_and_padding_is_invisible():
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    steps = 12
    out = lm.generate(model, params, PROMPTS, max_new_tokens=steps)
    expected_tokens, expected_log_probs, _ = _reference_decode(CONFIG, params, PROMPTS, steps)
    np.testing.assert_array_equal(out.tokens, expected_tokens)
    np.testing.assert_allclose(out.log_probs, expected_log_probs, atol=1e-4)
    np.testing.assert_array_equal(out.lengths, [steps] * 3)
    assert out.tokens.dtype == jnp.int32 and out.log_probs.dtype == jnp.float32
    np.testing.assert_array_equal(out.sampling_log_probs, 0.0)
    # The returned cache holds the prompt and every generated token but the last (never
    # fed), each at its position; the prompts were left-padded to a bucketed width.
    width = lm.bucket_length(6)
    fed = width + steps - 1
    np.testing.assert_array_equal(out.cache.lengths, [fed] * 3)
    np.testing.assert_array_equal(out.cache.positions[1, : width - 1], -1)
    np.testing.assert_array_equal(out.cache.positions[1, width - 1 : fed], np.arange(steps))
    np.testing.assert_array_equal(out.next_positions, [6 + steps - 1, steps, 3 + steps - 1])

    # A left-padded array with explicit lengths is the same input.
    tokens, lengths = lm.left_pad(PROMPTS, pad_id=3)
    again = lm.generate(model, params, tokens, lengths, max_new_tokens=steps, pad_id=3)
    np.testing.assert_array_equal(again.tokens, out.tokens)


def test_stop_tokens_end_each_sequence():
    params = random_params(CONFIG, scale=SCALE)
    steps = 10
    expected, _, _ = _reference_decode(CONFIG, params, PROMPTS, steps)
    # Stop on the token sequence 0 emits at step 3, unless it appears earlier elsewhere.
    stop = int(expected[0, 3])
    out = lm.generate(
        lm.Transformer(CONFIG),
        params,
        PROMPTS,
        max_new_tokens=steps,
        stop_tokens=(stop,),
        pad_id=63,
    )
    for b in range(3):
        hits = np.flatnonzero(expected[b] == stop)
        length = int(hits[0]) + 1 if len(hits) else steps
        assert int(out.lengths[b]) == length
        np.testing.assert_array_equal(out.tokens[b, :length], expected[b, :length])
        np.testing.assert_array_equal(out.tokens[b, length:], 63)
        np.testing.assert_array_equal(out.log_probs[b, length:], 0.0)
    assert int(out.lengths[0]) <= 4


def test_sampled_tokens_come_from_the_processed_distribution():
    params = random_params(CONFIG, seed=1, scale=SCALE)
    steps = 8
    sampling = lm.SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    out = lm.generate(
        lm.Transformer(CONFIG),
        params,
        PROMPTS,
        max_new_tokens=steps,
        sampling=sampling,
        rng=jax.random.key(3),
    )
    tokens = np.asarray(out.tokens)
    _, log_probs, processed = _reference_decode(
        CONFIG, params, PROMPTS, steps, sampling=sampling, tokens_given=tokens
    )
    assert (processed > 0).all()  # every token lies inside the top-k/top-p support
    np.testing.assert_allclose(np.exp(out.sampling_log_probs), processed, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(out.log_probs, log_probs, atol=1e-4)
    # Different keys give different samples; the same key gives the same ones.
    again = lm.generate(
        lm.Transformer(CONFIG),
        params,
        PROMPTS,
        max_new_tokens=steps,
        sampling=sampling,
        rng=jax.random.key(3),
    )
    np.testing.assert_array_equal(again.tokens, tokens)
    other = lm.generate(
        lm.Transformer(CONFIG),
        params,
        PROMPTS,
        max_new_tokens=steps,
        sampling=sampling,
        rng=jax.random.key(4),
    )
    assert (np.asarray(other.tokens) != tokens).any()


def test_generate_validation():
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    with pytest.raises(ValueError, match="exceeds the model's max_len 64"):
        lm.generate(model, params, [[1] * 60], max_new_tokens=5)
    with pytest.raises(ValueError, match="rng is required"):
        lm.generate(
            model, params, PROMPTS, max_new_tokens=2, sampling=lm.SamplingParams(temperature=1.0)
        )
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        lm.generate(model, params, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_lengths"):
        lm.generate(model, params, np.ones((2, 4), np.int32), np.array([0, 4]), max_new_tokens=2)
    with pytest.raises(ValueError, match="vocab_size"):
        lm.generate(model, params, [[1, 64]], max_new_tokens=2)
    with pytest.raises(ValueError, match="cache_len 4 is too small"):
        lm.generate(model, params, [[1, 2]], max_new_tokens=4, cache_len=4)


def test_left_pad_and_positions():
    tokens, lengths = lm.left_pad([[1, 2, 3], [4]], pad_id=9)
    np.testing.assert_array_equal(tokens, [[1, 2, 3], [9, 9, 4]])
    np.testing.assert_array_equal(lengths, [3, 1])
    np.testing.assert_array_equal(
        lm.left_padded_positions(jnp.asarray(lengths), 4), [[-1, 0, 1, 2], [-1, -1, -1, 0]]
    )
