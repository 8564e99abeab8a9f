"""The pruning baselines against a float64 numpy reference."""

import jax
import numpy as np
import pytest

from lhc.emloc import baselines

from ..support import forward
from .test_compress import CONFIG, MODEL, _examples, params  # noqa: F401


def test_snapkv_keeps_what_the_observation_window_attends_to_most(params):  # noqa: F811
    examples = _examples(3, seed=7)
    tokens = np.concatenate([e.tokens for e in examples])
    length, window, keep = tokens.size, 4, 0.4
    memory = baselines.snapkv_memory(MODEL, params, examples, keep, window=window, pool=3)
    probs = {}
    forward(
        CONFIG,
        jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params),
        tokens,
        probs=probs,
    )
    count = int(length * keep)
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    for layer in range(CONFIG.num_layers):
        scores = probs[layer][:, length - window :].sum(1)  # [N, C]
        scores = scores.reshape(CONFIG.num_kv_heads, group, length).sum(1)
        padded = np.pad(scores, ((0, 0), (1, 1)))
        scores = (padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]) / 3
        scores[:, length - window :] = np.inf
        expected = np.sort(np.argsort(-scores, axis=1, kind="stable")[:, :count], axis=1)
        held = np.sort(np.asarray(memory.positions[layer])[0], axis=1)
        held = held[held >= 0].reshape(CONFIG.num_kv_heads, -1)
        np.testing.assert_array_equal(held, expected)


def test_uniform_keeps_evenly_spaced_tokens_and_everything_at_one(params):  # noqa: F811
    examples = _examples(2, seed=8)
    memory = baselines.uniform_memory(MODEL, params, examples, 0.5)
    assert list(memory.sizes()) == [7] * CONFIG.num_layers
    held = np.asarray(memory.positions[0])[0, 0]
    np.testing.assert_array_equal(held[held >= 0], [0, 2, 4, 6, 9, 11, 13])
    whole = baselines.uniform_memory(MODEL, params, examples, 1.0)
    assert list(whole.sizes()) == [14] * CONFIG.num_layers
    with pytest.raises(ValueError, match="keep must be a ratio in"):
        baselines.uniform_memory(MODEL, params, examples, 0.0)
