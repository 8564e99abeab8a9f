"""What chunk_retrieval's implementations share.

The slot weights with empty slots zeroed (all three implementations), the (query chunk,
slot) pairs sorted by the memory chunk they read (the dk/dv kernels of both backends),
and the softmax and backward of one head over one retrieved chunk (the 2-D tiles of the
TPU and GPU kernels).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels_pallas._common import DEFAULT_MASK_VALUE, NT, matmul


def masked_slot_weights(indices, weights):
    """The weights with empty slots zeroed (float32)."""
    return jnp.where(indices >= 0, weights, 0.0).astype(jnp.float32)


def sorted_pairs(indices, weights, num_memory_chunks):
    """The (query chunk, slot) pairs of each batch row, sorted by the chunk they read.

    Returns:
        targets: int32 [B, C*K], the memory chunk of each sorted pair; empty slots get
            N and come last.
        pairs: int32 [B, C*K], the flat pair id ``c * K + k`` of each sorted pair.
        pair_weights: float32 [B, C*K], their weights (0 for empty slots).
    """
    batch = indices.shape[0]
    flat = indices.reshape(batch, -1)
    targets = jnp.where(flat >= 0, flat, num_memory_chunks)
    pairs = jnp.argsort(targets, axis=1, stable=True).astype(jnp.int32)
    targets = jnp.take_along_axis(targets, pairs, axis=1)
    pair_weights = jnp.take_along_axis(
        masked_slot_weights(indices, weights).reshape(batch, -1), pairs, 1
    )
    return targets.astype(jnp.int32), pairs, pair_weights


def tile_probs(q, k, scale, num_keys):
    """Softmax probabilities [Sq, Sk'] of one head over one chunk's keys.

    Keys at or beyond `num_keys` (padding of the GPU tile) are masked out.
    """
    scores = matmul(q, k, NT) * scale
    if num_keys < k.shape[0]:
        key_index = lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(key_index < num_keys, scores, DEFAULT_MASK_VALUE)
    row_max = jnp.max(scores, axis=1, keepdims=True)
    probs = jnp.exp(scores - row_max)
    return probs / jnp.sum(probs, axis=1, keepdims=True)


def tile_backward(q, k, v, d_out, weight, scale, num_keys):
    """Recomputed probabilities of one head and chunk, and its backward pieces.

    Returns:
        probs [Sq, Sk] float32; d_scores [Sq, Sk] in q's dtype, already multiplied by
        the weight and the scale (dq = d_scores @ k, dk = d_scores^T @ q); and the row
        deltas rowsum(dO * O_k) [Sq, 1] float32, whose total is this head's dweight.
    """
    probs = tile_probs(q, k, scale, num_keys)
    d_probs = matmul(d_out, v, NT)
    row_delta = jnp.sum(probs * d_probs, axis=1, keepdims=True)
    d_scores = (weight * scale * probs * (d_probs - row_delta)).astype(q.dtype)
    return probs, d_scores, row_delta
