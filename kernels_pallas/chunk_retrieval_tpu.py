"""chunk_retrieval's Pallas kernels for TPU (Mosaic): forward, dq/dweights, and dk/dv.

The public function, its custom_vjp and the XLA path are in
`kernels_pallas.chunk_retrieval`; the GPU (Triton) kernels in
`kernels_pallas.chunk_retrieval_gpu`.

Layout: q, out, dq, d_out as [B, C, Hkv, G, Sq, D]; k_mem, v_mem, dk, dv as
[B, N, Hkv, Sk, D] (transposes of the public layouts), so one block is a whole
(G, Sq, D) query tile or a whole (Sk, D) chunk of one kv head: full trailing dims,
which Mosaic tiles whatever their size. Scalar-prefetched SMEM arrays (indices,
weights, sorted pairs) feed the index maps, so a grid step DMAs only the chunk it
reads.

Forward and dq/dweights: grid (B, C, Hkv, K), the slot axis sequential, accumulating
in VMEM scratch. dk/dv: grid (B, Hkv, C*K) over the (query chunk, slot) pairs sorted
by memory chunk; the output block follows the pair's chunk, so the pairs of one chunk
are consecutive steps on one resident block: summed in scratch, written at the run's
last step. A chunk no pair reads is never visited: the outputs alias zero-filled
inputs, so such chunks keep their zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._chunk_retrieval_common import (
    masked_slot_weights,
    sorted_pairs,
    tile_backward,
    tile_probs,
)
from kernels_pallas._common import NN, NUM_LANES, TN, matmul


def _query_layout(x, num_kv_heads):
    batch, num_chunks, seq_len, num_heads, head_dim = x.shape
    group = num_heads // num_kv_heads
    x = x.reshape(batch, num_chunks, seq_len, num_kv_heads, group, head_dim)
    return x.transpose(0, 1, 3, 4, 2, 5)


def _query_unlayout(x):
    batch, num_chunks, num_kv_heads, group, seq_len, head_dim = x.shape
    x = x.transpose(0, 1, 4, 2, 3, 5)
    return x.reshape(batch, num_chunks, seq_len, num_kv_heads * group, head_dim)


def _memory_layout(x):
    return x.transpose(0, 1, 3, 2, 4)  # [B, N, Sk, Hkv, D] <-> [B, N, Hkv, Sk, D]


def _slot_specs(group, seq_len_q, seq_len_k, head_dim, num_chunks, num_slots):
    """BlockSpecs (query tile, memory chunk) for a grid (b, c, h, k) with prefetched indices."""

    def memory_map(b, c, h, k, indices_ref, weights_ref):
        slot = indices_ref[(b * num_chunks + c) * num_slots + k]
        return b, jnp.maximum(slot, 0), h, 0, 0

    query_spec = pl.BlockSpec(
        (None, None, None, group, seq_len_q, head_dim), lambda b, c, h, k, *_: (b, c, h, 0, 0, 0)
    )
    memory_spec = pl.BlockSpec((None, None, None, seq_len_k, head_dim), memory_map)
    return query_spec, memory_spec


def _forward_kernel(
    indices_ref, weights_ref, q_ref, k_ref, v_ref, o_ref, acc_scratch, *, scale, num_chunks
):
    """One (batch, chunk, kv head, slot) step. Blocks: q, o [G, Sq, D]; k, v [Sk, D]."""
    b, c, k = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    num_slots = pl.num_programs(3)
    flat = (b * num_chunks + c) * num_slots + k

    @pl.when(k == 0)
    def init():
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    @pl.when(indices_ref[flat] >= 0)
    def update():
        weight = weights_ref[flat]
        keys, values = k_ref[...], v_ref[...]
        for head in range(q_ref.shape[0]):  # static: G heads share the chunk's VMEM tile
            probs = tile_probs(q_ref[head], keys, scale, keys.shape[0])
            acc_scratch[head] += weight * matmul(probs.astype(values.dtype), values, NN)

    @pl.when(k == num_slots - 1)
    def finalize():
        o_ref[...] = acc_scratch[...].astype(o_ref.dtype)


def forward(q, k_mem, v_mem, indices, weights, config):
    batch, num_chunks, seq_len_q, _, head_dim = q.shape
    seq_len_k, num_kv_heads = k_mem.shape[2], k_mem.shape[3]
    num_slots = indices.shape[2]
    q_tiles = _query_layout(q, num_kv_heads)
    group = q_tiles.shape[3]
    query_spec, memory_spec = _slot_specs(
        group, seq_len_q, seq_len_k, head_dim, num_chunks, num_slots
    )
    out = pl.pallas_call(
        functools.partial(_forward_kernel, scale=config.scale, num_chunks=num_chunks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_chunks, num_kv_heads, num_slots),
            in_specs=[query_spec, memory_spec, memory_spec],
            out_specs=query_spec,
            scratch_shapes=[pltpu.VMEM((group, seq_len_q, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=config.interpret,
        name="chunk_retrieval_fwd",
    )(
        indices.reshape(-1),
        masked_slot_weights(indices, weights).reshape(-1),
        q_tiles,
        _memory_layout(k_mem),
        _memory_layout(v_mem),
    )
    return _query_unlayout(out)


def _dq_kernel(
    indices_ref,
    weights_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    dq_ref,
    d_weights_ref,
    dq_scratch,
    *,
    scale,
    num_chunks,
):
    """dq and the per-slot dweights of one query tile, over the slots (last grid axis).

    Blocks: q, d_out, dq [G, Sq, D]; k, v [Sk, D]; d_weights [K, 128] (lane-broadcast,
    resident across the slots of this tile).
    """
    b, c, k = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    num_slots = pl.num_programs(3)
    flat = (b * num_chunks + c) * num_slots + k

    @pl.when(k == 0)
    def init():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, jnp.float32)
        d_weights_ref[...] = jnp.zeros(d_weights_ref.shape, jnp.float32)

    @pl.when(indices_ref[flat] >= 0)
    def update():
        weight = weights_ref[flat]
        keys, values = k_ref[...], v_ref[...]
        d_weight = jnp.zeros((1, 1), jnp.float32)
        for head in range(q_ref.shape[0]):
            _, d_scores, row_delta = tile_backward(
                q_ref[head], keys, values, d_out_ref[head], weight, scale, keys.shape[0]
            )
            dq_scratch[head] += matmul(d_scores, keys, NN)
            d_weight += jnp.sum(row_delta, axis=0, keepdims=True)
        row = lax.broadcasted_iota(jnp.int32, d_weights_ref.shape, 0)
        d_weights_ref[...] = jnp.where(row == k, d_weight, d_weights_ref[...])

    @pl.when(k == num_slots - 1)
    def finalize():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _dkv_kernel(
    targets_ref,
    pairs_ref,
    weights_ref,
    q_ref,
    d_out_ref,
    k_ref,
    v_ref,
    dk_zeros_ref,
    dv_zeros_ref,
    dk_ref,
    dv_ref,
    dk_scratch,
    dv_scratch,
    *,
    scale,
    num_pairs,
):
    """One (batch, kv head, sorted pair) step of the dk/dv sum of the pair's chunk.

    Blocks: q, d_out [G, Sq, D] of the pair's query chunk; k, v, dk, dv [Sk, D] of the
    chunk it read. `targets` holds each sorted pair's block index (clamped to N - 1, so
    empty slots, which sort last with zero weight, join the last chunk's run).
    """
    del dk_zeros_ref, dv_zeros_ref  # aliased to the outputs: only unvisited chunks read them
    b, p = pl.program_id(0), pl.program_id(2)
    base = b * num_pairs
    target = targets_ref[base + p]
    first = (p == 0) | (targets_ref[base + jnp.maximum(p - 1, 0)] != target)
    last = (p == num_pairs - 1) | (targets_ref[base + jnp.minimum(p + 1, num_pairs - 1)] != target)
    weight = weights_ref[base + p]

    @pl.when(first)
    def init():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, jnp.float32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, jnp.float32)

    @pl.when(weight != 0)  # a zero weight (or an empty slot) adds exactly zero
    def update():
        keys, values = k_ref[...], v_ref[...]
        for head in range(q_ref.shape[0]):
            q, d_out = q_ref[head], d_out_ref[head]
            probs, d_scores, _ = tile_backward(q, keys, values, d_out, weight, scale, keys.shape[0])
            dv_scratch[...] += matmul((weight * probs).astype(d_out.dtype), d_out, TN)
            dk_scratch[...] += matmul(d_scores, q, TN)

    @pl.when(last)
    def finalize():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def backward(q, k_mem, v_mem, indices, weights, d_out, config):
    batch, num_chunks, seq_len_q, _, head_dim = q.shape
    num_memory_chunks, seq_len_k, num_kv_heads = k_mem.shape[1:4]
    num_slots = indices.shape[2]
    q_tiles = _query_layout(q, num_kv_heads)
    d_out_tiles = _query_layout(d_out.astype(q.dtype), num_kv_heads)
    k_tiles, v_tiles = _memory_layout(k_mem), _memory_layout(v_mem)
    group = q_tiles.shape[3]
    query_spec, memory_spec = _slot_specs(
        group, seq_len_q, seq_len_k, head_dim, num_chunks, num_slots
    )
    dq, d_weights = pl.pallas_call(
        functools.partial(_dq_kernel, scale=config.scale, num_chunks=num_chunks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_chunks, num_kv_heads, num_slots),
            in_specs=[query_spec, memory_spec, memory_spec, query_spec],
            out_specs=[
                query_spec,
                pl.BlockSpec(
                    (None, None, None, num_slots, NUM_LANES),
                    lambda b, c, h, k, *_: (b, c, h, 0, 0),
                ),
            ],
            scratch_shapes=[pltpu.VMEM((group, seq_len_q, head_dim), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
            jax.ShapeDtypeStruct(
                (batch, num_chunks, num_kv_heads, num_slots, NUM_LANES), jnp.float32
            ),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=config.interpret,
        name="chunk_retrieval_bwd_dq",
    )(
        indices.reshape(-1),
        masked_slot_weights(indices, weights).reshape(-1),
        q_tiles,
        k_tiles,
        v_tiles,
        d_out_tiles,
    )

    targets, pairs, pair_weights = sorted_pairs(indices, weights, num_memory_chunks)
    num_pairs = pairs.shape[1]
    block_targets = jnp.minimum(targets, num_memory_chunks - 1)

    def pair_query_map(b, h, p, targets_ref, pairs_ref, weights_ref):
        return b, pairs_ref[b * num_pairs + p] // num_slots, h, 0, 0, 0

    def pair_memory_map(b, h, p, targets_ref, pairs_ref, weights_ref):
        return b, targets_ref[b * num_pairs + p], h, 0, 0

    pair_query_spec = pl.BlockSpec((None, None, None, group, seq_len_q, head_dim), pair_query_map)
    pair_memory_spec = pl.BlockSpec((None, None, None, seq_len_k, head_dim), pair_memory_map)
    unblocked = pl.BlockSpec(memory_space=pl.ANY)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=config.scale, num_pairs=num_pairs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, num_kv_heads, num_pairs),
            in_specs=[
                pair_query_spec,
                pair_query_spec,
                pair_memory_spec,
                pair_memory_spec,
                unblocked,
                unblocked,
            ],
            out_specs=[pair_memory_spec, pair_memory_spec],
            scratch_shapes=[pltpu.VMEM((seq_len_k, head_dim), jnp.float32)] * 2,
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k_tiles.shape, k_mem.dtype),
            jax.ShapeDtypeStruct(v_tiles.shape, v_mem.dtype),
        ],
        # Operand numbering counts the three scalar-prefetch arrays first.
        input_output_aliases={7: 0, 8: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=config.interpret,
        name="chunk_retrieval_bwd_dkv",
    )(
        block_targets.reshape(-1),
        pairs.reshape(-1),
        pair_weights.reshape(-1),
        q_tiles,
        d_out_tiles,
        k_tiles,
        v_tiles,
        jnp.zeros(k_tiles.shape, k_mem.dtype),
        jnp.zeros(v_tiles.shape, v_mem.dtype),
    )
    return (
        _query_unlayout(dq),
        _memory_layout(dk),
        _memory_layout(dv),
        jnp.sum(d_weights[..., 0], axis=2).astype(weights.dtype),
    )
