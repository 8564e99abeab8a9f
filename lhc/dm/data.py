"""Offline RL data for Decision Transformer / Decision Mixer: D4RL gym locomotion.

The flat D4RL layout (one row per environment step, episodes back to back) is held by
``OfflineDataset``; ``trajectories()`` splits it into episodes the way D4RL's
``sequence_dataset`` does: an episode ends at a step whose ``terminals`` or
``timeouts`` flag is set, and steps after the last flag form one more episode.

Files are read from disk only (nothing is downloaded): ``load_d4rl`` reads an HDF5
file in the D4RL layout (e.g. one D4RL already downloaded to ``~/.d4rl/datasets``),
``load_npz`` an ``.npz`` archive with the same keys, and ``load_dataset`` picks one by
the file suffix. HDF5 needs the ``h5py`` package.

``SegmentSampler`` draws training windows of ``K`` steps as the official Decision
Transformer ``get_batch`` does (``gym/experiment.py`` of kzl/decision-transformer).

Shape letters: ``N`` steps in the flat dataset, ``T`` steps of one trajectory, ``S``
observation size, ``A`` action size, ``B`` batch, ``K`` context length (steps).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np

from lhc.extras import require

# Returns of a random policy (min) and of an expert (max) per environment, from D4RL
# (``d4rl/infos.py``); every dataset of an environment uses the same pair.
REF_SCORES: dict[str, tuple[float, float]] = {
    "hopper": (-20.272305, 3234.3),
    "halfcheetah": (-280.178953, 12135.0),
    "walker2d": (1.629008, 4592.3),
}

# The flat arrays of a D4RL file this module reads and writes, in that order.
D4RL_KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")

# Added to the per-dimension standard deviation of the observations, as the official
# Decision Transformer does, so constant dimensions do not divide by zero.
STATE_STD_EPSILON = 1e-6


def _env_family(env: str) -> str:
    """``"Hopper-v5"`` or ``"hopper-medium-v2"`` -> ``"hopper"``."""
    family = env.split("-")[0].lower()
    if family not in REF_SCORES:
        raise ValueError(
            f"env must be one of {sorted(REF_SCORES)} (optionally followed by '-...', "
            f"e.g. 'hopper-medium-v2'), got {env!r}"
        )
    return family


def normalized_score(env: str, returns: float | np.ndarray) -> float | np.ndarray:
    """D4RL normalised score: ``100 * (R - R_min) / (R_max - R_min)``.

    Args:
      env: ``"hopper"``, ``"halfcheetah"`` or ``"walker2d"``, or a dataset / gym id
        that starts with one of them before a ``-`` (case ignored), e.g.
        ``"walker2d-medium-replay-v2"`` or ``"HalfCheetah-v4"``.
      returns: undiscounted episode return(s), a scalar or an array of any shape.

    Returns:
      A float for a scalar ``returns``, otherwise a float64 array of the same shape.
    """
    min_return, max_return = REF_SCORES[_env_family(env)]
    scores = 100.0 * (np.asarray(returns, np.float64) - min_return) / (max_return - min_return)
    return float(scores) if scores.ndim == 0 else scores


def returns_to_go(rewards: np.ndarray, scale: float = 1.0, gamma: float = 1.0) -> np.ndarray:
    """Discounted reward-to-go of every step of one trajectory.

    ``rtg[t] = sum_{t' >= t} gamma**(t' - t) * rewards[t'] / scale``.

    Args:
      rewards: ``[T]`` rewards of one trajectory.
      scale: divides the result (Decision Transformer uses 1000 for gym locomotion).
      gamma: discount in ``[0, 1]``; 1 gives the undiscounted return-to-go.

    Returns:
      ``float32[T]``, accumulated in float64.
    """
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [T], got shape {rewards.shape}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if gamma == 1.0:
        totals = np.cumsum(rewards[::-1])[::-1]
    else:
        totals = np.empty_like(rewards)
        running = 0.0
        for t in range(len(rewards) - 1, -1, -1):
            running = rewards[t] + gamma * running
            totals[t] = running
    return (totals / scale).astype(np.float32)


@dataclasses.dataclass
class Trajectory:
    """One episode.

    Attributes:
      observations: ``float32[T, S]``.
      actions: ``float32[T, A]``.
      rewards: ``float32[T]``.
      terminal: True if the episode ended in a true terminal state (the agent fell),
        False if it was cut off (a timeout, or the data ran out).
    """

    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminal: bool


@dataclasses.dataclass
class OfflineDataset:
    """The flat D4RL arrays: one row per step, episodes back to back.

    Attributes:
      observations: ``float32[N, S]``.
      actions: ``float32[N, A]``.
      rewards: ``float32[N]``.
      terminals: ``bool[N]``, True at the last step of an episode that ended in a true
        terminal state.
      timeouts: ``bool[N]``, True at the last step of an episode cut off by the time
        limit.
    """

    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminals: np.ndarray
    timeouts: np.ndarray

    def validate(self) -> None:
        """Checks shapes, dtypes and values; raises ValueError naming the bad key."""
        expected_ndim = {
            "observations": 2,
            "actions": 2,
            "rewards": 1,
            "terminals": 1,
            "timeouts": 1,
        }
        for key in D4RL_KEYS:
            value = getattr(self, key)
            if value is None:
                raise ValueError(f"{key} is missing: expected an array, got None")
            if not isinstance(value, np.ndarray):
                raise ValueError(f"{key} must be a numpy array, got {type(value).__name__}")
            if value.ndim != expected_ndim[key]:
                raise ValueError(f"{key} must be {expected_ndim[key]}-D, got shape {value.shape}")
        num_steps = len(self.observations)
        for key in D4RL_KEYS[1:]:
            if len(getattr(self, key)) != num_steps:
                raise ValueError(
                    f"{key} has {len(getattr(self, key))} rows, expected {num_steps} "
                    f"(the length of observations)"
                )
        for key in ("terminals", "timeouts"):
            if getattr(self, key).dtype != np.bool_:
                raise ValueError(f"{key} must be bool, got dtype {getattr(self, key).dtype}")
        for key in ("observations", "actions", "rewards"):
            value = getattr(self, key)
            if not np.issubdtype(value.dtype, np.floating):
                raise ValueError(f"{key} must be a float array, got dtype {value.dtype}")
            finite = np.isfinite(value)
            if not finite.all():
                row = int(np.argwhere(~finite)[0][0])
                raise ValueError(f"{key} must be finite, got a non-finite value at row {row}")

    def episode_bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` (end exclusive) of each episode, in order."""
        ends = np.flatnonzero(self.terminals | self.timeouts) + 1
        if len(ends) == 0 or ends[-1] != len(self.rewards):
            # The arrays end without a flag: D4RL keeps those steps as an episode too.
            ends = np.append(ends, len(self.rewards))
        starts = np.concatenate([[0], ends[:-1]])
        return [(int(start), int(end)) for start, end in zip(starts, ends) if end > start]

    def trajectories(self) -> list[Trajectory]:
        """The episodes, split at ``terminals | timeouts`` (D4RL's ``sequence_dataset``)."""
        self.validate()
        return [
            Trajectory(
                observations=self.observations[start:end],
                actions=self.actions[start:end],
                rewards=self.rewards[start:end],
                terminal=bool(self.terminals[end - 1]),
            )
            for start, end in self.episode_bounds()
        ]

    def state_mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension mean and ``std + 1e-6`` over all observations, ``float32[S]`` each."""
        observations = np.asarray(self.observations, np.float64)
        mean = observations.mean(axis=0)
        std = observations.std(axis=0) + STATE_STD_EPSILON
        return mean.astype(np.float32), std.astype(np.float32)

    def returns(self) -> np.ndarray:
        """Undiscounted return of each episode, ``float64[num_episodes]``."""
        self.validate()
        rewards = np.asarray(self.rewards, np.float64)
        return np.array([rewards[start:end].sum() for start, end in self.episode_bounds()])

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory]) -> OfflineDataset:
        """Flattens episodes: ``terminals`` from ``terminal``, otherwise a timeout.

        Args:
          trajectories: non-empty episodes, each with at least one step.

        Returns:
          The flat dataset; ``trajectories()`` of it gives the same episodes back.
        """
        if not trajectories:
            raise ValueError("trajectories must hold at least one Trajectory, got none")
        for index, trajectory in enumerate(trajectories):
            if len(trajectory.rewards) == 0:
                raise ValueError(f"trajectories[{index}] must have at least one step, got 0")
        terminals, timeouts = [], []
        for trajectory in trajectories:
            last_step = np.zeros(len(trajectory.rewards), bool)
            last_step[-1] = True
            terminals.append(last_step & trajectory.terminal)
            timeouts.append(last_step & (not trajectory.terminal))
        dataset = cls(
            observations=np.concatenate([t.observations for t in trajectories]).astype(np.float32),
            actions=np.concatenate([t.actions for t in trajectories]).astype(np.float32),
            rewards=np.concatenate([t.rewards for t in trajectories]).astype(np.float32),
            terminals=np.concatenate(terminals),
            timeouts=np.concatenate(timeouts),
        )
        dataset.validate()
        return dataset


def _dataset_from_arrays(arrays: Mapping[str, np.ndarray], source: str) -> OfflineDataset:
    """Builds and validates a dataset from file arrays; errors name ``source``."""
    missing = [key for key in D4RL_KEYS if key not in arrays]
    if missing:
        raise ValueError(
            f"{source}: missing key(s) {missing}; a D4RL dataset needs {list(D4RL_KEYS)}, "
            f"got {sorted(arrays)}"
        )
    columns = {}
    for key in D4RL_KEYS:
        value = np.asarray(arrays[key])
        if key in ("rewards", "terminals", "timeouts") and value.ndim == 2 and value.shape[1] == 1:
            # Some files store per-step scalars as [N, 1].
            value = value[:, 0]
        if key in ("terminals", "timeouts") and value.dtype != np.bool_:
            if not np.isin(value, (0, 1)).all():
                raise ValueError(
                    f"{source}: {key} must hold only 0/1 flags, got {np.unique(value)}"
                )
            value = value.astype(bool)
        if key in ("observations", "actions", "rewards"):
            value = value.astype(np.float32, copy=False)
        columns[key] = value
    dataset = OfflineDataset(**columns)
    try:
        dataset.validate()
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from error
    return dataset


def _import_h5py():
    return require("h5py", "dm")  # HDF5 files only: npz needs nothing


def save_d4rl(path: str | os.PathLike, dataset: OfflineDataset) -> None:
    """Writes ``dataset`` as an HDF5 file in the D4RL layout (datasets at the root)."""
    h5py = _import_h5py()
    dataset.validate()
    with h5py.File(path, "w") as file:
        for key in D4RL_KEYS:
            file.create_dataset(key, data=getattr(dataset, key))


def load_d4rl(path: str | os.PathLike) -> OfflineDataset:
    """Reads a D4RL HDF5 file; extra keys (``infos/...``, ``metadata/...``) are ignored.

    Raises:
      ValueError: a key of ``D4RL_KEYS`` is missing, or the arrays disagree in length,
        shape or values (the message names the file and the key).
    """
    h5py = _import_h5py()
    with h5py.File(path, "r") as file:
        # Only root-level datasets: groups such as infos/ or metadata/ are not read.
        arrays = {
            key: file[key][()]
            for key in D4RL_KEYS
            if key in file and isinstance(file[key], h5py.Dataset)
        }
    return _dataset_from_arrays(arrays, os.fspath(path))


def save_npz(path: str | os.PathLike, dataset: OfflineDataset) -> None:
    """Writes ``dataset`` as an ``.npz`` archive with the D4RL keys."""
    dataset.validate()
    np.savez(path, **{key: getattr(dataset, key) for key in D4RL_KEYS})


def load_npz(path: str | os.PathLike) -> OfflineDataset:
    """Reads an ``.npz`` archive with the D4RL keys (extra keys are ignored).

    Raises:
      ValueError: as ``load_d4rl``.
    """
    with np.load(path, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in D4RL_KEYS if key in archive.files}
    return _dataset_from_arrays(arrays, os.fspath(path))


def load_dataset(path: str | os.PathLike) -> OfflineDataset:
    """``load_d4rl`` for ``.hdf5`` / ``.h5`` files, ``load_npz`` for ``.npz``."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in (".hdf5", ".h5"):
        return load_d4rl(path)
    if suffix == ".npz":
        return load_npz(path)
    raise ValueError(f"path must end in .hdf5, .h5 or .npz, got {os.fspath(path)!r}")


class SegmentSampler:
    """Training windows of ``K`` consecutive steps, as the official DT ``get_batch``.

    Each row picks a trajectory with probability proportional to its length, a start
    step ``si`` uniformly in ``[0, T - 1]``, and takes the steps ``si .. si + K - 1``
    that exist (fewer than ``K`` near the end of the trajectory). Short windows are
    left-padded to ``K``; padded positions have ``mask`` 0 and are to be ignored by
    attention and loss. Padding values: states are zeros *before* normalisation (so
    ``-mean / std`` after, as in DT); actions are 0 where DT uses -10 (the mask hides
    them, and 0 stays inside the ``[-1, 1]`` action range of the environments);
    rewards, returns-to-go and timesteps are 0.

    Returns-to-go are those of the whole trajectory from each step (not truncated at
    the window's end), divided by ``rtg_scale``. Timesteps are the absolute step index
    within the trajectory, clipped to ``max_ep_len - 1`` for the timestep embedding.

    Args:
      dataset: the flat dataset, or its trajectories.
      context_length: ``K``, steps per window.
      rtg_scale: divides returns-to-go (DT uses 1000 for gym locomotion).
      max_ep_len: size of the timestep embedding table.
      state_mean: ``[S]``, defaults to the dataset's ``state_mean_std()``.
      state_std: ``[S]``, defaults to the dataset's ``state_mean_std()``.

    Attributes:
      state_mean, state_std: ``float32[S]`` used to normalise states (evaluation
        rollouts must normalise with the same).
    """

    def __init__(
        self,
        dataset: OfflineDataset | Sequence[Trajectory],
        context_length: int,
        *,
        rtg_scale: float = 1000.0,
        max_ep_len: int = 1000,
        state_mean: np.ndarray | None = None,
        state_std: np.ndarray | None = None,
    ):
        if not isinstance(dataset, OfflineDataset):
            dataset = OfflineDataset.from_trajectories(dataset)
        dataset.validate()
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        if not rtg_scale > 0:
            raise ValueError(f"rtg_scale must be > 0, got {rtg_scale}")
        if max_ep_len < 1:
            raise ValueError(f"max_ep_len must be >= 1, got {max_ep_len}")
        self.context_length = context_length
        self.rtg_scale = float(rtg_scale)
        self.max_ep_len = max_ep_len

        default_mean, default_std = dataset.state_mean_std()
        state_dim = dataset.observations.shape[1]
        self.state_mean = np.asarray(default_mean if state_mean is None else state_mean, np.float32)
        self.state_std = np.asarray(default_std if state_std is None else state_std, np.float32)
        for name, value in (("state_mean", self.state_mean), ("state_std", self.state_std)):
            if value.shape != (state_dim,):
                raise ValueError(f"{name} must have shape ({state_dim},), got {value.shape}")

        bounds = np.array(dataset.episode_bounds(), np.int64).reshape(-1, 2)
        if len(bounds) == 0:
            raise ValueError("dataset must hold at least one step, got 0")
        self._starts, self._lengths = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
        self._probabilities = self._lengths / self._lengths.sum()
        self._observations = np.asarray(dataset.observations, np.float32)
        self._actions = np.asarray(dataset.actions, np.float32)
        self._rewards = np.asarray(dataset.rewards, np.float32)
        # Unscaled, so rtg_scale divides once at sampling, as DT does.
        self._returns_to_go = np.concatenate(
            [returns_to_go(self._rewards[start:end]) for start, end in bounds]
        )

    @property
    def num_trajectories(self) -> int:
        return len(self._lengths)

    def sample(self, rng: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
        """Draws ``batch_size`` windows; the same ``rng`` state gives the same batch.

        Returns:
          ``states: float32[B, K, S]`` (normalised), ``actions: float32[B, K, A]``,
          ``rewards: float32[B, K, 1]``, ``returns_to_go: float32[B, K, 1]`` (divided
          by ``rtg_scale``), ``timesteps: int32[B, K]``, ``mask: float32[B, K]`` (1 on
          real steps, 0 on left padding).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        window = self.context_length
        trajectory_index = rng.choice(self.num_trajectories, size=batch_size, p=self._probabilities)
        lengths = self._lengths[trajectory_index]
        start_step = rng.integers(0, lengths)  # [B], uniform in [0, T - 1] per row
        num_real = np.minimum(window, lengths - start_step)  # [B]
        num_pad = window - num_real

        position = np.arange(window)[None, :]  # [1, K]
        real = position >= num_pad[:, None]  # [B, K]
        step = start_step[:, None] + position - num_pad[:, None]  # [B, K], < 0 on padding
        flat_index = self._starts[trajectory_index][:, None] + np.maximum(step, 0)

        states = np.where(real[..., None], self._observations[flat_index], 0.0)
        states = (states - self.state_mean) / self.state_std
        actions = np.where(real[..., None], self._actions[flat_index], 0.0)
        rewards = np.where(real, self._rewards[flat_index], 0.0)
        rtg = np.where(real, self._returns_to_go[flat_index] / self.rtg_scale, 0.0)
        timesteps = np.where(real, np.minimum(step, self.max_ep_len - 1), 0)
        return {
            "states": states.astype(np.float32),
            "actions": actions.astype(np.float32),
            "rewards": rewards[..., None].astype(np.float32),
            "returns_to_go": rtg[..., None].astype(np.float32),
            "timesteps": timesteps.astype(np.int32),
            "mask": real.astype(np.float32),
        }


def complete_episode_returns(dataset: OfflineDataset) -> np.ndarray:
    """Returns of the episodes that ended by a terminal or a timeout flag (``float64``);
    a trailing episode cut off by the end of the data is left out."""
    rewards = np.asarray(dataset.rewards, np.float64)
    flags = dataset.terminals | dataset.timeouts
    return np.array(
        [rewards[start:end].sum() for start, end in dataset.episode_bounds() if flags[end - 1]]
    )


def concatenate_datasets(datasets: Sequence[OfflineDataset]) -> OfflineDataset:
    """Datasets back to back. A part whose last step has no flag (an episode cut off by
    the end of its data) gets a timeout there, so it does not merge with the next part's
    first episode."""
    if not datasets:
        raise ValueError("datasets: expected at least one OfflineDataset, got none")
    parts = []
    for index, dataset in enumerate(datasets):
        dataset.validate()
        timeouts = dataset.timeouts.copy()
        if index < len(datasets) - 1 and not (dataset.terminals[-1] or timeouts[-1]):
            timeouts[-1] = True
        parts.append(dataclasses.replace(dataset, timeouts=timeouts))
    merged = OfflineDataset(
        **{
            field.name: np.concatenate([getattr(part, field.name) for part in parts])
            for field in dataclasses.fields(OfflineDataset)
        }
    )
    merged.validate()
    return merged
