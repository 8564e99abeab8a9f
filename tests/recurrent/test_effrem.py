"""Effective Remembrance against a direct computation, suffix by suffix."""

import jax
import numpy as np
import pytest

from lhc.lm.bench import random_params
from lhc.lm.config import LMConfig
from lhc.lm.model import Transformer
from lhc.recurrent.evaluation import effective_remembrance

CONFIG = LMConfig(
    vocab_size=37, num_layers=2, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16,
    mlp_dim=64, max_len=64,
)  # fmt: skip
MODEL = Transformer(CONFIG)


def test_effective_remembrance_equals_running_each_suffix_alone():
    params = jax.tree.map(lambda x: 4 * x, random_params(CONFIG, seed=0))  # peaked predictions
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, size=19)
    starts = [0, 1, 6, 12, 18]
    got = effective_remembrance(MODEL, params, tokens, starts, batch_size=3)

    def last(seq):  # the suffix alone, unpadded, positions from 0
        logits, _ = MODEL.apply({"params": params}, seq[None], np.arange(seq.size)[None])
        p = np.exp(np.asarray(logits[0, -1], np.float64))
        return p / p.sum()

    full = last(tokens)
    want = [0.5 * np.abs(full - last(tokens[t:])).sum() for t in starts]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got[0] == pytest.approx(0, abs=1e-6) and max(got) > 0.05  # the test can see a change


def test_bad_input_is_a_clear_error():
    params = random_params(CONFIG, seed=1)
    with pytest.raises(ValueError, match=r"starts must lie in \[0, T=4\), got \[4\]"):
        effective_remembrance(MODEL, params, [1, 2, 3, 4], [4])
    with pytest.raises(ValueError, match="tokens must be a non-empty 1-D sequence"):
        effective_remembrance(MODEL, params, [], [0])
