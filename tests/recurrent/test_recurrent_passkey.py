"""configs/recurrent_passkey.py through the trainer: a few steps of the passkey task on
each recurrent LM (built by its model factory), then the passkey evaluation past the
training length, through the state cache; training from noise initial states."""

import jax
import numpy as np
import pytest

from lhc.recurrent.factories import mamba2_from_config
from lhc.recurrent.task import noise_states
from lhc.train import build_experiment, train_and_evaluate
from lhc.train import config as config_lib


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mamba2", "gla"])
def test_passkey_config_trains_and_evaluates(tmp_path, model):
    config = config_lib.load_config(
        f"configs/recurrent_passkey.py:tiny,model={model},runlocal",
        [
            "num_steps=2", "batch_size=2", "data.length=128", "progress_bar=False",
            "eval_batches=1", "tensorboard=False", "model.num_layers=1",
            "passkey_eval.lengths=(160,)", "passkey_eval.depths=(0.5,)",
            "passkey_eval.samples=2", "passkey_eval.batch_size=2",
            "passkey_eval.prefill_chunk=64",
        ],
    )  # fmt: skip
    summary = train_and_evaluate(config, str(tmp_path / "run"))
    assert 0 <= summary["eval/accuracy"] <= 1
    assert 0 <= summary["passkey/accuracy/160/0.5"] <= 1


def test_an_unknown_model_field_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"config.model: \['heads'\] are not fields of Mamba2Config"
    ):
        mamba2_from_config({"vocab_size": 8, "heads": 2})


def test_noise_initial_state():
    config = config_lib.load_config(
        "configs/recurrent_passkey.py:tiny,model=mamba2,init=noise,noise_std=0.5,runlocal",
        ["batch_size=2", "data.length=128", "model.num_layers=1"],
    )
    exp = build_experiment(config)
    task = exp.task
    cache = noise_states(task.model.init_cache(64, rollback=0), jax.random.key(0), 0.5)
    ssm = np.asarray(cache.states["ssm"])
    assert abs(ssm.std() - 0.5) < 0.01 and abs(ssm.mean()) < 0.01
    assert not np.asarray(cache.states["conv"]).any()  # the convolution state stays zero
    params = task.init_params(jax.random.key(1))
    batch = next(task.train_iterator(0, 1))
    plain = task._logits(params, batch)  # no rng (evaluation): the zero state
    noisy = task._logits(params, batch, jax.random.key(2))
    assert np.abs(np.asarray(noisy) - np.asarray(plain)).max() > 1e-3
    with config.unlocked():
        config.initial_state.std = 0.0
    zero_noise = build_experiment(config).task._logits(params, batch, jax.random.key(2))
    np.testing.assert_allclose(zero_noise, plain, rtol=1e-5, atol=1e-5)
    with config.unlocked():
        config.initial_state.kind = "fitted"
    with pytest.raises(ValueError, match="config.initial_state.kind must be one of"):
        build_experiment(config).task._logits(params, batch, jax.random.key(2))
