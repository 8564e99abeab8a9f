"""Orbax checkpointing of the train state and the data-iterator state.

A checkpoint step holds two items: ``state`` (the train-state pytree, restored
against an abstract tree so shardings hold) and ``data`` (the JSON state of the data
iterator). Orbax writes each step to a temporary directory and renames it when
complete, so a crash mid-write never leaves a step that looks finished; the temporary
directory a killed run left behind is removed when the next run opens the directory.
Evaluation restores the parameters alone (``restore_params``), so it does not depend
on the optimizer that trained them.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers


class UnreadableCheckpoint(ValueError):
    """A checkpoint step that cannot be read (corrupt, truncated, incomplete)."""


def brief(error: BaseException) -> str:
    """``Type: message`` in one line: the first line of the message, without the
    TensorStore spec that orbax's read errors append."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text.split(" See full TensorStore details")[0]
    return f"{type(error).__name__}: {text[:300]}"


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with clear errors.

    Args:
      directory: where step directories live (created if missing).
      save_interval_steps: save every this many steps (0 disables periodic saves;
        preemption and forced saves still happen).
      max_to_keep: keep at most this many recent steps (None keeps all).
      async_save: write in a background thread (call ``wait()`` before reading).
      read_only: only restore (no directory is created, nothing is cleaned up).
    """

    def __init__(
        self,
        directory: str,
        *,
        save_interval_steps: int = 1000,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(directory) if "://" not in directory else directory
        policies = [checkpoint_managers.PreemptionCheckpointingPolicy()]
        if save_interval_steps > 0:
            policies.append(checkpoint_managers.FixedIntervalPolicy(save_interval_steps))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_decision_policy=checkpoint_managers.AnySavePolicy(policies),
            enable_async_checkpointing=async_save,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
        )
        # A PyTree handler (StandardSave writes a PyTree checkpoint) so that a subtree,
        # the parameters, can be restored alone.
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
            },
            options=options,
        )

    def reload(self) -> None:
        """Lists the step directories again (after some were moved)."""
        self._manager.reload()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def reached_preemption(self, step: int) -> bool:
        return self._manager.reached_preemption(step)

    def should_save(self, step: int) -> bool:
        """Whether the policy saves at ``step`` (an interval step or a preemption)."""
        return self._manager.should_save(step)

    def save(self, step: int, state, data_state: dict, *, force: bool = False) -> bool:
        """Saves when the policy says so (or ``force``); returns whether it saved."""
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=force,
        )

    def state_arrays(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{path: (shape, dtype)}`` of every array of the train state saved at ``step``,
        from the checkpoint's metadata (no array is read); paths as ``array_paths``."""
        try:
            tree = self._manager.item_metadata(step)["state"]
        except Exception as error:  # orbax raises many types for damaged files
            raise UnreadableCheckpoint(
                f"checkpoint step {step} in {self.directory!r} is unreadable: {brief(error)}"
            ) from error
        return array_paths(getattr(tree, "tree", tree))

    def _step_or_latest(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint found in {self.directory!r}")
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory!r}; "
                f"available steps: {self.all_steps()}"
            )
        return step

    def _restore(self, step: int, target, *, partial: bool, **items):
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        try:
            return self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        target, restore_args=restore_args, partial_restore=partial
                    ),
                    **items,
                ),
            )
        except Exception as error:  # orbax raises many types for damaged files
            raise UnreadableCheckpoint(
                f"checkpoint step {step} in {self.directory!r} could not be restored "
                f"(corrupt or incomplete): {brief(error)}"
            ) from error

    def restore(self, step: int | None, abstract_state):
        """Restores ``(state, data_state)`` at ``step`` (latest when None).

        Args:
          step: the step to restore, or None for the latest.
          abstract_state: a pytree of ``jax.ShapeDtypeStruct`` with shardings (or
            concrete arrays, whose shapes, dtypes and shardings are used).

        Raises:
          FileNotFoundError: no checkpoint in the directory (or not that step).
          ValueError: the checkpoint is unreadable or does not match ``abstract_state``.
        """
        step = self._step_or_latest(step)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        restored = self._restore(step, target, partial=False, data=ocp.args.JsonRestore())
        _check_restored_shapes(restored.state, target, step, self.directory)
        return restored.state, restored.data

    def restore_params(self, step: int | None, abstract_params) -> tuple[dict, int]:
        """Restores ``(params, step)`` alone: the optimizer state, the RNG and the data
        position are not read, so any optimizer config evaluates the checkpoint.

        Raises:
          FileNotFoundError: no checkpoint in the directory (or not that step).
          ValueError: the checkpoint is unreadable or does not match ``abstract_params``.
        """
        step = self._step_or_latest(step)
        target = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)}
        saved = self.state_arrays(step)
        expected = array_paths(target)
        missing = [path for path in expected if path not in saved]
        other = [p for p in expected if p in saved and saved[p][0] != expected[p][0]]
        if other:
            raise ValueError(
                f"checkpoint step {step} in {self.directory!r} does not match the config: "
                + "; ".join(state_differences(saved, expected)[:3])
            )
        if missing:
            raise ValueError(
                f"checkpoint step {step} in {self.directory!r} lacks {len(missing)} parameters "
                f"that the config's model has, e.g. {', '.join(missing[:3])}: the config "
                f"describes another model than the one trained there"
            )
        restored = self._restore(step, target, partial=True)
        _check_restored_shapes(restored.state, target, step, self.directory)
        return restored.state["params"], step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _key_name(key) -> str:
    for field in ("key", "name", "idx"):  # dict keys, attributes (namedtuples), indices
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def array_paths(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params/layers_0/kernel": (shape, dtype name)}`` for every leaf of ``tree``
    (arrays, ``ShapeDtypeStruct`` or orbax array metadata)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(_key_name(k) for k in path): (
            tuple(leaf.shape),
            str(np.dtype(leaf.dtype)),
        )
        for path, leaf in leaves
    }


