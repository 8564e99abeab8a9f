"""The tiny demo config really learns: associative recall far below chance level."""

import math

import pytest

from lhc import train
from lhc.train import config as config_lib


@pytest.mark.slow
def test_tiny_config_learns_associative_recall(tmp_path):
    config = config_lib.load_config(
        "lm_assoc_recall.py:tiny", ["progress_bar=False", "tensorboard=False"]
    )
    summary = train.train_and_evaluate(config, str(tmp_path))
    chance = math.log(config.data.num_values)
    rows = [r for r in train.read_metrics(str(tmp_path)) if "train/loss" in r]
    assert rows[0]["train/loss"] > 0.8 * chance  # starts near chance ...
    assert summary["eval/chance_loss"] == pytest.approx(chance)
    assert summary["eval/loss"] < 0.25 * chance  # ... and ends far below it
    assert summary["eval/accuracy"] > 0.8  # chance: 1 / num_values
