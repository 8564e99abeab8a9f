"""configs/recurrent_passkey.py through the trainer: a few steps of the passkey task on
each recurrent LM (built by its model factory), then the passkey evaluation past the
training length, through the state cache."""

import pytest

from lhc.recurrent.factories import mamba2_from_config
from lhc.train import config as config_lib
from lhc.train import train_and_evaluate


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
