"""Effective Remembrance and the loss by position against direct computations."""

import jax
import numpy as np
import pytest

from lhc.lm.config import LMConfig
from lhc.lm.model import Transformer
from lhc.lm.params import random_params
from lhc.recurrent.evaluation import (
    bucket_means,
    effective_remembrance,
    loss_by_position,
    plot_curves,
)

CONFIG = LMConfig(
    vocab_size=37,
    num_layers=2,
    embed_dim=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    max_len=64,
)
MODEL = Transformer(CONFIG)


def test_effective_remembrance_equals_running_each_suffix_alone():
    params = jax.tree.map(lambda x: 4 * x, random_params(CONFIG, seed=0))  # peaked predictions
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, size=19)
    starts = [0, 7, 17]
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


def test_loss_by_position_through_the_cache_equals_one_full_forward(tmp_path):
    params = random_params(CONFIG, seed=2)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(2, 40))
    got = loss_by_position(MODEL, params, tokens, chunk_size=16)  # chunks of 16, 16, 7
    logits, _ = MODEL.apply({"params": params}, tokens, np.broadcast_to(np.arange(40), (2, 40)))
    logits = np.asarray(logits, np.float64)[:, :-1]
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = log_z - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        bucket_means(got, [0, 10, 39]), [want[:, :10].mean(), want[:, 10:].mean()], rtol=1e-4
    )
    plot_curves(
        str(tmp_path / "ppl.png"),
        np.arange(39),
        {"model": np.exp(got.mean(0))},
        xlabel="position",
        ylabel="perplexity",
        title="perplexity by position",
    )
    assert (tmp_path / "ppl.png").stat().st_size > 1000
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\] with T >= 2"):
        loss_by_position(MODEL, params, tokens[:, :1])
