"""What flash_attention's XLA path and its TPU and GPU kernels share.

The position mask of `kernels_pallas.flash_attention` (``visible``), the per-block
position bounds and the test that skips a pair of blocks that cannot interact, and the
FlashAttention-2 backward of one (query tile, key tile) pair used by both kernel sets.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas._common import NT, matmul

# Block statistics for blocks without a valid position: min = this, max = -1, so such a
# block never passes `blocks_may_interact`.
NO_POSITION = int(np.iinfo(np.int32).max)


def visible(q_pos, k_pos, window):
    """Elementwise mask of the module docstring; q_pos and k_pos broadcast together."""
    mask = (k_pos >= 0) & (q_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def block_bounds(positions, block):
    """Per block, the smallest and largest valid position.

    Args:
        positions: int32 [B, L] with L a multiple of block.
        block: block length.

    Returns:
        (min_position, max_position), int32 [B, L // block] each; a block without a valid
        position gets (NO_POSITION, -1).
    """
    batch, length = positions.shape
    blocks = positions.reshape(batch, length // block, block)
    valid = blocks >= 0
    min_position = jnp.min(jnp.where(valid, blocks, NO_POSITION), axis=-1)
    max_position = jnp.max(jnp.where(valid, blocks, -1), axis=-1)
    return min_position, max_position


def blocks_may_interact(q_min, q_max, k_min, k_max, window):
    """False only if no query of the block can see any key of the block.

    A visible pair has 0 <= k_pos <= q_pos (so k_min <= q_max) and, with a window,
    q_pos - k_pos < window (so k_max > q_min - window): skipping when either bound fails
    never drops a visible pair. Empty blocks fail the first test by construction.
    """
    may_interact = k_min <= q_max
    if window is not None:
        may_interact &= k_max > q_min - window
    return may_interact


def probs_and_dscores(q, k, v, d_out, lse, delta, mask, scale):
    """FlashAttention-2 backward of one tile pair: recomputed probabilities and dS.

    Args:
        q, d_out: [bq, H]; k, v: [bk, H].
        lse, delta: float32 [bq, 1], the row log-sum-exp and rowsum(dO * O).
        mask: bool [bq, bk].
        scale: the score scale.

    Returns:
        probs float32 [bq, bk], and d_scores [bq, bk] in q's dtype, already multiplied by
        scale (so dq = d_scores @ k and dk = d_scores.T @ q).
    """
    scores = matmul(q, k, NT) * scale
    # The inner where keeps exp's argument finite for masked entries (lse is -inf on rows
    # that see nothing); the outer one zeroes them.
    probs = jnp.where(mask, jnp.exp(jnp.where(mask, scores, 0.0) - lse), 0.0)
    d_probs = matmul(d_out, v, NT)
    d_scores = (probs * (d_probs - delta) * scale).astype(q.dtype)
    return probs, d_scores


def fetch_ranges(q_min, q_max, k_min, k_max, window):
    """Which blocks a kernel's pipeline copies, so that a skipped block is never copied.

    Per row of query blocks, the first and last key block it may interact with; per key
    block, the first and last query block. An index map that clamps the inner grid index
    into that range asks, on a skipped step, for the block the step before or after it
    copies, and a pipeline copies a block only when its index changes (as splash
    attention's). Blocks inside the range that cannot interact (keys in no position
    order) are still copied, their compute skipped.

    Args:
        q_min, q_max: int32 [B, nq], ``block_bounds`` of the queries.
        k_min, k_max: int32 [B, nk], of the keys.
        window: as for ``blocks_may_interact``.

    Returns:
        (k_first, k_last) int32 [B, nq] and (q_first, q_last) int32 [B, nk]; 0 and 0
        where nothing interacts.
    """
    may = blocks_may_interact(
        q_min[:, :, None], q_max[:, :, None], k_min[:, None, :], k_max[:, None, :], window
    )  # [B, nq, nk]

    def first_last(may, axis):
        index = jnp.arange(may.shape[axis], dtype=jnp.int32)
        index = index[:, None] if axis == 1 else index[None, :]
        last = jnp.max(jnp.where(may, index, -1), axis=axis)
        first = jnp.min(jnp.where(may, index, may.shape[axis]), axis=axis)
        none = last < 0
        return jnp.where(none, 0, first), jnp.where(none, 0, last)

    return first_last(may, 2), first_last(may, 1)


def clamp(index, first, last):
    """``index`` clamped into ``[first, last]`` (scalars, in an index map)."""
    return jnp.minimum(jnp.maximum(index, first), last)
