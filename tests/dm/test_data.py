"""Tests of the D4RL data layer; expected values come from plain loops written here."""

import numpy as np
import pytest

from lhc.dm.data import (
    REF_SCORES,
    OfflineDataset,
    SegmentSampler,
    Trajectory,
    load_d4rl,
    load_dataset,
    load_npz,
    normalized_score,
    returns_to_go,
    save_d4rl,
    save_npz,
)


def loop_returns_to_go(rewards, scale=1.0, gamma=1.0):
    """rtg[t] = sum_{t' >= t} gamma^(t' - t) r[t'] / scale, by a double loop."""
    rewards = [float(r) for r in rewards]
    out = []
    for t in range(len(rewards)):
        total = 0.0
        for later in range(t, len(rewards)):
            total += gamma ** (later - t) * rewards[later]
        out.append(total / scale)
    return out


def make_trajectory(rng, length, terminal, state_dim=3, action_dim=2, reward=None):
    rewards = rng.normal(size=length) if reward is None else np.full(length, reward)
    return Trajectory(
        observations=rng.normal(size=(length, state_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(length, action_dim)).astype(np.float32),
        rewards=rewards.astype(np.float32),
        terminal=terminal,
    )


def flat_dataset(rng, num_steps, terminals_at=(), timeouts_at=(), state_dim=3, action_dim=2):
    terminals = np.zeros(num_steps, bool)
    timeouts = np.zeros(num_steps, bool)
    terminals[list(terminals_at)] = True
    timeouts[list(timeouts_at)] = True
    return OfflineDataset(
        observations=rng.normal(size=(num_steps, state_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(num_steps, action_dim)).astype(np.float32),
        rewards=rng.normal(size=num_steps).astype(np.float32),
        terminals=terminals,
        timeouts=timeouts,
    )


@pytest.mark.parametrize("scale, gamma", [(1.0, 1.0), (1.0, 0.9), (1000.0, 1.0), (7.5, 0.9)])
def test_returns_to_go_matches_a_loop(scale, gamma):
    rewards = np.random.default_rng(0).normal(size=23).astype(np.float32)
    rtg = returns_to_go(rewards, scale=scale, gamma=gamma)
    assert rtg.dtype == np.float32 and rtg.shape == (23,)
    np.testing.assert_allclose(rtg, loop_returns_to_go(rewards, scale, gamma), rtol=1e-5, atol=1e-6)


def test_returns_to_go_bad_arguments():
    with pytest.raises(ValueError, match="rewards"):
        returns_to_go(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="gamma"):
        returns_to_go(np.zeros(3), gamma=1.5)
    with pytest.raises(ValueError, match="scale"):
        returns_to_go(np.zeros(3), scale=0.0)


def test_trajectories_split_at_terminals_timeouts_and_keep_the_trailing_episode():
    rng = np.random.default_rng(1)
    # Episodes: [0..3] terminal, [4..8] timeout, [9..9] terminal+timeout, [10..13] no flag.
    dataset = flat_dataset(rng, 14, terminals_at=(3, 9), timeouts_at=(8, 9))
    expected = [(0, 4, True), (4, 9, False), (9, 10, True), (10, 14, False)]
    trajectories = dataset.trajectories()
    assert len(trajectories) == len(expected)
    for trajectory, (start, end, terminal) in zip(trajectories, expected):
        np.testing.assert_array_equal(trajectory.observations, dataset.observations[start:end])
        np.testing.assert_array_equal(trajectory.actions, dataset.actions[start:end])
        np.testing.assert_array_equal(trajectory.rewards, dataset.rewards[start:end])
        assert trajectory.terminal is terminal

    returns = [sum(float(r) for r in dataset.rewards[start:end]) for start, end, _ in expected]
    np.testing.assert_allclose(dataset.returns(), returns, rtol=1e-6)

    observations = dataset.observations.astype(np.float64)
    mean, std = dataset.state_mean_std()
    for dim in range(observations.shape[1]):
        column = [float(x) for x in observations[:, dim]]
        column_mean = sum(column) / len(column)
        column_std = (sum((x - column_mean) ** 2 for x in column) / len(column)) ** 0.5
        assert mean[dim] == pytest.approx(column_mean, abs=1e-6)
        assert std[dim] == pytest.approx(column_std + 1e-6, rel=1e-6)


def test_from_trajectories_round_trip():
    rng = np.random.default_rng(2)
    trajectories = [
        make_trajectory(rng, 5, terminal=True),
        make_trajectory(rng, 1, terminal=False),
        make_trajectory(rng, 7, terminal=False),
        make_trajectory(rng, 3, terminal=True),
    ]
    dataset = OfflineDataset.from_trajectories(trajectories)
    assert dataset.observations.shape == (16, 3) and dataset.actions.shape == (16, 2)
    last_steps = [4, 5, 12, 15]
    assert np.flatnonzero(dataset.terminals).tolist() == [4, 15]
    assert np.flatnonzero(dataset.timeouts).tolist() == [5, 12]
    assert np.flatnonzero(dataset.terminals | dataset.timeouts).tolist() == last_steps

    again = dataset.trajectories()
    assert len(again) == len(trajectories)
    for original, restored in zip(trajectories, again):
        np.testing.assert_array_equal(restored.observations, original.observations)
        np.testing.assert_array_equal(restored.actions, original.actions)
        np.testing.assert_array_equal(restored.rewards, original.rewards)
        assert restored.terminal == original.terminal

    with pytest.raises(ValueError, match="trajectories"):
        OfflineDataset.from_trajectories([])


def test_validate_names_the_bad_key():
    rng = np.random.default_rng(3)
    dataset = flat_dataset(rng, 6)
    dataset.actions = dataset.actions[:5]
    with pytest.raises(ValueError, match="actions has 5 rows, expected 6"):
        dataset.validate()
    dataset = flat_dataset(rng, 6)
    dataset.observations = dataset.observations[:, 0]
    with pytest.raises(ValueError, match="observations must be 2-D"):
        dataset.validate()
    dataset = flat_dataset(rng, 6)
    dataset.rewards[2] = np.nan
    with pytest.raises(ValueError, match="rewards must be finite.*row 2"):
        dataset.validate()


def assert_same_dataset(loaded, original):
    for key in ("observations", "actions", "rewards", "terminals", "timeouts"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(original, key))
        assert getattr(loaded, key).dtype == getattr(original, key).dtype, key


def test_hdf5_and_npz_round_trip(tmp_path):
    dataset = flat_dataset(np.random.default_rng(4), 12, terminals_at=(4,), timeouts_at=(9,))
    save_d4rl(tmp_path / "data.hdf5", dataset)
    save_npz(tmp_path / "data.npz", dataset)
    assert_same_dataset(load_d4rl(tmp_path / "data.hdf5"), dataset)
    assert_same_dataset(load_npz(tmp_path / "data.npz"), dataset)
    assert_same_dataset(load_dataset(tmp_path / "data.hdf5"), dataset)
    assert_same_dataset(load_dataset(str(tmp_path / "data.npz")), dataset)
    with pytest.raises(ValueError, match="path"):
        load_dataset(tmp_path / "data.pkl")


def test_load_d4rl_reads_a_file_with_the_d4rl_extras(tmp_path):
    import h5py

    dataset = flat_dataset(np.random.default_rng(5), 8, timeouts_at=(3,))
    path = tmp_path / "hopper-medium-v2.hdf5"
    with h5py.File(path, "w") as file:
        for key in ("observations", "actions", "rewards", "terminals", "timeouts"):
            file.create_dataset(key, data=getattr(dataset, key))
        file.create_dataset("next_observations", data=dataset.observations)
        file.create_dataset("infos/qpos", data=np.zeros((8, 6)))
        file.create_dataset("metadata/algorithm", data="SAC")
    assert_same_dataset(load_d4rl(path), dataset)


def write_arrays(path, arrays):
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    else:
        import h5py

        with h5py.File(path, "w") as file:
            for key, value in arrays.items():
                file.create_dataset(key, data=value)


@pytest.mark.parametrize("suffix", [".hdf5", ".npz"])
def test_bad_files_name_the_key(tmp_path, suffix):
    dataset = flat_dataset(np.random.default_rng(6), 10)
    arrays = {key: getattr(dataset, key) for key in ("observations", "actions", "rewards")}
    arrays["terminals"] = dataset.terminals

    missing = tmp_path / f"missing{suffix}"
    write_arrays(missing, arrays)
    with pytest.raises(ValueError, match=r"missing.*'timeouts'"):
        load_dataset(missing)

    short = tmp_path / f"short{suffix}"
    write_arrays(short, {**arrays, "timeouts": dataset.timeouts, "actions": dataset.actions[:9]})
    with pytest.raises(ValueError, match=r"short.*actions has 9 rows, expected 10"):
        load_dataset(short)


REFERENCE = {
    "hopper": (-20.272305, 3234.3),
    "halfcheetah": (-280.178953, 12135.0),
    "walker2d": (1.629008, 4592.3),
}


@pytest.mark.parametrize(
    "env, family",
    [
        ("hopper", "hopper"),
        ("hopper-medium-v2", "hopper"),
        ("Hopper-v5", "hopper"),
        ("halfcheetah-medium-replay-v2", "halfcheetah"),
        ("HalfCheetah-v4", "halfcheetah"),
        ("walker2d-medium-expert-v2", "walker2d"),
        ("Walker2d-v5", "walker2d"),
    ],
)
def test_normalized_score_formula(env, family):
    assert REF_SCORES[family] == REFERENCE[family]
    low, high = REFERENCE[family]
    assert normalized_score(env, 1234.5) == pytest.approx(100 * (1234.5 - low) / (high - low))
    assert normalized_score(env, low) == pytest.approx(0.0, abs=1e-9)
    assert normalized_score(env, high) == pytest.approx(100.0)
    returns = np.array([[0.0, 500.0], [3000.0, -10.0]])
    expected = [[100 * (r - low) / (high - low) for r in row] for row in returns]
    np.testing.assert_allclose(normalized_score(env, returns), expected)


def test_normalized_score_unknown_env():
    with pytest.raises(ValueError, match="halfcheetah.*hopper.*walker2d.*ant-medium-v2"):
        normalized_score("ant-medium-v2", 100.0)


def normalise(observations, dataset_observations):
    """(x - mean) / (std + 1e-6) over the whole dataset, by columns."""
    flat = dataset_observations.astype(np.float64)
    mean = flat.sum(axis=0) / len(flat)
    std = np.sqrt(((flat - mean) ** 2).sum(axis=0) / len(flat)) + 1e-6
    return (observations - mean) / std


def test_segment_sampler_windows_come_from_trajectories():
    rng = np.random.default_rng(7)
    trajectories = [
        make_trajectory(rng, length, terminal=length % 2 == 0) for length in (3, 12, 25, 6)
    ]
    dataset = OfflineDataset.from_trajectories(trajectories)
    window, scale, max_ep_len = 8, 50.0, 20
    sampler = SegmentSampler(dataset, window, rtg_scale=scale, max_ep_len=max_ep_len)
    batch = sampler.sample(np.random.default_rng(8), 64)
    assert batch["states"].shape == (64, window, 3) and batch["states"].dtype == np.float32
    assert batch["actions"].shape == (64, window, 2)
    assert batch["rewards"].shape == batch["returns_to_go"].shape == (64, window, 1)
    assert batch["timesteps"].shape == batch["mask"].shape == (64, window)
    assert batch["timesteps"].dtype == np.int32

    saw_padding = saw_clipping = False
    for row in range(64):
        mask = batch["mask"][row]
        num_pad = int((mask == 0).sum())
        # Padding is on the left only.
        assert mask.tolist() == [0.0] * num_pad + [1.0] * (window - num_pad)
        saw_padding |= num_pad > 0
        states = batch["states"][row, num_pad:]
        matches = []
        for index, trajectory in enumerate(trajectories):
            normalised = normalise(trajectory.observations, dataset.observations)
            for start in range(len(trajectory.rewards) - len(states) + 1):
                if np.allclose(normalised[start : start + len(states)], states, atol=1e-5):
                    matches.append((index, start))
        assert len(matches) == 1, f"row {row}: {len(matches)} matching windows"
        index, start = matches[0]
        trajectory = trajectories[index]
        num_real = window - num_pad
        if num_pad:
            # A window is short only when it reaches the end of its trajectory.
            assert start + num_real == len(trajectory.rewards)
        end = start + num_real
        np.testing.assert_array_equal(
            batch["actions"][row, num_pad:], trajectory.actions[start:end]
        )
        np.testing.assert_array_equal(
            batch["rewards"][row, num_pad:, 0], trajectory.rewards[start:end]
        )
        true_rtg = loop_returns_to_go(trajectory.rewards, scale)[start:end]
        np.testing.assert_allclose(batch["returns_to_go"][row, num_pad:, 0], true_rtg, atol=1e-5)
        steps = [min(t, max_ep_len - 1) for t in range(start, end)]
        assert batch["timesteps"][row, num_pad:].tolist() == steps
        saw_clipping |= end > max_ep_len
        # Padding: rtg, rewards, actions and timesteps are 0.
        assert (batch["returns_to_go"][row, :num_pad] == 0).all()
        assert (batch["rewards"][row, :num_pad] == 0).all()
        assert (batch["actions"][row, :num_pad] == 0).all()
        assert (batch["timesteps"][row, :num_pad] == 0).all()
    assert saw_padding and saw_clipping

    again = sampler.sample(np.random.default_rng(8), 64)
    for key, value in batch.items():
        np.testing.assert_array_equal(again[key], value)


def test_segment_sampler_draws_trajectories_in_proportion_to_length():
    rng = np.random.default_rng(9)
    short = make_trajectory(rng, 10, terminal=True, reward=1.0)
    long = make_trajectory(rng, 90, terminal=False, reward=2.0)
    sampler = SegmentSampler([short, long], 5)
    batch = sampler.sample(np.random.default_rng(10), 2000)
    # The last position is never padding; its reward tells the trajectory apart.
    last_rewards = batch["rewards"][:, -1, 0]
    assert set(np.unique(last_rewards).tolist()) == {1.0, 2.0}
    assert abs(float(np.mean(last_rewards == 2.0)) - 0.9) < 0.05


def test_segment_sampler_bad_arguments():
    dataset = OfflineDataset.from_trajectories(
        [make_trajectory(np.random.default_rng(11), 4, True)]
    )
    with pytest.raises(ValueError, match="context_length"):
        SegmentSampler(dataset, 0)
    with pytest.raises(ValueError, match="state_mean"):
        SegmentSampler(dataset, 2, state_mean=np.zeros(5))
