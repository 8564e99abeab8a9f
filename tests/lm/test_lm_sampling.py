"""Sampling helpers against numpy implementations written the other way round."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm


def _numpy_top_p_keep(logits, top_p):
    """Hugging Face style: sort ascending, drop the low tail whose mass is <= 1 - top_p."""
    keep = np.zeros(logits.shape, bool)
    for row in range(logits.shape[0]):
        order = np.argsort(logits[row], kind="stable")
        probs = np.exp(logits[row] - logits[row].max())
        probs /= probs.sum()
        tail_mass = np.cumsum(probs[order])
        removed = tail_mass <= 1 - top_p
        removed[-1] = False  # the most likely token always stays
        keep[row, order[~removed]] = True
    return keep


def _numpy_top_k_keep(logits, top_k):
    keep = np.zeros(logits.shape, bool)
    for row in range(logits.shape[0]):
        kth = np.sort(logits[row])[::-1][top_k - 1]
        keep[row] = logits[row] >= kth
    return keep


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_mask_matches_sorted_cumsum(top_p):
    logits = np.random.default_rng(0).normal(size=(16, 50)).astype(np.float32) * 2
    got = np.asarray(lm.top_p_mask(jnp.asarray(logits), top_p))
    np.testing.assert_array_equal(got, _numpy_top_p_keep(logits.astype(np.float64), top_p))
    assert got.sum(-1).min() >= 1


@pytest.mark.parametrize("top_k", [1, 3, 49])
def test_top_k_mask_matches_numpy(top_k):
    logits = np.random.default_rng(1).normal(size=(3, 4, 50)).astype(np.float32)
    got = np.asarray(lm.top_k_mask(jnp.asarray(logits), top_k))
    np.testing.assert_array_equal(
        got.reshape(12, 50), _numpy_top_k_keep(logits.reshape(12, 50), top_k)
    )
    assert (got.sum(-1) == top_k).all()


def _numpy_probs(logits, temperature, top_k, top_p):
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.arange(len(logits)), logits.argmax(-1)] = 1
        return out
    scaled = logits / temperature
    if top_k:
        scaled = np.where(_numpy_top_k_keep(scaled, top_k), scaled, -np.inf)
    if top_p < 1:
        scaled = np.where(_numpy_top_p_keep(scaled, top_p), scaled, -np.inf)
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9)],
)
def test_logits_to_probs_matches_numpy(temperature, top_k, top_p):
    logits = np.random.default_rng(2).normal(size=(8, 40)).astype(np.float64) * 3
    sampling = lm.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = lm.logits_to_probs(jnp.asarray(logits, jnp.float32), sampling)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, _numpy_probs(logits, temperature, top_k, top_p), atol=1e-6)


def test_sample_tokens_frequencies_and_log_probs():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    sampling = lm.SamplingParams(temperature=1.0, top_k=4)
    draws = 20_000
    keys = jax.random.split(jax.random.key(0), draws)
    tokens, log_probs = jax.vmap(
        lambda k: lm.sample_tokens(k, jnp.asarray(logits, jnp.float32), sampling)
    )(keys)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=5) / draws
    expected = np.array([0.5, 0.2, 0.15, 0.1, 0.0]) / 0.95
    # Standard error of a frequency is at most 0.0036 here; allow ~4 sigma.
    np.testing.assert_allclose(counts, expected, atol=0.015)
    np.testing.assert_allclose(
        np.exp(np.asarray(log_probs)).ravel(), expected[np.asarray(tokens).ravel()], rtol=1e-5
    )
    greedy_tokens, greedy_lp = lm.sample_tokens(None, jnp.asarray(logits), lm.SamplingParams())
    assert int(greedy_tokens[0]) == 0 and float(greedy_lp[0]) == 0.0


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        lm.SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        lm.SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="top_p"):
        lm.SamplingParams(top_p=0.0)
    assert lm.SamplingParams().greedy