def state_differences(saved: dict, expected: dict) -> list[str]:
    """What differs between two ``array_paths`` maps, one line each: arrays of another
    shape (a dtype may differ: restoring casts), then missing, then extra ones."""
    lines = []
    for path in expected:
        if path in saved and saved[path][0] != expected[path][0]:
            (got, got_dtype), (want, want_dtype) = saved[path], expected[path]
            lines.append(
                f"{path}: saved {got_dtype}{list(got)}, the config makes {want_dtype}{list(want)}"
            )
    lines += [f"{p}: not in the checkpoint" for p in expected if p not in saved]
    lines += [f"{p}: in the checkpoint only" for p in saved if p not in expected]
    return lines


def _check_restored_shapes(restored, target, step, directory) -> None:
    bad = []

    def check(path, got, want):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            bad.append(
                f"{jax.tree_util.keystr(path)}: expected {want.dtype}{list(want.shape)}, "
                f"found {got.dtype}{list(got.shape)}"
            )

    jax.tree_util.tree_map_with_path(check, restored, target)
    if bad:
        raise ValueError(
            f"checkpoint step {step} in {directory!r} does not match the config: "
            + "; ".join(bad[:5])
        )


def save_tree(path: str, tree) -> None:
    """Writes ``tree`` (arrays, possibly sharded) to the directory ``path`` once, replacing
    what is there (the frozen parameters of an adapter run: written when it starts)."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), tree, force=True)
        checkpointer.wait_until_finished()


def restore_tree(path: str, abstract_tree):
    """The tree ``save_tree`` wrote at ``path``, restored against ``abstract_tree`` (its
    ``ShapeDtypeStruct`` leaves carry the shardings).

    Raises:
      FileNotFoundError: nothing at ``path``.
      UnreadableCheckpoint: it cannot be read, or holds other arrays.
    """
    if "://" not in path and not os.path.isdir(path):
        raise FileNotFoundError(f"no saved arrays at {path!r}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_tree)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(os.path.abspath(path), target)
    except (ValueError, KeyError, OSError) as error:
        raise UnreadableCheckpoint(f"{path!r}: {brief(error)}") from None
