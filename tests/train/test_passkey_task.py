"""The passkey task with lengths that vary from ``data.min_length`` to ``data.length``."""

import jax.numpy as jnp
import numpy as np
import pytest

from lhc.lm import ByteTokenizer
from lhc.train import build_experiment
from lhc.train import config as config_lib


def _task(overrides, name="rapid_passkey.py"):
    config = config_lib.load_config(
        f"configs/{name}:tiny,runlocal", ["batch_size=6", "data.length=200", *overrides]
    )
    return build_experiment(config).task


def test_lengths_vary_and_padding_weighs_nothing():
    task = _task(["data.min_length=110"])
    batch = next(task.train_iterator(0, 1))
    pad = ByteTokenizer().pad_id
    assert batch["tokens"].shape == (6, 200)
    real = batch["lm_weights"].sum(1).astype(int)
    assert real.min() >= 110 and real.max() <= 200 and len(set(real.tolist())) > 1
    question = ByteTokenizer().encode("What is the pass key? The pass key is ")
    for row, n in enumerate(real):
        np.testing.assert_array_equal(batch["lm_weights"][row], np.arange(200) < n)
        assert (batch["tokens"][row, n:] == pad).all() and (batch["weights"][row, n:] == 0).all()
        # Each real part is a whole example: the answer's five digits end it.
        np.testing.assert_array_equal(np.flatnonzero(batch["weights"][row]), np.arange(n - 5, n))
        tokens = batch["tokens"][row, :n].tolist()
        assert tokens[n - 4 - len(question) : n - 4] == question  # the inputs lack the last digit
    # The loss of every token counts the real tokens only (logits stand in for the model).
    logits = np.random.default_rng(0).normal(size=batch["targets"].shape + (259,))
    task.config.unlock()
    task.config.data.lm_loss_weight = 1.0
    task._logits = lambda params, batch, rng: jnp.asarray(logits, jnp.float32)
    _, metrics = task.loss(None, batch, None)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["lm_weights"]
    np.testing.assert_allclose(
        float(metrics["lm_loss"]), (nll * mask).sum() / mask.sum(), rtol=1e-5
    )


def test_without_min_length_every_sequence_is_full():
    batch = next(_task([], "quantspec_passkey.py").train_iterator(0, 1))
    assert batch["lm_weights"].all() and batch["tokens"].shape == (6, 200)
    with pytest.raises(ValueError, match="min_length must lie in"):
        next(_task(["data.min_length=201"]).train_iterator(0, 1))
