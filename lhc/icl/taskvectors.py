"""Task vectors (Hendel et al.; the task-superposition paper's Sec. 5): the residual
stream at a prompt's last token (the query's separator), averaged over single-task
prompts, one vector per layer; patched into zero-shot queries by replacing the
residual there at one layer; the best layer is the one whose patch gives the task's
answers the highest probability; vectors of several tasks compose convexly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lhc.icl.activations import read_activations
from lhc.icl.scoring import Patch, answer_probabilities, pad_rows


def last_token_states(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    site: str = "residual",
    batch_size: int = 32,
) -> np.ndarray:
    """``[L, P, D]``: ``site``'s activations at the last token of each prompt."""
    if not prompts:
        raise ValueError("prompts must not be empty")
    longest = max(len(p) for p in prompts)
    if longest > model.config.max_len:
        raise ValueError(f"a prompt of {longest} tokens exceeds max_len {model.config.max_len}")
    states = []
    for start in range(0, len(prompts), batch_size):
        group = prompts[start : start + batch_size]
        tokens = pad_rows(group, model.config.max_len)
        lengths = np.array([len(p) for p in group])
        acts, _ = read_activations(
            model, params, tokens, (lengths - 1)[:, None], site=site, lengths=lengths
        )
        states.append(np.asarray(acts[:, :, 0], np.float64))
    return np.concatenate(states, axis=1)


def task_vector(model, params, prompts: Sequence[Sequence[int]], **kwargs) -> np.ndarray:
    """``[L, D]``: the mean residual stream at the last token of ``prompts`` (single-task
    prompts ending with the query's separator)."""
    return last_token_states(model, params, prompts, **kwargs).mean(axis=1)


def patched_probabilities(
    model, params, vectors: np.ndarray, layer: int, queries, answers, *, mode: str = "replace"
) -> np.ndarray:
    """``[Q, K]``: answer probabilities of ``queries`` with the residual at their last
    token replaced (or added to, ``mode="add"``) by ``vectors[layer]`` at ``layer``."""
    vectors = np.asarray(vectors)
    if not 0 <= layer < model.config.num_layers:
        raise ValueError(f"layer {layer} lies outside [0, num_layers={model.config.num_layers})")
    patch = Patch(layers=(layer,), values=vectors[layer][None], mode=mode)
    return answer_probabilities(model, params, queries, answers, patch=patch)


def best_layer(
    model, params, vectors: np.ndarray, queries, answers, *, task: int = 0
) -> tuple[int, np.ndarray]:
    """The layer whose patch gives answer ``task`` the highest mean probability.

    Args:
        vectors: ``[L, D]`` (``task_vector``).
        queries: zero-shot prompts (an input and the separator).
        answers: per query, the candidate answers (``task`` indexes the one scored).

    Returns:
        ``(layer, scores)``: the best layer and the mean probability per layer ``[L]``.
    """
    scores = np.array(
        [
            patched_probabilities(model, params, vectors, layer, queries, answers)[:, task].mean()
            for layer in range(model.config.num_layers)
        ]
    )
    return int(np.argmax(scores)), scores


def compose(vectors, weights) -> np.ndarray:
    """The convex combination ``sum_i weights[i] vectors[i]``.

    Args:
        vectors: ``[n, ...]``, one per task.
        weights: ``[n]``, non-negative, summing to 1.

    Raises:
        ValueError: a weight count other than n, a negative weight, or a sum other than 1.
    """
    vectors, weights = np.asarray(vectors, np.float64), np.asarray(weights, np.float64)
    if weights.shape != (vectors.shape[0],):
        raise ValueError(f"weights must be [{vectors.shape[0]}], got shape {weights.shape}")
    if (weights < 0).any() or abs(weights.sum() - 1) > 1e-6:
        raise ValueError(f"weights must be non-negative and sum to 1, got {weights.tolist()}")
    return np.tensordot(weights, vectors, axes=1)
