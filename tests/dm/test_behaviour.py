"""Tests of the SAC behaviour agent and the D4RL-style collection.

Expected values come from numpy written here (networks, log-densities, targets) and from
replaying the logged actions in a fresh gymnasium environment.
"""

import json
import os

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

from lhc.dm.config import SACConfig
from lhc.dm.data import complete_episode_returns, concatenate_datasets, load_d4rl
from lhc.dm.datasets import DATASET_NAMES, make_d4rl_datasets
from lhc.dm.recipe import collect, random_policy, train_sac
from lhc.dm.sac import (
    ReplayBuffer,
    create_sac_state,
    critic_target,
    polyak_update,
    sac_update,
    scale_action,
    squashed_gaussian_sample,
    unscale_action,
)

TINY = SACConfig(hidden_sizes=(16, 16), initial_alpha=0.3, gamma=0.9)


def numpy_mlp(params, inputs):
    """ReLU MLP from flax ``hidden_i`` / ``output`` Dense params, in float64."""
    hidden = np.asarray(inputs, np.float64)
    layer = 0
    while f"hidden_{layer}" in params:
        dense = params[f"hidden_{layer}"]
        hidden = np.maximum(hidden @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"]), 0)
        layer += 1
    return hidden @ np.asarray(params["output"]["kernel"]) + np.asarray(params["output"]["bias"])


def numpy_squashed_gaussian(mean, log_std, noise):
    pre_tanh = mean + np.exp(log_std) * noise
    log_density = norm.logpdf(pre_tanh, loc=mean, scale=np.exp(log_std))
    log_prob = np.sum(log_density - np.log(1.0 - np.tanh(pre_tanh) ** 2), axis=-1)
    return np.tanh(pre_tanh), log_prob


def replay(env_id, dataset_rows, seed, env_kwargs=None):
    """Steps a fresh env (reset with ``seed`` once, then unseeded) with logged actions.

    Yields per step ``(observation, reward, terminated, truncated, next_observation)``.
    """
    env = gym.make(env_id, **(env_kwargs or {}))
    observation, _ = env.reset(seed=seed)
    for action in dataset_rows:
        next_observation, reward, terminated, truncated, _ = env.step(action)
        yield observation, reward, terminated, truncated, next_observation
        observation = next_observation
        if terminated or truncated:
            observation, _ = env.reset()


def test_squashed_gaussian_log_prob_matches_numpy():
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(5, 3))
    log_std = rng.uniform(-2, 1, size=(5, 3))
    noise = rng.normal(size=(5, 3))
    action, log_prob = squashed_gaussian_sample(
        jnp.asarray(mean, jnp.float32),
        jnp.asarray(log_std, jnp.float32),
        jnp.asarray(noise, jnp.float32),
    )
    expected_action, expected_log_prob = numpy_squashed_gaussian(mean, log_std, noise)
    np.testing.assert_allclose(action, expected_action, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log_prob, expected_log_prob, rtol=1e-4, atol=1e-4)


