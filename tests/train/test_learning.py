"""The tiny demo config really learns: associative recall far below chance level."""

import json
import math
import subprocess
import sys

import pytest

from lhc import train

from ..support import optimizing_env


@pytest.mark.slow
def test_tiny_config_learns_associative_recall(tmp_path):
    """``lhc train`` on the config, in its own process with XLA's optimising backend:
    its 1,200 steps take half the time they take with the suite's fast-compile flags."""
    command = [
        *(sys.executable, "-c", "import sys; from lhc.cli import run; sys.exit(run())"),
        *("train", "--config", "lm_assoc_recall.py:tiny", "--workdir", str(tmp_path)),
        *("--config.progress_bar=False", "--config.tensorboard=False"),
    ]
    proc = subprocess.run(command, env=optimizing_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    chance = math.log(16)  # the config's 16 values
    rows = [r for r in train.read_metrics(str(tmp_path)) if "train/loss" in r]
    assert rows[0]["train/loss"] > 0.8 * chance  # starts near chance ...
    assert summary["eval/chance_loss"] == pytest.approx(chance)
    assert summary["eval/loss"] < 0.25 * chance  # ... and ends far below it
    assert summary["eval/accuracy"] > 0.8  # chance: 1 / num_values
