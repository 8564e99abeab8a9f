"""chunk_retrieval's Pallas kernels for GPU (Triton): forward, dq/dweights, and dk/dv.

The public function, its custom_vjp and the XLA path are in
`kernels_pallas.chunk_retrieval`; the TPU (Mosaic) kernels in
`kernels_pallas.chunk_retrieval_tpu`.

Layout: the public one, [B, C, Sq, H, D] and [B, N, Sk, Hkv, D], with Sq, Sk, D padded
to powers of two >= 16 (Triton tiles and tl.dot; padded keys are masked, padded
queries and features are zero and sliced off) and K to a power of two (empty slots).
A program's memory block is the whole [N, Sk, D] memory of its kv head; it loads the
chunk of a slot as `ref[index]`, pointer arithmetic rather than a copy.

Forward and dq/dweights: grid (B, C, H), a loop over the K slots. dk/dv: grid
(B, Hkv, N), each program looping over the sorted (query chunk, slot) pairs that read
its chunk (their range found by a search over the sorted chunk ids) and over the G
query heads of its kv head, so dk and dv are summed in registers and written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._chunk_retrieval_common import (
    masked_slot_weights,
    sorted_pairs,
    tile_backward,
    tile_probs,
)
from kernels_pallas._common import (
    MIN_TRITON_DOT_DIM,
    NN,
    TN,
    gpu_compiler_params,
    matmul,
    next_power_of_two,
)


def _pad(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _padded(q, k_mem, v_mem, indices, weights, d_out=None):
    """Pads Sq, Sk, D and K for Triton; returns the padded arrays and the real Sk."""
    seq_len_q, head_dim = q.shape[2], q.shape[4]
    seq_len_k, num_slots = k_mem.shape[2], indices.shape[2]
    padded_q = next_power_of_two(seq_len_q, MIN_TRITON_DOT_DIM)
    padded_k = next_power_of_two(seq_len_k, MIN_TRITON_DOT_DIM)
    padded_d = next_power_of_two(head_dim, MIN_TRITON_DOT_DIM)
    padded_slots = next_power_of_two(num_slots)
    q = _pad(_pad(q, 2, padded_q), 4, padded_d)
    k_mem = _pad(_pad(k_mem, 2, padded_k), 4, padded_d)
    v_mem = _pad(_pad(v_mem, 2, padded_k), 4, padded_d)
    slot_pad = ((0, 0), (0, 0), (0, padded_slots - num_slots))
    indices = jnp.pad(indices, slot_pad, constant_values=-1)
    weights = jnp.pad(masked_slot_weights(indices[..., :num_slots], weights), slot_pad)
    if d_out is not None:
        d_out = _pad(_pad(d_out, 2, padded_q), 4, padded_d)
    return q, k_mem, v_mem, indices, weights, d_out


def _slot_specs(q, k_mem, group):
    """(query tile, whole kv-head memory, slot vector) specs for a grid (b, c, n)."""
    seq_len_q, head_dim = q.shape[2], q.shape[4]
    num_memory_chunks, seq_len_k = k_mem.shape[1], k_mem.shape[2]
    query_spec = pl.BlockSpec(
        (None, None, seq_len_q, None, head_dim), lambda b, c, n: (b, c, 0, n, 0)
    )
    memory_spec = pl.BlockSpec(
        (None, num_memory_chunks, seq_len_k, None, head_dim),
        lambda b, c, n: (b, 0, 0, n // group, 0),
    )
    return query_spec, memory_spec


def _forward_kernel(indices_ref, weights_ref, q_ref, k_ref, v_ref, o_ref, *, scale, num_keys):
    """Blocks: indices, weights [K]; q, o [Sq, D]; k, v [N, Sk, D] (one kv head)."""
    q = q_ref[...]

    def body(slot, acc):
        index = indices_ref[slot]

        def update(acc):
            keys, values = k_ref[index], v_ref[index]
            probs = tile_probs(q, keys, scale, num_keys)
            return acc + weights_ref[slot] * matmul(probs.astype(values.dtype), values, NN)

        return lax.cond(index >= 0, update, lambda acc: acc, acc)

    acc = lax.fori_loop(0, indices_ref.shape[0], body, jnp.zeros(q.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def forward(q, k_mem, v_mem, indices, weights, config):
    batch, num_chunks, seq_len_q, num_heads, head_dim = q.shape
    seq_len_k, num_kv_heads = k_mem.shape[2], k_mem.shape[3]
    q_p, k_p, v_p, indices_p, weights_p, _ = _padded(q, k_mem, v_mem, indices, weights)
    query_spec, memory_spec = _slot_specs(q_p, k_p, num_heads // num_kv_heads)
    slot_spec = pl.BlockSpec((None, None, indices_p.shape[2]), lambda b, c, n: (b, c, 0))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, scale=config.scale, num_keys=seq_len_k),
        grid=(batch, num_chunks, num_heads),
        in_specs=[slot_spec, slot_spec, query_spec, memory_spec, memory_spec],
        out_specs=query_spec,
        out_shape=jax.ShapeDtypeStruct(q_p.shape, jnp.float32),
        compiler_params=gpu_compiler_params(q_p.shape[4]),
        interpret=config.interpret,
        name="chunk_retrieval_fwd",
    )(indices_p, weights_p, q_p, k_p, v_p)
    return out[:, :, :seq_len_q, :, :head_dim]


def _dq_kernel(
    indices_ref,
    weights_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    dq_ref,
    d_weights_ref,
    *,
    scale,
    num_keys,
):
    """Blocks: indices, weights, d_weights [K]; q, d_out, dq [Sq, D]; k, v [N, Sk, D]."""
    q, d_out = q_ref[...], d_out_ref[...]
    num_slots = indices_ref.shape[0]
    # Padded query rows have zero d_out, so they add nothing to any gradient.

    def body(slot, carry):
        index = indices_ref[slot]

        def update(carry):
            dq, d_weights = carry
            keys, values = k_ref[index], v_ref[index]
            _, d_scores, row_delta = tile_backward(
                q, keys, values, d_out, weights_ref[slot], scale, num_keys
            )
            slot_mask = lax.broadcasted_iota(jnp.int32, (num_slots,), 0) == slot
            d_weights = jnp.where(slot_mask, jnp.sum(row_delta), d_weights)
            return dq + matmul(d_scores, keys, NN), d_weights

        return lax.cond(index >= 0, update, lambda carry: carry, carry)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((num_slots,), jnp.float32))
    dq, d_weights = lax.fori_loop(0, num_slots, body, init)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    d_weights_ref[...] = d_weights


def _dkv_kernel(
    starts_ref,
    ends_ref,
    pairs_ref,
    weights_ref,
    q_ref,
    d_out_ref,
    k_ref,
    v_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    group,
    num_slots,
    num_keys,
):
    """Blocks: starts, ends scalars; pairs, weights [C*K]; q, d_out [C, Sq, H, D] (the
    batch row); k, v, dk, dv [Sk, D] (this program's chunk and kv head)."""
    keys, values = k_ref[...], v_ref[...]
    kv_head = pl.program_id(1)

    def body(i, carry):
        d_keys, d_values = carry
        chunk = pairs_ref[i] // num_slots
        weight = weights_ref[i]
        for g in range(group):  # static: the query heads reading this kv head
            head = kv_head * group + g
            q, d_out = q_ref[chunk, :, head, :], d_out_ref[chunk, :, head, :]
            probs, d_scores, _ = tile_backward(q, keys, values, d_out, weight, scale, num_keys)
            d_values = d_values + matmul((weight * probs).astype(d_out.dtype), d_out, TN)
            d_keys = d_keys + matmul(d_scores, q, TN)
        return d_keys, d_values

    init = (jnp.zeros(keys.shape, jnp.float32), jnp.zeros(values.shape, jnp.float32))
    d_keys, d_values = lax.fori_loop(starts_ref[...], ends_ref[...], body, init)
    dk_ref[...] = d_keys.astype(dk_ref.dtype)
    dv_ref[...] = d_values.astype(dv_ref.dtype)


def backward(q, k_mem, v_mem, indices, weights, d_out, config):
    batch, num_chunks, seq_len_q, num_heads, head_dim = q.shape
    num_memory_chunks, seq_len_k, num_kv_heads = k_mem.shape[1:4]
    num_slots = indices.shape[2]
    group = num_heads // num_kv_heads
    q_p, k_p, v_p, indices_p, weights_p, d_out_p = _padded(
        q, k_mem, v_mem, indices, weights, d_out.astype(q.dtype)
    )
    padded_slots = indices_p.shape[2]
    query_spec, memory_spec = _slot_specs(q_p, k_p, group)
    slot_spec = pl.BlockSpec((None, None, padded_slots), lambda b, c, n: (b, c, 0))
    dq, d_weights = pl.pallas_call(
        functools.partial(_dq_kernel, scale=config.scale, num_keys=seq_len_k),
        grid=(batch, num_chunks, num_heads),
        in_specs=[slot_spec, slot_spec, query_spec, memory_spec, memory_spec, query_spec],
        out_specs=[
            query_spec,
            pl.BlockSpec((None, None, None, padded_slots), lambda b, c, n: (b, c, n, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q_p.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_chunks, num_heads, padded_slots), jnp.float32),
        ],
        compiler_params=gpu_compiler_params(q_p.shape[4]),
        interpret=config.interpret,
        name="chunk_retrieval_bwd_dq",
    )(indices_p, weights_p, q_p, k_p, v_p, d_out_p)

    targets, pairs, pair_weights = sorted_pairs(indices_p, weights_p, num_memory_chunks)
    chunk_ids = jnp.arange(num_memory_chunks, dtype=jnp.int32)
    starts = jax.vmap(lambda t: jnp.searchsorted(t, chunk_ids, side="left"))(targets)
    ends = jax.vmap(lambda t: jnp.searchsorted(t, chunk_ids, side="right"))(targets)
    num_pairs = pairs.shape[1]
    scalar_spec = pl.BlockSpec((None, None), lambda b, h, n: (b, n))
    pair_spec = pl.BlockSpec((None, num_pairs), lambda b, h, n: (b, 0))
    row_spec = pl.BlockSpec((None,) + q_p.shape[1:], lambda b, h, n: (b, 0, 0, 0, 0))
    chunk_spec = pl.BlockSpec(
        (None, None, k_p.shape[2], None, k_p.shape[4]), lambda b, h, n: (b, n, 0, h, 0)
    )
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            scale=config.scale,
            group=group,
            num_slots=padded_slots,
            num_keys=seq_len_k,
        ),
        grid=(batch, num_kv_heads, num_memory_chunks),
        in_specs=[
            scalar_spec,
            scalar_spec,
            pair_spec,
            pair_spec,
            row_spec,
            row_spec,
            chunk_spec,
            chunk_spec,
        ],
        out_specs=[chunk_spec, chunk_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_p.shape, k_mem.dtype),
            jax.ShapeDtypeStruct(v_p.shape, v_mem.dtype),
        ],
        compiler_params=gpu_compiler_params(q_p.shape[4]),
        interpret=config.interpret,
        name="chunk_retrieval_bwd_dkv",
    )(
        starts.astype(jnp.int32),
        ends.astype(jnp.int32),
        pairs,
        pair_weights,
        q_p,
        d_out_p,
        k_p,
        v_p,
    )
    return (
        dq[:, :, :seq_len_q, :, :head_dim],
        dk[:, :, :seq_len_k, :, :head_dim],
        dv[:, :, :seq_len_k, :, :head_dim],
        jnp.sum(d_weights[..., :num_slots], axis=2).astype(weights.dtype),
    )