def test_critic_target_matches_numpy():
    observation_dim, action_dim, batch_size = 3, 2, 4
    state = create_sac_state(TINY, observation_dim, action_dim, jax.random.PRNGKey(0))
    # Targets different from the online critics, so using the wrong ones would show.
    other = create_sac_state(TINY, observation_dim, action_dim, jax.random.PRNGKey(1))
    state = state.replace(target_critic_params=other.critic_params)
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=batch_size).astype(np.float32)
    next_observations = rng.normal(size=(batch_size, observation_dim)).astype(np.float32)
    dones = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    next_noise = rng.normal(size=(batch_size, action_dim)).astype(np.float32)

    target = critic_target(state, rewards, next_observations, dones, next_noise)

    actor_out = numpy_mlp(state.actor_params["params"]["mlp"], next_observations)
    mean, log_std = actor_out[:, :action_dim], np.clip(actor_out[:, action_dim:], -20, 2)
    next_actions, next_log_prob = numpy_squashed_gaussian(mean, log_std, next_noise)
    critic_inputs = np.concatenate([next_observations, next_actions], axis=1)
    target_params = state.target_critic_params["params"]
    q1 = numpy_mlp(target_params["q1"], critic_inputs)[:, 0]
    q2 = numpy_mlp(target_params["q2"], critic_inputs)[:, 0]
    expected = rewards + 0.9 * (1 - dones) * (np.minimum(q1, q2) - 0.3 * next_log_prob)
    assert target.shape == (batch_size,)
    np.testing.assert_allclose(target, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(target[dones == 1], rewards[dones == 1], rtol=1e-6)


def test_polyak_update_matches_formula():
    target = {"a": np.array([1.0, 2.0]), "b": {"c": np.array(-3.0)}}
    online = {"a": np.array([5.0, 0.0]), "b": {"c": np.array(1.0)}}
    updated = polyak_update(target, online, 0.25)
    np.testing.assert_allclose(updated["a"], 0.25 * online["a"] + 0.75 * target["a"])
    np.testing.assert_allclose(updated["b"]["c"], 0.25 * 1.0 + 0.75 * -3.0)


def test_sac_update_moves_targets_by_polyak_and_stays_finite():
    state = create_sac_state(TINY, 3, 2, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    batch = {
        "observations": rng.normal(size=(8, 3)).astype(np.float32),
        "actions": rng.uniform(-1, 1, size=(8, 2)).astype(np.float32),
        "rewards": rng.normal(size=8).astype(np.float32),
        "next_observations": rng.normal(size=(8, 3)).astype(np.float32),
        "dones": np.array([0, 1] * 4, np.float32),
    }
    new_state, metrics = sac_update(state, batch, jax.random.PRNGKey(2))
    assert int(new_state.step) == 1
    np.testing.assert_allclose(metrics["alpha"], 0.3, rtol=1e-6)
    assert all(np.isfinite(float(value)) for value in metrics.values())
    expected_targets = jax.tree.map(
        lambda old, new: TINY.tau * new + (1 - TINY.tau) * old,
        state.target_critic_params,
        new_state.critic_params,
    )
    for got, want in zip(
        jax.tree.leaves(new_state.target_critic_params), jax.tree.leaves(expected_targets)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    changed = jax.tree.map(
        lambda old, new: not np.allclose(old, new), state.actor_params, new_state.actor_params
    )
    assert all(jax.tree.leaves(changed))


def test_replay_buffer_is_circular_and_ordered():
    buffer = ReplayBuffer(capacity=4, observation_dim=1, action_dim=1)
    for index in range(6):
        buffer.add([index], [0.0], float(index), [index + 1], index == 3, index == 5)
    assert len(buffer) == 4
    transitions = buffer.transitions()
    np.testing.assert_array_equal(transitions["rewards"], [2, 3, 4, 5])
    np.testing.assert_array_equal(transitions["dones"], [False, True, False, False])
    np.testing.assert_array_equal(transitions["timeouts"], [False, False, False, True])
    batch = buffer.sample(np.random.default_rng(0), 32)
    assert batch["observations"].shape == (32, 1) and batch["dones"].dtype == np.float32
    assert set(batch["rewards"].tolist()) <= {2.0, 3.0, 4.0, 5.0}
    np.testing.assert_array_equal(batch["next_observations"][:, 0], batch["rewards"] + 1)


def test_action_scaling_round_trips():
    low, high = np.array([-2.0, 0.0]), np.array([2.0, 1.0])
    np.testing.assert_allclose(scale_action(np.array([-1.0, 1.0]), low, high), [-2.0, 1.0])
    np.testing.assert_allclose(scale_action(np.array([0.0, 0.0]), low, high), [0.0, 0.5])
    action = np.array([0.3, -0.7])
    np.testing.assert_allclose(unscale_action(scale_action(action, low, high), low, high), action)


def test_collect_pendulum_timeout_at_time_limit():
    dataset = collect("Pendulum-v1", random_policy("Pendulum-v1", seed=0), num_steps=300, seed=3)
    dataset.validate()
    assert dataset.observations.shape == (300, 3) and dataset.actions.shape == (300, 1)
    assert not dataset.terminals.any()
    np.testing.assert_array_equal(np.flatnonzero(dataset.timeouts), [199])
    assert np.abs(dataset.actions).max() <= 2.0
    # One complete episode (the TimeLimit's 200 steps) and a 100-step tail without a flag.
    assert dataset.episode_bounds() == [(0, 200), (200, 300)]
    rows = list(replay("Pendulum-v1", dataset.actions, seed=3))
    np.testing.assert_allclose(dataset.observations, [row[0] for row in rows], rtol=1e-6)
    np.testing.assert_allclose(dataset.rewards, [row[1] for row in rows], rtol=1e-5)
    np.testing.assert_array_equal(dataset.timeouts, [row[3] for row in rows])
    np.testing.assert_allclose(
        complete_episode_returns(dataset), [sum(row[1] for row in rows[:200])], rtol=1e-5
    )


def test_collect_hopper_terminals_and_timeouts_match_env():
    env_kwargs = {"max_episode_steps": 40}
    dataset = collect(
        "Hopper-v5",
        random_policy("Hopper-v5", seed=0),
        num_episodes=6,
        seed=0,
        env_kwargs=env_kwargs,
    )
    dataset.validate()
    rows = list(replay("Hopper-v5", dataset.actions, seed=0, env_kwargs=env_kwargs))
    terminated = np.array([row[2] for row in rows])
    truncated = np.array([row[3] for row in rows])
    np.testing.assert_array_equal(dataset.terminals, terminated)
    np.testing.assert_array_equal(dataset.timeouts, truncated & ~terminated)
    assert dataset.terminals.any() and dataset.timeouts.any()
    # Episodes split where the env ended them, with the env's own returns.
    env_returns, running = [], 0.0
    for row in rows:
        running += row[1]
        if row[2] or row[3]:
            env_returns.append(running)
            running = 0.0
    np.testing.assert_allclose(dataset.returns(), env_returns, rtol=1e-5)
    assert len(dataset.trajectories()) == 6
    assert all(len(t.rewards) <= 40 for t in dataset.trajectories())


def test_collect_rejects_both_lengths():
    with pytest.raises(ValueError, match="exactly one of num_steps and num_episodes"):
        collect("Pendulum-v1", random_policy("Pendulum-v1"), num_steps=5, num_episodes=1)


def test_train_loop_dones_come_from_terminated_only():
    env_kwargs = {"max_episode_steps": 40}
    # start_steps = steps: random actions only, no update (nothing to compile).
    _, _, buffer, log = train_sac(
        "Hopper-v5", 200, seed=4, start_steps=200, config=TINY, env_kwargs=env_kwargs
    )
    transitions = buffer.transitions()
    low, high = np.full(3, -1.0), np.full(3, 1.0)
    env_actions = [scale_action(action, low, high) for action in transitions["actions"]]
    rows = list(replay("Hopper-v5", env_actions, seed=4, env_kwargs=env_kwargs))
    terminated = np.array([row[2] for row in rows])
    truncated = np.array([row[3] for row in rows])
    np.testing.assert_array_equal(transitions["dones"], terminated)
    np.testing.assert_array_equal(transitions["timeouts"], truncated & ~terminated)
    assert terminated.any() and (truncated & ~terminated).any()
    # A truncated step keeps its true next observation (to bootstrap from), not a reset.
    np.testing.assert_allclose(
        transitions["next_observations"], [row[4] for row in rows], rtol=1e-6
    )
    ends = np.flatnonzero(terminated | truncated) + 1
    np.testing.assert_array_equal(log.episode_end_steps, ends)
    np.testing.assert_allclose(
        log.episode_returns,
        [transitions["rewards"][start:end].sum() for start, end in zip([0, *ends[:-1]], ends)],
        rtol=1e-5,
    )


def test_train_sac_pendulum_returns_requested_snapshots():
    state, snapshots, buffer, log = train_sac(
        "Pendulum-v1",
        300,
        seed=0,
        config=TINY,
        start_steps=100,
        batch_size=32,
        checkpoints=(150, 300),
        env_kwargs={"max_episode_steps": 100},
        log_every=100,
    )
    assert sorted(snapshots) == [150, 300]
    assert int(state.step) == 201  # one update per step from step 100 on
    for got, want in zip(jax.tree.leaves(snapshots[300]), jax.tree.leaves(state.actor_params)):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(
        snapshots[150]["params"]["mlp"]["output"]["kernel"],
        snapshots[300]["params"]["mlp"]["output"]["kernel"],
    )
    transitions = buffer.transitions()
    assert len(buffer) == 300 and not transitions["dones"].any()
    np.testing.assert_array_equal(np.flatnonzero(transitions["timeouts"]) + 1, [100, 200, 300])
    assert log.episode_end_steps == [100, 200, 300]
    assert [step for step, _ in log.metrics] == [100, 200, 300]
    assert np.abs(transitions["actions"]).max() <= 1.0


def test_a_stopped_sac_run_continues_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """Stopped by an error after its first save (at the first episode end after step
    120: Pendulum's episodes end every 100 steps), the run continues from the save and
    ends with the uninterrupted run's agent, buffer, snapshots and log; run again
    finished, it returns at once. A buffer smaller than the run (it wraps) resumes in
    place too."""
    from lhc.dm import recipe

    settings = dict(
        seed=1, config=TINY, start_steps=60, batch_size=32, checkpoints=(150, 350),
        env_kwargs={"max_episode_steps": 100}, log_every=50, buffer_capacity=250,
    )  # fmt: skip
    want = train_sac("Pendulum-v1", 350, **settings)
    make_env, steps_taken, stop_at = recipe._make_env, [], [260]

    def counting_env(*args):
        env = make_env(*args)
        step = env.step

        def counted(action):
            steps_taken.append(1)
            if len(steps_taken) in stop_at:
                raise KeyboardInterrupt
            return step(action)

        env.step = counted
        return env

    monkeypatch.setattr(recipe, "_make_env", counting_env)
    folder = str(tmp_path / "sac")
    with pytest.raises(KeyboardInterrupt):
        train_sac("Pendulum-v1", 350, checkpoint_dir=folder, checkpoint_every=120, **settings)
    # The first attempt stopped in its 260th step, after its save at step 200 (the first
    # episode end after 120); the second makes the 150 steps left.
    steps_taken.clear()
    stop_at.clear()
    got = train_sac("Pendulum-v1", 350, checkpoint_dir=folder, checkpoint_every=120, **settings)
    assert len(steps_taken) == 150 and got[3].wall_seconds > 0
    for tree_want, tree_got in zip(want[:2], got[:2]):
        for a, b in zip(jax.tree.leaves(tree_want), jax.tree.leaves(tree_got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(want[2].observations, got[2].observations)
    np.testing.assert_array_equal(want[2].transitions()["rewards"], got[2].transitions()["rewards"])
    for field in ("episode_end_steps", "episode_returns", "episode_lengths", "metrics"):
        assert getattr(want[3], field) == getattr(got[3], field), field
    again = train_sac("Pendulum-v1", 350, checkpoint_dir=folder, checkpoint_every=120, **settings)
    assert len(steps_taken) == 150  # finished: no step made
    np.testing.assert_array_equal(np.asarray(again[0].log_alpha), np.asarray(want[0].log_alpha))
    with pytest.raises(ValueError, match=r"checkpoint_dir: .* other settings \(seed\)"):
        train_sac("Pendulum-v1", 350, checkpoint_dir=folder, **dict(settings, seed=2))


def test_concatenate_flags_a_cut_off_tail():
    first = collect("Pendulum-v1", random_policy("Pendulum-v1"), num_steps=250, seed=0)
    second = collect("Pendulum-v1", random_policy("Pendulum-v1"), num_steps=50, seed=1)
    merged = concatenate_datasets([first, second])
    assert len(merged.rewards) == 300
    assert merged.episode_bounds() == [(0, 200), (200, 250), (250, 300)]


def test_make_d4rl_datasets_tiny(tmp_path):
    # Snapshots at 100 (before the first update, at step 100), 200 and 300 (the expert):
    # 200 is the only candidate for medium.
    summary = make_d4rl_datasets(
        "Pendulum-v1",
        tmp_path,
        sac_steps=300,
        dataset_steps=250,
        seed=0,
        config=TINY,
        start_steps=100,
        batch_size=32,
        num_snapshots=3,
        eval_episodes=1,
    )
    assert summary["evaluation"]["medium_step"] == 200
    assert list(summary["evaluation"]["snapshots"]) == ["200"]
    sizes = {"random": 250, "medium": 250, "medium-replay": 200, "expert": 250}
    sizes["medium-expert"] = 500
    for name in DATASET_NAMES:
        dataset = load_d4rl(os.path.join(tmp_path, f"pendulum-{name}.hdf5"))
        assert len(dataset.rewards) == sizes[name], name
        assert summary["datasets"][name]["num_steps"] == sizes[name]
    with open(os.path.join(tmp_path, "pendulum-returns.json")) as handle:
        written = json.load(handle)
    assert written["datasets"]["medium-expert"]["num_episodes"] == 2
    assert "normalized_mean" not in written["datasets"]["random"]
