"""A SAC training run saved between episodes, so that ``lhc.dm.recipe.train_sac``
continues a stopped run where it was and ends as the uninterrupted run would.

One file, ``<dir>/sac_training.npz`` (written beside and renamed over the last, so a
stop while saving keeps the previous one): the agent (``SACState``'s arrays, flax
msgpack), the replay buffer's filled rows, the actor snapshots taken so far, the
training log, and the state of the two random streams the loop draws from (the
loop's numpy generator and the environment's). It is saved right after an episode
ended, before the next reset, so that restoring the environment's generator and
resetting reproduces the episode the uninterrupted run would have started.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.serialization
import numpy as np

from lhc.dm.sac import ReplayBuffer, SACState

FILE = "sac_training.npz"


@dataclasses.dataclass
class Progress:
    """Where a run stands besides its agent and buffer.

    Attributes:
      step: environment steps done.
      next_update: the index of the next update's key (updates done since the first).
      first_update_step: the step whose update drew the keys (None before updates).
      rng_state: the loop generator's ``bit_generator.state``.
      env_rng_state: the environment's ``np_random.bit_generator.state`` before the
        next reset (None once the run has finished).
      log: ``TrainLog`` fields as a dict.
      snapshots: ``{step: actor params}``.
      settings: the run's arguments; a saved run with other settings is refused.
      seconds: the run's wall-clock seconds so far.
    """

    step: int
    next_update: int
    first_update_step: int | None
    rng_state: dict
    env_rng_state: dict | None
    log: dict
    snapshots: dict[int, Any]
    settings: dict
    seconds: float


def save(directory: str, state: SACState, buffer: ReplayBuffer, progress: Progress) -> str:
    """Writes the run to ``directory/FILE`` (atomically) and returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE)
    arrays = {f"buffer_{name}": values for name, values in buffer.state_dict().items()}
    meta = dataclasses.asdict(progress)
    snapshots = meta.pop("snapshots")
    meta["snapshot_steps"] = sorted(snapshots)
    arrays["agent"] = np.frombuffer(
        flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(state)), np.uint8
    )
    for step, params in snapshots.items():
        arrays[f"snapshot_{step}"] = np.frombuffer(
            flax.serialization.msgpack_serialize(params), np.uint8
        )
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    partial = path + ".partial.npz"
    np.savez(partial, **arrays)
    os.replace(partial, path)
    return path


def settings(**arguments) -> dict:
    """A run's arguments as they read back from the file (JSON types)."""
    return json.loads(json.dumps(arguments))


def load(
    directory: str,
    state: SACState,
    buffer: ReplayBuffer,
    settings: dict,
    rng: np.random.Generator,
    env: Any,
) -> tuple[SACState, Progress, np.ndarray | None] | None:
    """The saved run in ``directory`` (None when there is none): the agent restored into
    ``state``'s structure, ``buffer``, ``rng`` and ``env``'s generator restored in
    place, and the observation of the environment reset as the run would have reset it
    next (None for a finished run).

    Raises:
        ValueError: a saved run made with other ``settings``, naming the differences.
    """
    path = os.path.join(directory, FILE)
    if not os.path.exists(path):
        return None
    with np.load(path) as saved:
        meta = json.loads(saved["meta"].tobytes())
        if meta["settings"] != settings:
            differ = sorted(
                key
                for key in set(meta["settings"]) | set(settings)
                if meta["settings"].get(key) != settings.get(key)
            )
            raise ValueError(
                f"checkpoint_dir: {path} holds a run with other settings ({', '.join(differ)}); "
                f"expected {settings}, got {meta['settings']}"
            )
        agent = flax.serialization.msgpack_restore(saved["agent"].tobytes())
        state = flax.serialization.from_state_dict(state, agent)
        buffer.load_state_dict(
            {
                name[len("buffer_") :]: saved[name]
                for name in saved.files
                if name.startswith("buffer_")
            }
        )
        snapshots = {
            step: flax.serialization.msgpack_restore(saved[f"snapshot_{step}"].tobytes())
            for step in meta.pop("snapshot_steps")
        }
    progress = Progress(snapshots=snapshots, **meta)
    progress.log["metrics"] = [(step, values) for step, values in progress.log["metrics"]]
    rng.bit_generator.state = progress.rng_state
    observation = None
    if progress.env_rng_state is not None:
        env.unwrapped.np_random.bit_generator.state = progress.env_rng_state
        observation = np.asarray(env.reset()[0], np.float32).reshape(-1)
    return state, progress, observation
