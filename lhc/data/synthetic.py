"""Generated sequence tasks for causal LMs: associative recall and copying.

Every generator returns ``tokens`` (model input), ``targets`` (next-token labels) and
``weights`` (1 where the loss counts) as ``int32/int32/float32 [B, T]`` numpy arrays,
drawn from a ``np.random.Generator`` so batches are reproducible.
"""

from __future__ import annotations

import numpy as np


def associative_recall(
    rng: np.random.Generator,
    batch_size: int,
    *,
    num_pairs: int,
    num_queries: int,
    num_keys: int,
    num_values: int,
) -> dict[str, np.ndarray]:
    """Multi-query associative recall.

    Each sequence lists ``num_pairs`` key-value pairs with distinct keys, then asks
    ``num_queries`` of those keys again; after each repeated key the model must emit
    the value it was paired with. The loss counts only those answers, so chance
    level is ``log(num_values)`` nats.

    Token ids: keys ``[0, num_keys)``, values ``[num_keys, num_keys + num_values)``,
    so the vocabulary size is ``num_keys + num_values``.

    Layout of one sequence (length ``2 * (num_pairs + num_queries)``)::

        k1 v1 k2 v2 ... kn vn | q1 a1 q2 a2 ... qm am

    Returns:
      ``tokens, targets: int32[B, T]`` with ``T = 2 * (num_pairs + num_queries) - 1``
      (the last answer is only a target), and ``weights: float32[B, T]``.
    """
    if num_pairs > num_keys:
        raise ValueError(f"num_pairs ({num_pairs}) must be <= num_keys ({num_keys})")
    if num_queries > num_pairs:
        raise ValueError(f"num_queries ({num_queries}) must be <= num_pairs ({num_pairs})")
    keys = np.argsort(rng.random((batch_size, num_keys)), axis=1)[:, :num_pairs]
    values = num_keys + rng.integers(0, num_values, size=(batch_size, num_pairs))
    query_slots = np.argsort(rng.random((batch_size, num_pairs)), axis=1)[:, :num_queries]
    query_keys = np.take_along_axis(keys, query_slots, axis=1)
    answers = np.take_along_axis(values, query_slots, axis=1)

    context = np.stack([keys, values], axis=-1).reshape(batch_size, 2 * num_pairs)
    queries = np.stack([query_keys, answers], axis=-1).reshape(batch_size, 2 * num_queries)
    sequence = np.concatenate([context, queries], axis=1).astype(np.int32)
    weights = np.zeros(sequence.shape, np.float32)
    # Target index t predicts sequence[t + 1]; answers sit at odd offsets in the query part.
    weights[:, 2 * num_pairs : -1 : 2] = 1.0
    return {
        "tokens": sequence[:, :-1],
        "targets": sequence[:, 1:],
        "weights": weights[:, :-1],
    }


def copy_task(
    rng: np.random.Generator, batch_size: int, *, length: int, vocab_size: int
) -> dict[str, np.ndarray]:
    """Copying: ``x1..xn SEP x1..xn``; the loss counts the copied half.

    Token ``vocab_size - 1`` is the separator; content tokens are ``[0, vocab_size - 1)``.
    """
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
    content = rng.integers(0, vocab_size - 1, size=(batch_size, length))
    separator = np.full((batch_size, 1), vocab_size - 1)
    sequence = np.concatenate([content, separator, content], axis=1).astype(np.int32)
    weights = np.zeros(sequence.shape, np.float32)
    weights[:, length:-1] = 1.0
    return {"tokens": sequence[:, :-1], "targets": sequence[:, 1:], "weights": weights[:, :-1]}
