"""Rollouts (return-to-go bookkeeping, windows) and the ``lhc train`` task of lhc.dm."""

import json
import os

import gymnasium as gym
import numpy as np
import pytest

from lhc.dm import rollout as rollout_lib
from lhc.dm.data import OfflineDataset, Trajectory, save_npz
from lhc.train.config import load_config
from lhc.train.trainer import train_and_evaluate


class CountingEnv(gym.Env):
    """States are the step index (2 features); reward 1 + step; ends after 7 steps."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        self.actions = []
        return np.array([0.0, 1.0], np.float32), {}

    def step(self, action):
        self.actions.append(np.asarray(action).copy())
        reward = 1.0 + self.t
        self.t += 1
        return np.array([self.t, 1.0], np.float32), reward, self.t == 7, False, {}


def test_rollout_feeds_returns_to_go_and_windows_as_in_training():
    env, seen = CountingEnv(), []

    def policy(inputs):
        seen.append({k: v.copy() for k, v in inputs.items()})
        return np.array([0.5], np.float32), []

    mean, std = np.array([1.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32)
    result = rollout_lib.rollout(
        env,
        policy,
        target_return=100.0,
        context=3,
        state_mean=mean,
        state_std=std,
        rtg_scale=10.0,
        max_ep_len=10,
        seed=0,
        action_scale=2.0,
    )
    assert result["length"] == 7 and result["episode_return"] == sum(1.0 + t for t in range(7))
    np.testing.assert_allclose(np.stack(env.actions), 1.0)  # 0.5 x the bound 2
    for t, inputs in enumerate(seen):
        real = min(t + 1, 3)
        steps = np.arange(t + 1 - real, t + 1)
        np.testing.assert_array_equal(inputs["mask"][0], [False] * (3 - real) + [True] * real)
        # Return to go at step s: the target minus the rewards received before s, / scale.
        expected_rtg = (100.0 - np.array([sum(1.0 + i for i in range(s)) for s in steps])) / 10.0
        np.testing.assert_allclose(inputs["returns_to_go"][0, 3 - real :, 0], expected_rtg)
        np.testing.assert_allclose(inputs["states"][0, 3 - real :, 0], (steps - 1.0) / 2.0)
        np.testing.assert_array_equal(inputs["timesteps"][0, 3 - real :], steps)
        # The actions already taken (model units), and 0 for the newest step.
        np.testing.assert_allclose(inputs["actions"][0, 3 - real : -1, 0], 0.5)
        assert inputs["actions"][0, -1, 0] == 0
        assert np.all(inputs["returns_to_go"][0, : 3 - real] == 0)


def _dataset(tmp_path, scale=2.0):
    rng = np.random.default_rng(0)
    trajectories = [
        Trajectory(
            rng.normal(size=(n, 3)).astype(np.float32),
            rng.uniform(-scale, scale, (n, 1)).astype(np.float32),
            rng.normal(size=n).astype(np.float32),
            terminal=False,
        )
        for n in (30, 50, 40)
    ]
    path = tmp_path / "pendulum-random.npz"
    save_npz(path, OfflineDataset.from_trajectories(trajectories))
    return str(path)


@pytest.mark.parametrize("model", ["dt", "dm"])
def test_training_and_rollouts_end_to_end(tmp_path, model):
    path = _dataset(tmp_path)
    results = tmp_path / "results.jsonl"
    config = load_config(
        f"configs/dm_gym.py:data={path},env=Pendulum-v1,model={model},runlocal=True,"
        f"results={results}"
    )
    config.progress_bar = False
    config.tensorboard = False
    summary = train_and_evaluate(config, str(tmp_path / model))
    assert summary["eval/length_mean"] == 200  # Pendulum's time limit
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert (record["model"], record["seed"], record["steps"], record["env"]) == (
        model,
        0,
        4,
        "Pendulum-v1",
    )
    assert record["dataset"] == os.path.splitext(os.path.basename(path))[0]
    assert record["returns"] == [pytest.approx(summary["eval/return_mean"], abs=0.01)]
    assert record["normalized"] is None  # no D4RL reference returns for Pendulum
    assert np.isfinite(summary["eval/return_mean"]) and np.isfinite(summary["eval/action_mse"])
    if model == "dm":
        assert 0 <= summary["eval/selected_tokens_0"] <= 12 and "train/aux_loss" in summary
    else:
        assert "eval/selected_tokens_0" not in summary


def test_actions_outside_the_environment_bounds_are_refused(tmp_path):
    path = _dataset(tmp_path, scale=2.0)
    config = load_config(
        f"configs/dm_gym.py:data={path},env=MountainCarContinuous-v0,runlocal=True"
    )
    config.progress_bar = False
    with pytest.raises(ValueError, match="config.data.path: actions reach"):
        train_and_evaluate(config, str(tmp_path / "bad"))
