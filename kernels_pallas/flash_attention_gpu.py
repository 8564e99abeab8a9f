"""flash_attention's Pallas kernels for GPU (Triton): forward, dq, and dk/dv.

The public function, its custom_vjp and the XLA path are in
`kernels_pallas.flash_attention`; the TPU (Mosaic) kernels in
`kernels_pallas.flash_attention_tpu`.

Layout: q, o, dq, d_out stay [B, T, N, H] and k, v, dk, dv [B, S, K, H], with H padded
to a power of two (Triton tiles; zero features change neither scores nor outputs).
Forward and dq: grid (batch, query head, query block), an inner fori_loop over key
blocks; the kv head of query head n is n // G. dk/dv: grid (batch, kv head, key block),
looping over the G query heads of the group and over query blocks, so dk and dv are
summed in registers and written once (no atomics). Two backward kernels rather than
jax's fused one, which needs as many query blocks as key blocks; here T and S differ.
A key (query) block whose position range cannot interact with the program's query
(key) block is skipped with lax.cond, using bounds computed from its positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import (
    DEFAULT_MASK_VALUE,
    MIN_TRITON_DOT_DIM,
    NN,
    NT,
    TN,
    gpu_compiler_params,
    matmul,
)
from kernels_pallas._flash_attention_common import (
    NO_POSITION,
    blocks_may_interact,
    probs_and_dscores,
    visible,
)


def _bounds(positions):
    """(min valid position, max valid position) of a 1-D block, as scalars."""
    valid = positions >= 0
    return (
        jnp.min(jnp.where(valid, positions, NO_POSITION)),
        jnp.max(jnp.where(valid, positions, -1)),
    )


def _forward_kernel(
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    window,
    block_k,
    num_k_blocks,
):
    """Blocks: q_pos [bq], k_pos [S], q and o [bq, H], k and v [S, H], lse [bq]."""
    q = q_ref[...]
    q_pos = q_pos_ref[...]
    q_min, q_max = _bounds(q_pos)
    block_q, head_dim = q.shape

    def body(k_block_index, carry):
        k_slice = pl.ds(k_block_index * block_k, block_k)
        k_pos = k_pos_ref[k_slice]
        k_min, k_max = _bounds(k_pos)

        def update(carry):
            m_prev, l_prev, acc_prev = carry
            k, v = k_ref[k_slice, :], v_ref[k_slice, :]
            mask = visible(q_pos[:, None], k_pos[None, :], window)
            scores = matmul(q, k, NT) * scale
            scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
            correction = jnp.exp(m_prev - m_next)
            probs = jnp.where(mask, jnp.exp(scores - m_next[:, None]), 0.0)
            l_next = correction * l_prev + jnp.sum(probs, axis=1)
            acc_next = correction[:, None] * acc_prev + matmul(probs.astype(v.dtype), v, NN)
            return m_next, l_next, acc_next

        may_interact = blocks_may_interact(q_min, q_max, k_min, k_max, window)
        return lax.cond(may_interact, update, lambda carry: carry, carry)

    init = (
        jnp.full((block_q,), DEFAULT_MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, head_dim), jnp.float32),
    )
    row_max, row_sum, acc = lax.fori_loop(0, num_k_blocks, body, init)
    has_keys = row_sum > 0
    row_sum_safe = jnp.where(has_keys, row_sum, 1.0)
    o_ref[...] = (acc / row_sum_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_keys, row_max + jnp.log(row_sum_safe), -jnp.inf)


def _pad_head_dim(*arrays):
    """Zero-pads the last dim (H) to a power of two >= 16, as Triton tiles need.

    Zero features add nothing to q.k and give zero output columns, sliced off after.
    """
    head_dim = arrays[0].shape[-1]
    pad = max(pl.next_power_of_2(head_dim), MIN_TRITON_DOT_DIM) - head_dim
    return tuple(jnp.pad(x, ((0, 0),) * 3 + ((0, pad),)) for x in arrays)


def forward(query, key, value, query_positions, key_positions, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    q, k, v = _pad_head_dim(query, key, value)
    head_dim_padded = q.shape[-1]
    q_spec = pl.BlockSpec((None, bq, None, head_dim_padded), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec(
        (None, seq_len_k, None, head_dim_padded), lambda b, n, i: (b, 0, n // group, 0)
    )
    out, lse = pl.pallas_call(
        functools.partial(
            _forward_kernel,
            scale=config.scale,
            window=config.window,
            block_k=bk,
            num_k_blocks=seq_len_k // bk,
        ),
        grid=(batch, num_heads, seq_len_q // bq),
        in_specs=[
            pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
            pl.BlockSpec((None, seq_len_k), lambda b, n, i: (b, 0)),
            q_spec,
            kv_spec,
            kv_spec,
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, query.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, seq_len_q), jnp.float32),
        ],
        compiler_params=gpu_compiler_params(head_dim_padded),
        interpret=config.interpret,
        name="flash_attention_fwd",
    )(query_positions, key_positions, q, k, v)
    return out[..., :head_dim], lse


def _dq_kernel(
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    scale,
    window,
    block_k,
    num_k_blocks,
):
    """Blocks: q, d_out, dq [bq, H]; lse, delta, q_pos [bq]; k, v [S, H]; k_pos [S]."""
    q, d_out = q_ref[...], d_out_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]  # [bq, 1] columns
    q_pos = q_pos_ref[...]
    q_min, q_max = _bounds(q_pos)

    def body(k_block_index, dq):
        k_slice = pl.ds(k_block_index * block_k, block_k)
        k_pos = k_pos_ref[k_slice]
        k_min, k_max = _bounds(k_pos)

        def update(dq):
            k, v = k_ref[k_slice, :], v_ref[k_slice, :]
            mask = visible(q_pos[:, None], k_pos[None, :], window)
            _, d_scores = probs_and_dscores(q, k, v, d_out, lse, delta, mask, scale)
            return dq + matmul(d_scores, k, NN)

        may_interact = blocks_may_interact(q_min, q_max, k_min, k_max, window)
        return lax.cond(may_interact, update, lambda dq: dq, dq)

    dq = lax.fori_loop(0, num_k_blocks, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    window,
    group,
    block_q,
    num_q_blocks,
):
    """Blocks: q and d_out [T, G, H]; lse, delta [G, T]; q_pos [T]; k, v, dk, dv [bk, H]."""
    k, v = k_ref[...], v_ref[...]
    k_pos = k_pos_ref[...]
    k_min, k_max = _bounds(k_pos)

    def body_for(head):
        def body(q_block_index, carry):
            q_slice = pl.ds(q_block_index * block_q, block_q)
            q_pos = q_pos_ref[q_slice]
            q_min, q_max = _bounds(q_pos)

            def update(carry):
                d_key, d_value = carry
                q, d_out = q_ref[q_slice, head, :], d_out_ref[q_slice, head, :]
                mask = visible(q_pos[:, None], k_pos[None, :], window)
                probs, d_scores = probs_and_dscores(
                    q,
                    k,
                    v,
                    d_out,
                    lse_ref[head, q_slice][:, None],
                    delta_ref[head, q_slice][:, None],
                    mask,
                    scale,
                )
                d_value = d_value + matmul(probs.astype(d_out.dtype), d_out, TN)
                d_key = d_key + matmul(d_scores, q, TN)
                return d_key, d_value

            may_interact = blocks_may_interact(q_min, q_max, k_min, k_max, window)
            return lax.cond(may_interact, update, lambda carry: carry, carry)

        return body

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for head in range(group):  # static: the G query heads that read this kv head
        carry = lax.fori_loop(0, num_q_blocks, body_for(head), carry)
    d_key, d_value = carry
    dk_ref[...] = d_key.astype(dk_ref.dtype)
    dv_ref[...] = d_value.astype(dv_ref.dtype)


def backward(query, key, value, query_positions, key_positions, d_out, lse, delta, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    q, k, v, d_out = _pad_head_dim(query, key, value, d_out)
    head_dim_padded = q.shape[-1]
    inputs = (query_positions, key_positions, q, k, v, d_out, lse, delta)

    q_block_spec = pl.BlockSpec((None, bq, None, head_dim_padded), lambda b, n, i: (b, i, n, 0))
    kv_full_spec = pl.BlockSpec(
        (None, seq_len_k, None, head_dim_padded), lambda b, n, i: (b, 0, n // group, 0)
    )
    row_block_spec = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel,
            scale=config.scale,
            window=config.window,
            block_k=bk,
            num_k_blocks=seq_len_k // bk,
        ),
        grid=(batch, num_heads, seq_len_q // bq),
        in_specs=[
            pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
            pl.BlockSpec((None, seq_len_k), lambda b, n, i: (b, 0)),
            q_block_spec,
            kv_full_spec,
            kv_full_spec,
            q_block_spec,
            row_block_spec,
            row_block_spec,
        ],
        out_specs=q_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, query.dtype),
        compiler_params=gpu_compiler_params(head_dim_padded),
        interpret=config.interpret,
        name="flash_attention_bwd_dq",
    )(*inputs)

    # Grid (batch, kv head, key block); the block of q covers the G heads of kv head h.
    q_group_spec = pl.BlockSpec(
        (None, seq_len_q, group, head_dim_padded), lambda b, h, j: (b, 0, h, 0)
    )
    kv_block_spec = pl.BlockSpec((None, bk, None, head_dim_padded), lambda b, h, j: (b, j, h, 0))
    row_group_spec = pl.BlockSpec((None, group, seq_len_q), lambda b, h, j: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            scale=config.scale,
            window=config.window,
            group=group,
            block_q=bq,
            num_q_blocks=seq_len_q // bq,
        ),
        grid=(batch, num_kv_heads, seq_len_k // bk),
        in_specs=[
            pl.BlockSpec((None, seq_len_q), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            q_group_spec,
            kv_block_spec,
            kv_block_spec,
            q_group_spec,
            row_group_spec,
            row_group_spec,
        ],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, key.dtype),
            jax.ShapeDtypeStruct(v.shape, value.dtype),
        ],
        compiler_params=gpu_compiler_params(head_dim_padded),
        interpret=config.interpret,
        name="flash_attention_bwd_dkv",
    )(*inputs)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]
