"""flash_attention's Pallas kernels for TPU (Mosaic): forward, dq, and dk/dv.

The public function, its custom_vjp and the XLA path are in
`kernels_pallas.flash_attention`; the GPU (Triton) kernels in
`kernels_pallas.flash_attention_gpu`.

Layout: q, o, dq as [B, K, G, T, H] (a free reshape of [B, N, T, H]); k, v, dk, dv as
[B, K, S, H]. The grid is (batch, kv head, query block, key block) for the forward and
dq kernels and (batch, kv head, key block, query block) for the dk/dv kernel, the last
axis sequential ("arbitrary") and accumulating into VMEM scratch. One query tile holds
the G query heads of a kv head, so each key/value tile is copied into VMEM once per
group and reused by its G heads. Query positions come lane-broadcast [B, T, 128] and
key positions sublane-broadcast [B, 8, S] (so each block is a whole (8, 128) tile);
per-block position bounds are scalar-prefetched into SMEM to skip blocks that cannot
interact.

Backward: two kernels (dq; dk and dv) rather than one. A fused kernel would have to
accumulate dq across the sequential key-block axis of a (.., key block, query block)
grid, which Pallas TPU output blocks cannot do (a block is written back when its index
changes); the price of two kernels is computing the scores twice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    DEFAULT_MASK_VALUE,
    NN,
    NT,
    NUM_LANES,
    NUM_SUBLANES,
    TN,
    matmul,
)
from kernels_pallas._flash_attention_common import (
    block_bounds,
    blocks_may_interact,
    clamp,
    fetch_ranges,
    probs_and_dscores,
    visible,
)


def _layout(query, key, value):
    batch, seq_len_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.transpose(0, 2, 1, 3).reshape(batch, num_kv_heads, group, seq_len_q, head_dim)
    return q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)


def _position_inputs(query_positions, key_positions, config):
    """Scalar-prefetch block bounds and fetch ranges (flat, for SMEM) and the broadcast
    position arrays.

    The prefetched scalars are (q_min, q_max, k_min, k_max), which the kernels read to
    skip blocks, then (k_first, k_last, q_first, q_last) of ``fetch_ranges``, which only
    the index maps read (``_fetched``): a skipped block is not copied either.
    """
    q_min, q_max = block_bounds(query_positions, config.block_q)
    k_min, k_max = block_bounds(key_positions, config.block_k)
    (k_first, k_last), (q_first, q_last) = fetch_ranges(q_min, q_max, k_min, k_max, config.window)
    batch, seq_len_q = query_positions.shape
    seq_len_k = key_positions.shape[1]
    # 1-D: a multi-dimensional SMEM array is padded per row.
    bounds = tuple(
        x.reshape(-1) for x in (q_min, q_max, k_min, k_max, k_first, k_last, q_first, q_last)
    )
    q_pos_lanes = jnp.broadcast_to(query_positions[:, :, None], (batch, seq_len_q, NUM_LANES))
    k_pos_sublanes = jnp.broadcast_to(key_positions[:, None, :], (batch, NUM_SUBLANES, seq_len_k))
    return bounds, q_pos_lanes, k_pos_sublanes


def _key_block(b, i, j, refs, num_q_blocks):
    """The key block a step (batch b, query block i, key step j) copies: j clamped into
    the keys query block i may interact with."""
    row = b * num_q_blocks + i
    return clamp(j, refs[4][row], refs[5][row])


def _query_block(b, i, j, refs, num_k_blocks):
    """The query block a step (batch b, key block i, query step j) copies."""
    row = b * num_k_blocks + i
    return clamp(j, refs[6][row], refs[7][row])


def _bounds_only(kernel):
    """``kernel`` given the first four prefetched scalars (the block bounds); the fetch
    ranges after them serve the index maps only."""

    def wrapped(q_min, q_max, k_min, k_max, _k_first, _k_last, _q_first, _q_last, *rest, **kw):
        return kernel(q_min, q_max, k_min, k_max, *rest, **kw)

    return wrapped


def _may_interact(
    bounds_refs, batch_index, q_block_index, k_block_index, num_q_blocks, num_k_blocks, window
):
    q_min_ref, q_max_ref, k_min_ref, k_max_ref = bounds_refs
    q_flat = batch_index * num_q_blocks + q_block_index
    k_flat = batch_index * num_k_blocks + k_block_index
    return blocks_may_interact(
        q_min_ref[q_flat], q_max_ref[q_flat], k_min_ref[k_flat], k_max_ref[k_flat], window
    )


def _block_mask(q_pos_ref, k_pos_ref, window):
    """[block_q, block_k] mask from a lane-broadcast and a sublane-broadcast tile."""
    return visible(q_pos_ref[:, 0:1], k_pos_ref[0:1, :], window)


def _forward_kernel(
    # Scalar prefetch (SMEM): per-block position bounds, flat over (batch, block).
    q_min_ref,
    q_max_ref,
    k_min_ref,
    k_max_ref,
    # Input blocks.
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    # Output blocks.
    o_ref,
    lse_ref,
    # VMEM scratch, carried across the key blocks.
    m_scratch,
    l_scratch,
    acc_scratch,
    *,
    scale,
    window,
    group,
    num_q_blocks,
    num_k_blocks,
):
    """One (batch, kv head, query block, key block) step of the online softmax.

    Blocks: q_pos [bq, 128], k_pos [8, bk], q [G, bq, H], k and v [bk, H], o [G, bq, H],
    lse [G, bq, 128]; scratch m and l [G, bq, 1], acc [G, bq, H], all float32.
    """
    batch_index, q_block_index, k_block_index = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(k_block_index == 0)
    def init():
        m_scratch[...] = jnp.full(m_scratch.shape, DEFAULT_MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    may_interact = _may_interact(
        (q_min_ref, q_max_ref, k_min_ref, k_max_ref),
        batch_index,
        q_block_index,
        k_block_index,
        num_q_blocks,
        num_k_blocks,
        window,
    )

    @pl.when(may_interact)
    def update():
        mask = _block_mask(q_pos_ref, k_pos_ref, window)  # shared by the G heads
        k, v = k_ref[...], v_ref[...]
        for head in range(group):  # static: G matmuls against the same VMEM k and v tiles
            scores = matmul(q_ref[head], k, NT)
            scores = jnp.where(mask, scores * scale, DEFAULT_MASK_VALUE)
            m_prev = m_scratch[head]
            m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            probs = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
            l_scratch[head] = correction * l_scratch[head] + probs.sum(axis=1, keepdims=True)
            acc_scratch[head] = correction * acc_scratch[head] + matmul(
                probs.astype(v.dtype), v, NN
            )
            m_scratch[head] = m_next

    @pl.when(k_block_index == num_k_blocks - 1)
    def finalize():
        for head in range(group):
            row_sum = l_scratch[head]
            has_keys = row_sum > 0
            row_sum_safe = jnp.where(has_keys, row_sum, 1.0)
            o_ref[head] = (acc_scratch[head] / row_sum_safe).astype(o_ref.dtype)
            lse = jnp.where(has_keys, m_scratch[head] + jnp.log(row_sum_safe), -jnp.inf)
            lse_ref[head] = jnp.broadcast_to(lse, lse_ref.shape[1:])


def forward(query, key, value, query_positions, key_positions, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    nq, nk = seq_len_q // bq, seq_len_k // bk
    q, k, v = _layout(query, key, value)
    bounds, q_pos_lanes, k_pos_sublanes = _position_inputs(query_positions, key_positions, config)

    # Index maps receive the grid indices, then the scalar-prefetch refs.
    q_spec = pl.BlockSpec((None, None, group, bq, head_dim), lambda b, h, i, j, *_: (b, h, 0, i, 0))
    key = lambda b, i, j, refs: _key_block(b, i, j, refs, nq)
    kv_spec = pl.BlockSpec(
        (None, None, bk, head_dim), lambda b, h, i, j, *refs: (b, h, key(b, i, j, refs), 0)
    )
    in_specs = [
        pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, i, 0)),
        pl.BlockSpec(
            (None, NUM_SUBLANES, bk), lambda b, h, i, j, *refs: (b, 0, key(b, i, j, refs))
        ),
        q_spec,
        kv_spec,
        kv_spec,
    ]
    out_specs = [
        q_spec,
        pl.BlockSpec((None, None, group, bq, NUM_LANES), lambda b, h, i, j, *_: (b, h, 0, i, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, query.dtype),
        jax.ShapeDtypeStruct((batch, num_kv_heads, group, seq_len_q, NUM_LANES), jnp.float32),
    ]
    kernel = functools.partial(
        _bounds_only(_forward_kernel),
        scale=config.scale,
        window=config.window,
        group=group,
        num_q_blocks=nq,
        num_k_blocks=nk,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds),
            grid=(batch, num_kv_heads, nq, nk),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((group, bq, 1), jnp.float32),  # running max
                pltpu.VMEM((group, bq, 1), jnp.float32),  # running sum
                pltpu.VMEM((group, bq, head_dim), jnp.float32),  # output accumulator
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=config.interpret,
        name="flash_attention_fwd",
    )(*bounds, q_pos_lanes, k_pos_sublanes, q, k, v)
    out = out.reshape(batch, num_heads, seq_len_q, head_dim).transpose(0, 2, 1, 3)
    # The lane-broadcast lse only lives until this slice; the residual is [B, N, T].
    return out, lse[..., 0].reshape(batch, num_heads, seq_len_q)


def _dq_kernel(
    # Scalar prefetch (SMEM), as in the forward kernel.
    q_min_ref,
    q_max_ref,
    k_min_ref,
    k_max_ref,
    # Input blocks.
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    # Output block, then its float32 accumulator.
    dq_ref,
    dq_scratch,
    *,
    scale,
    window,
    group,
    num_q_blocks,
    num_k_blocks,
):
    """dq of one query tile, accumulated over the key blocks (last grid axis).

    Blocks: q, d_out, dq [G, bq, H]; lse and delta [G, bq, 128]; k, v [bk, H].
    """
    batch_index, q_block_index, k_block_index = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(k_block_index == 0)
    def init():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, jnp.float32)

    may_interact = _may_interact(
        (q_min_ref, q_max_ref, k_min_ref, k_max_ref),
        batch_index,
        q_block_index,
        k_block_index,
        num_q_blocks,
        num_k_blocks,
        window,
    )

    @pl.when(may_interact)
    def update():
        mask = _block_mask(q_pos_ref, k_pos_ref, window)
        k, v = k_ref[...], v_ref[...]
        for head in range(group):
            _, d_scores = probs_and_dscores(
                q_ref[head],
                k,
                v,
                d_out_ref[head],
                lse_ref[head][:, 0:1],
                delta_ref[head][:, 0:1],
                mask,
                scale,
            )
            dq_scratch[head] += matmul(d_scores, k, NN)

    @pl.when(k_block_index == num_k_blocks - 1)
    def finalize():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _dkv_kernel(
    # Scalar prefetch (SMEM), as in the forward kernel.
    q_min_ref,
    q_max_ref,
    k_min_ref,
    k_max_ref,
    # Input blocks, as for the dq kernel.
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    # Output blocks, then their float32 accumulators.
    dk_ref,
    dv_ref,
    dk_scratch,
    dv_scratch,
    *,
    scale,
    window,
    group,
    num_q_blocks,
    num_k_blocks,
):
    """dk and dv of one key tile, summed over the G heads and the query blocks (last axis)."""
    batch_index, k_block_index, q_block_index = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(q_block_index == 0)
    def init():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, jnp.float32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, jnp.float32)

    may_interact = _may_interact(
        (q_min_ref, q_max_ref, k_min_ref, k_max_ref),
        batch_index,
        q_block_index,
        k_block_index,
        num_q_blocks,
        num_k_blocks,
        window,
    )

    @pl.when(may_interact)
    def update():
        mask = _block_mask(q_pos_ref, k_pos_ref, window)
        k, v = k_ref[...], v_ref[...]
        for head in range(group):
            q, d_out = q_ref[head], d_out_ref[head]
            probs, d_scores = probs_and_dscores(
                q, k, v, d_out, lse_ref[head][:, 0:1], delta_ref[head][:, 0:1], mask, scale
            )
            dv_scratch[...] += matmul(probs.astype(d_out.dtype), d_out, TN)
            dk_scratch[...] += matmul(d_scores, q, TN)

    @pl.when(q_block_index == num_q_blocks - 1)
    def finalize():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def backward(query, key, value, query_positions, key_positions, d_out, lse, delta, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    nq, nk = seq_len_q // bq, seq_len_k // bk
    q, k, v = _layout(query, key, value)
    d_out = d_out.transpose(0, 2, 1, 3).reshape(q.shape)
    # Row statistics lane-broadcast again, only for the duration of the backward kernels.
    rows = lambda x: jnp.broadcast_to(
        x.reshape(batch, num_kv_heads, group, seq_len_q, 1),
        (batch, num_kv_heads, group, seq_len_q, NUM_LANES),
    )
    lse, delta = rows(lse), rows(delta)
    bounds, q_pos_lanes, k_pos_sublanes = _position_inputs(query_positions, key_positions, config)
    kernel_args = dict(
        scale=config.scale, window=config.window, group=group, num_q_blocks=nq, num_k_blocks=nk
    )
    compiler_params = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )

    def specs(q_index, k_index):
        """Input specs for a grid whose (query block, key block) indices the two maps pick
        (from the batch and grid indices and the prefetched scalars)."""
        q_map = lambda b, h, i, j, *refs: (b, h, 0, q_index(b, i, j, refs), 0)
        kv_map = lambda b, h, i, j, *refs: (b, h, k_index(b, i, j, refs), 0)
        q_spec = pl.BlockSpec((None, None, group, bq, head_dim), q_map)
        row_spec = pl.BlockSpec((None, None, group, bq, NUM_LANES), q_map)
        kv_spec = pl.BlockSpec((None, None, bk, head_dim), kv_map)
        return (
            [
                pl.BlockSpec(
                    (None, bq, NUM_LANES), lambda b, h, i, j, *refs: (b, q_index(b, i, j, refs), 0)
                ),
                pl.BlockSpec(
                    (None, NUM_SUBLANES, bk),
                    lambda b, h, i, j, *refs: (b, 0, k_index(b, i, j, refs)),
                ),
                q_spec,
                kv_spec,
                kv_spec,
                q_spec,
                row_spec,
                row_spec,
            ],
            q_spec,
            kv_spec,
        )

    inputs = (*bounds, q_pos_lanes, k_pos_sublanes, q, k, v, d_out, lse, delta)

    # Grid (batch, kv head, query block, key block); the key step copies within range.
    dq_in_specs, dq_spec, _ = specs(
        lambda b, i, j, refs: i, lambda b, i, j, refs: _key_block(b, i, j, refs, nq)
    )
    dq = pl.pallas_call(
        functools.partial(_bounds_only(_dq_kernel), **kernel_args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds),
            grid=(batch, num_kv_heads, nq, nk),
            in_specs=dq_in_specs,
            out_specs=dq_spec,
            scratch_shapes=[pltpu.VMEM((group, bq, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, query.dtype),
        compiler_params=compiler_params,
        interpret=config.interpret,
        name="flash_attention_bwd_dq",
    )(*inputs)

    # Grid (batch, kv head, key block, query block): i indexes keys, j queries.
    dkv_in_specs, _, dkv_spec = specs(
        lambda b, i, j, refs: _query_block(b, i, j, refs, nk), lambda b, i, j, refs: i
    )
    dk, dv = pl.pallas_call(
        functools.partial(_bounds_only(_dkv_kernel), **kernel_args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds),
            grid=(batch, num_kv_heads, nk, nq),
            in_specs=dkv_in_specs,
            out_specs=[dkv_spec, dkv_spec],
            scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32)] * 2,
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, key.dtype),
            jax.ShapeDtypeStruct(v.shape, value.dtype),
        ],
        compiler_params=compiler_params,
        interpret=config.interpret,
        name="flash_attention_bwd_dkv",
    )(*inputs)
    dq = dq.reshape(batch, num_heads, seq_len_q, head_dim).transpose(0, 2, 1, 3)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
