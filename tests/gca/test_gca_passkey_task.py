"""configs/gca_passkey.py through the trainer: a few steps of the passkey task on GCA,
then the length x depth evaluation writing its table and heat map (one cell)."""

import json
import os

import pytest

from lhc.train import config as config_lib
from lhc.train import train_and_evaluate


@pytest.mark.slow
def test_passkey_config_trains_and_evaluates_gca(tmp_path):
    out = tmp_path / "eval"
    config = config_lib.load_config(
        "configs/gca_passkey.py:tiny,runlocal",
        [
            "num_steps=2",
            "batch_size=2",
            "data.length=128",
            "progress_bar=False",
            "eval_batches=1",
            # A smaller model than the config's, so that the test compiles quickly.
            "model.embed_dim=32",
            "model.num_heads=2",
            "model.num_kv_heads=2",
            "model.head_dim=16",
            "model.mlp_dim=64",
            "model.lower_layers=1",
            "model.upper_layers=(1,)",
            "model.chunk_size=16",
            "model.window=33",
            "tensorboard=False",
            "passkey_eval.lengths=(192,)",
            "passkey_eval.depths=(0.5,)",
            "passkey_eval.samples=2",
            "passkey_eval.batch_size=2",
            "passkey_eval.prefill_chunk=64",
            f"passkey_eval.output_dir={out}",
            f"passkey_eval.results={out / 'passkey.jsonl'}",
            "passkey_eval.label=gca-tiny",
            "model.retriever=no_grad",
        ],
    )
    summary = train_and_evaluate(config, str(tmp_path / "run"))
    assert 0 <= summary["eval/accuracy"] <= 1
    assert "passkey/accuracy/192/0.5" in summary
    # The raw record: each example's hit, whose mean is the table's accuracy.
    (record,) = [json.loads(line) for line in (out / "passkey.jsonl").read_text().splitlines()]
    assert record["label"] == "gca-tiny" and record["seed"] == 0 and len(record["hits"]) == 2
    assert summary["passkey/accuracy/192/0.5"] == sum(record["hits"]) / 2
    assert os.path.getsize(out / "passkey_heatmap.png") > 0
    assert "| 192 |" in (out / "passkey_table.md").read_text()


def test_lm_loss_weight_adds_every_tokens_loss_to_the_answers():
    import jax.numpy as jnp
    import numpy as np

    from lhc.train import build_experiment

    overrides = ["batch_size=2", "data.length=112", "data.lm_loss_weight=0.5"]
    config = config_lib.load_config("configs/gca_passkey.py:tiny,runlocal", overrides)
    task = build_experiment(config).task
    batch = next(task.train_iterator(0, 1))
    # The loss's arithmetic is under test, not the model: logits stand in for its output.
    logits = np.random.default_rng(0).normal(size=batch["targets"].shape + (260,))
    task._logits = lambda params, batch, rng: jnp.asarray(logits, jnp.float32)
    loss, metrics = task.loss(None, batch, None)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    answer = (nll * batch["weights"]).sum() / batch["weights"].sum()
    np.testing.assert_allclose(float(metrics["answer_loss"]), answer, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["lm_loss"]), nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), answer + 0.5 * nll.mean(), rtol=1e-5)
