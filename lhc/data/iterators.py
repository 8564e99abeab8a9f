"""Checkpointable data iterators.

A training run saves its iterator's state beside the model state, so a resumed run
sees exactly the batches an uninterrupted run would have seen. Iterators here are
*index based*: row ``r`` of global batch ``i`` is a pure function of ``(seed, i, r)``.
Each process builds only its own rows, and the global batch is the same whatever the
number of processes, so a run gives the same data on one host or on a pod slice, and
the iterator state is just the next index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]


class DataIterator(Iterator[Batch]):
    """An iterator of process-local batches whose position can be saved and restored."""

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


def row_rngs(seed: int, index: int, rows: Sequence[int]) -> list[np.random.Generator]:
    """One generator per row, seeded from ``(seed, index, row)``."""
    return [np.random.default_rng([int(seed), int(index), int(row)]) for row in rows]


def stack_rows(make_row: Callable[[np.random.Generator], Batch], rngs) -> Batch:
    """Concatenates ``make_row(rng)`` (each with a leading axis of 1) over ``rngs``."""
    rows = [make_row(rng) for rng in rngs]
    return {key: np.concatenate([row[key] for row in rows], axis=0) for key in rows[0]}


class IndexedIterator(DataIterator):
    """Yields this process's rows of global batch 0, 1, 2, ...

    Args:
      make_batch: ``(seed, index, rows) -> dict of numpy arrays`` with one leading row
        per entry of ``rows`` (a ``range`` of global row indices); row ``r`` may depend
        only on ``(seed, index, r)`` and on what every row shares, e.g. by drawing from
        ``row_rngs(seed, index, rows)``.
      seed: the data seed.
      batch_size: rows per global batch.
      process_index: this process's index; it gets rows
        ``[process_index * local, (process_index + 1) * local)``.
      process_count: number of processes sharing each global batch.
      start: the first index.
    """

    def __init__(
        self,
        make_batch: Callable[[int, int, range], Batch],
        *,
        seed: int,
        batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        start: int = 0,
    ):
        if batch_size % process_count:
            raise ValueError(
                f"batch_size ({batch_size}) must be divisible by the number of processes "
                f"({process_count})"
            )
        self._make_batch = make_batch
        self._seed = int(seed)
        local = batch_size // process_count
        self._rows = range(process_index * local, (process_index + 1) * local)
        self._index = int(start)

    def __next__(self) -> Batch:
        batch = self._make_batch(self._seed, self._index, self._rows)
        self._index += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"index": self._index, "seed": self._seed}

    def set_state(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self._seed)) != self._seed:
            raise ValueError(
                f"data iterator state was saved with seed {state['seed']}, but this run uses "
                f"seed {self._seed}; resume with the same config.seed"
            )
        self._index = int(state["index"])


def consecutive_chunks(
    make_sequence: Callable[[np.random.Generator, int], Batch],
    *,
    chunk_length: int,
    num_chunks: int,
) -> Callable[[int, int, range], Batch]:
    """A ``make_batch`` for ``IndexedIterator`` that serves long sequences in consecutive
    chunks, for truncated backpropagation through time: global batches ``g K, ..., g K +
    K - 1`` (K = ``num_chunks``) hold chunks 0 to K - 1 of the same rows, and each row's
    sequence ``make_sequence(rng, K L)`` (L = ``chunk_length``) depends only on
    ``(seed, g, row)``, so the iterator stays checkpointable by its index.

    ``make_sequence(rng, n)`` returns a dict of per-position arrays of ``n`` entries each
    (for example ``tokens``, ``targets`` and loss ``weights``). Batches hold each of them
    cut to ``[rows, L]``, plus ``positions`` (int32, the positions in the whole sequence)
    and ``reset`` (bool ``[rows]``, true on chunk 0: a model carrying its state starts
    afresh).
    """
    for name, value in (("chunk_length", chunk_length), ("num_chunks", num_chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    total = chunk_length * num_chunks
    memo: dict[tuple, Batch] = {}

    def checked(row: int, sequence) -> Batch:
        if not isinstance(sequence, dict) or not sequence:
            raise ValueError(
                f"make_sequence(rng, {total}) must return a dict of per-position arrays, "
                f"got {type(sequence).__name__} for row {row}"
            )
        for name, value in sequence.items():
            if np.shape(value) != (total,):
                raise ValueError(
                    f"make_sequence(rng, {total}) must return arrays of {total} entries "
                    f"(num_chunks x chunk_length), got {name!r} of shape {np.shape(value)} "
                    f"for row {row}"
                )
        return sequence

    def sequences(seed: int, group: int, rows: range) -> Batch:
        key = (seed, group, rows.start, rows.stop)
        if key not in memo:
            made = [
                checked(row, make_sequence(rng, total))
                for row, rng in zip(rows, row_rngs(seed, group, rows))
            ]
            memo.clear()  # one group at a time: the chunks of a group come in a row
            memo[key] = {name: np.stack([m[name] for m in made]) for name in made[0]}
        return memo[key]

    def make_batch(seed: int, index: int, rows: range) -> Batch:
        group, chunk = divmod(int(index), num_chunks)
        start = chunk * chunk_length
        batch = {
            name: value[:, start : start + chunk_length].copy()
            for name, value in sequences(seed, group, rows).items()
        }
        positions = np.arange(start, start + chunk_length, dtype=np.int32)
        batch["positions"] = np.broadcast_to(positions, (len(rows), chunk_length)).copy()
        batch["reset"] = np.full((len(rows),), chunk == 0)
        return batch

    return make_batch
