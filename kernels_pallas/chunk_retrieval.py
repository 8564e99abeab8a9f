"""Chunk retrieval attention (Grouped Cross Attention): XLA and Pallas (TPU, GPU).

Each query chunk ``c`` of batch row ``b`` attends to ``K`` retrieved memory chunks, each
with its own softmax, and mixes the results with fusion weights::

    out[b, c] = sum_k  weights[b, c, k] * softmax(q[b, c] k_mem[b, i]^T * scale) v_mem[b, i]
                with i = indices[b, c, k]

per query head ``h``, reading kv head ``h // G``. An index outside ``[0, N)`` (``-1`` by
convention) marks an empty slot: it contributes nothing and its weight gets no gradient.
Duplicate indices are allowed (the chunk then counts once per slot). The indices are
integers and get no gradient; ``q``, ``k_mem``, ``v_mem`` and ``weights`` do, which is how
a GCA retriever learns: through the fusion weights.

Shapes use ``B`` batch, ``C`` query chunks, ``Sq`` queries per chunk, ``H`` query heads,
``D`` head dim, ``N`` memory chunks, ``Sk`` tokens per memory chunk, ``Hkv`` kv heads
(``H = Hkv * G``), ``K`` retrieval slots. In GCA ``Sq = Sk`` (a chunk's tokens attend
to whole earlier chunks) except while decoding, where one token (``Sq = 1``) attends.

Implementations (``impl``):

* ``"xla"``: a ``lax.scan`` over the K slots, gathering one slot's chunks at a time, with
    a ``custom_vjp`` whose backward recomputes the probabilities slot by slot and
    scatter-adds the chunk gradients into the memory.
* ``"pallas"``: kernels that read the selected chunks straight from the memory through
    their indices (no gathered copy of the memory is ever written):
    - TPU (Mosaic): the indices are scalar-prefetched into SMEM and drive the BlockSpec
      index maps, so each grid step DMAs exactly one selected chunk into VMEM.
    - GPU (Triton): each program loops over its slots and loads the selected chunk by
      pointer arithmetic on the memory.
    The backward recomputes probabilities: one kernel for dq and dweights (per query
    chunk, looping over slots) and one for dk and dv (per memory chunk, over the
    (query chunk, slot) pairs that selected it, sorted by chunk so that each chunk's
    gradient is summed in VMEM or registers and written once, without atomics).

Each retrieved chunk's softmax covers all ``Sk`` of its tokens at once (a chunk is one
tile), so no online softmax is needed; scores, softmax and accumulators are float32
whatever the input dtype, and the output is cast to ``q.dtype``.

Gradients, with ``P_k`` a chunk's probabilities, ``O_k = P_k V_k`` its unweighted output
and ``dO`` the output cotangent: ``dweights_k = sum(dO * O_k)`` over heads, queries and
features; ``dS_k = w_k P_k * (dO V_k^T - rowsum(dO * O_k))``; ``dq = scale sum_k dS_k K_k``,
``dK_k = scale dS_k^T q``, ``dV_k = w_k P_k^T dO``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    DEFAULT_MASK_VALUE,
    MIN_TRITON_DOT_DIM,
    NN,
    NT,
    NUM_LANES,
    TN,
    check_impl,
    check_scale,
    gpu_compiler_params,
    matmul,
    next_power_of_two,
    resolve_backend,
)


@dataclasses.dataclass(frozen=True)
class _RetrievalConfig:
    """Static settings of one call (hashable: a jit static)."""

    scale: float
    impl: str
    backend: str
    interpret: Any


def chunk_retrieval(
    q: jax.Array,
    k_mem: jax.Array,
    v_mem: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    *,
    scale: float | None = None,
    impl: str = "pallas",
    interpret: Any = None,
    backend: str | None = None,
) -> jax.Array:
    """Weighted attention of each query chunk over its retrieved memory chunks.

    Args:
        q: [B, C, Sq, H, D] float32 or bfloat16, the queries of each query chunk.
        k_mem: [B, N, Sk, Hkv, D], the dtype of q; H must be a multiple of Hkv.
        v_mem: [B, N, Sk, Hkv, D].
        indices: int [B, C, K], the memory chunk of each slot; outside [0, N) (-1 by
            convention) marks an empty slot. Concrete indices are checked to lie in
            [-1, N); traced ones outside [0, N) are treated as empty.
        weights: float [B, C, K], the fusion weight of each slot (ignored for empty slots).
        scale: multiplies the scores; defaults to ``D ** -0.5``.
        impl: ``"pallas"`` (kernels) or ``"xla"`` (plain JAX).
        interpret: run the Pallas kernels in interpret mode: None (the default) does so
            exactly when no backend is named and JAX runs on CPU; True, False or a
            ``pltpu.InterpretParams`` (TPU-style kernels).
        backend: Pallas lowering, ``"tpu"`` (Mosaic) or ``"gpu"`` (Triton). Defaults to the
            default JAX backend, and to the TPU-style kernels on CPU; naming one lowers for
            that accelerator (ahead of time from a CPU host).

    Returns:
        [B, C, Sq, H, D] in q.dtype; zero for a chunk whose slots are all empty.

    Raises:
        ValueError: on wrong shapes, dtypes, indices or settings, naming the argument.
    """
    _check_retrieval_inputs(q, k_mem, v_mem, indices, weights)
    scale = check_scale(scale, q.shape[-1])
    check_impl(impl)
    backend, interpret = resolve_backend(impl, backend, interpret)
    config = _RetrievalConfig(scale=scale, impl=impl, backend=backend, interpret=interpret)
    return _chunk_retrieval(q, k_mem, v_mem, indices, weights, config)


def _check_retrieval_inputs(q, k_mem, v_mem, indices, weights):
    """Raises ValueError unless the arrays have the documented shapes and dtypes."""
    for name, array in (("q", q), ("k_mem", k_mem), ("v_mem", v_mem)):
        if getattr(array, "ndim", None) != 5:
            raise ValueError(
                f"{name} must have rank 5 (q [B, C, Sq, H, D], k_mem and v_mem "
                f"[B, N, Sk, Hkv, D]), got {name}.shape={getattr(array, 'shape', None)}."
            )
        if array.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name} must be float32 or bfloat16, got {name}.dtype={array.dtype}.")
    if not q.dtype == k_mem.dtype == v_mem.dtype:
        raise ValueError(
            f"q, k_mem and v_mem must share a dtype, got {q.dtype=}, {k_mem.dtype=}, "
            f"{v_mem.dtype=}."
        )
    if k_mem.shape != v_mem.shape:
        raise ValueError(
            f"k_mem and v_mem must have the same shape, got {k_mem.shape=}, {v_mem.shape=}."
        )
    batch, num_chunks, _, num_heads, head_dim = q.shape
    if k_mem.shape[0] != batch or k_mem.shape[4] != head_dim:
        raise ValueError(
            "k_mem must match q in batch and head dim ([B, N, Sk, Hkv, D] vs "
            f"[B, C, Sq, H, D]), got {q.shape=}, {k_mem.shape=}."
        )
    num_kv_heads = k_mem.shape[3]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads H must be a multiple of kv heads Hkv, got {q.shape=} (H={num_heads}), "
            f"{k_mem.shape=} (Hkv={num_kv_heads})."
        )
    if min(q.shape) < 1 or min(k_mem.shape) < 1:
        raise ValueError(f"q and k_mem must have no empty axis, got {q.shape=}, {k_mem.shape=}.")
    if getattr(indices, "ndim", None) != 3 or indices.shape[:2] != (batch, num_chunks):
        raise ValueError(
            f"indices must have shape [B, C, K] = ({batch}, {num_chunks}, K), got "
            f"indices.shape={getattr(indices, 'shape', None)}."
        )
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must have an integer dtype, got {indices.dtype=}.")
    if indices.shape[2] < 1:
        raise ValueError(f"indices must have at least one slot (K >= 1), got {indices.shape=}.")
    if getattr(weights, "shape", None) != indices.shape:
        raise ValueError(
            f"weights must have the shape of indices {indices.shape}, got "
            f"weights.shape={getattr(weights, 'shape', None)}."
        )
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"weights must have a float dtype, got {weights.dtype=}.")
    if not isinstance(indices, jax.core.Tracer):
        values = np.asarray(indices)
        num_memory_chunks = k_mem.shape[1]
        if values.size and (values.min() < -1 or values.max() >= num_memory_chunks):
            raise ValueError(
                f"indices must lie in [-1, N) = [-1, {num_memory_chunks}) (-1: empty slot), "
                f"got values from {values.min()} to {values.max()}."
            )


# --------------------------------------------------------------------------------------
# custom_vjp and dispatch.
# --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config",))
def _chunk_retrieval(q, k_mem, v_mem, indices, weights, config: _RetrievalConfig):
    num_memory_chunks = k_mem.shape[1]
    indices = indices.astype(jnp.int32)
    valid = (indices >= 0) & (indices < num_memory_chunks)
    indices = jnp.where(valid, indices, -1)
    out = _retrieve(q, k_mem, v_mem, indices, weights.astype(jnp.float32), config)
    return out.astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _retrieve(q, k_mem, v_mem, indices, weights, config):
    return _FORWARD[config.backend](q, k_mem, v_mem, indices, weights, config)


def _retrieve_fwd(q, k_mem, v_mem, indices, weights, config):
    out = _FORWARD[config.backend](q, k_mem, v_mem, indices, weights, config)
    return out, (q, k_mem, v_mem, indices, weights)


def _retrieve_bwd(config, residuals, d_out):
    q, k_mem, v_mem, indices, weights = residuals
    dq, dk, dv, d_weights = _BACKWARD[config.backend](
        q, k_mem, v_mem, indices, weights, d_out, config
    )
    d_weights = jnp.where(indices >= 0, d_weights, 0.0)
    # The indices are integers: no cotangent.
    return dq, dk, dv, None, d_weights


_retrieve.defvjp(_retrieve_fwd, _retrieve_bwd)


def _slot_weights(indices, weights):
    """The weights with empty slots zeroed (float32)."""
    return jnp.where(indices >= 0, weights, 0.0).astype(jnp.float32)


def _sorted_pairs(indices, weights, num_memory_chunks):
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
    pair_weights = jnp.take_along_axis(_slot_weights(indices, weights).reshape(batch, -1), pairs, 1)
    return targets.astype(jnp.int32), pairs, pair_weights


def _softmax_rows(scores):
    """Exact softmax over the last axis of float32 scores (a whole chunk per row)."""
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


# --------------------------------------------------------------------------------------
# impl="xla": a scan over the slots.
# --------------------------------------------------------------------------------------


def _xla_gather(memory, slot_indices):
    """memory [B, N, Sk, Hkv, D], slot_indices [B, C] -> [B, C, Sk, Hkv, D]."""
    return jax.vmap(lambda m, i: m[i])(memory, jnp.maximum(slot_indices, 0))


def _xla_slot_probs(q_grouped, k, scale):
    """[B, C, Hkv, G, Sq, Sk] float32 probabilities of one slot."""
    scores = jnp.einsum("bcqhgd,bcshd->bchgqs", q_grouped, k, preferred_element_type=jnp.float32)
    return _softmax_rows(scores * scale)


def _xla_grouped(x, num_kv_heads):
    batch, num_chunks, seq_len, num_heads, head_dim = x.shape
    return x.reshape(batch, num_chunks, seq_len, num_kv_heads, num_heads // num_kv_heads, head_dim)


def _xla_retrieval_forward(q, k_mem, v_mem, indices, weights, config):
    num_kv_heads = k_mem.shape[3]
    q_grouped = _xla_grouped(q, num_kv_heads)
    slot_weights = _slot_weights(indices, weights)

    def step(acc, slot):
        slot_indices, slot_weight = slot
        probs = _xla_slot_probs(q_grouped, _xla_gather(k_mem, slot_indices), config.scale)
        v = _xla_gather(v_mem, slot_indices).astype(jnp.float32)
        out = jnp.einsum("bchgqs,bcshd->bcqhgd", probs, v)
        return acc + slot_weight[:, :, None, None, None, None] * out, None

    acc = jnp.zeros(q_grouped.shape, jnp.float32)
    acc, _ = lax.scan(step, acc, (jnp.moveaxis(indices, 2, 0), jnp.moveaxis(slot_weights, 2, 0)))
    return acc.reshape(q.shape)


def _xla_retrieval_backward(q, k_mem, v_mem, indices, weights, d_out, config):
    num_kv_heads = k_mem.shape[3]
    q_grouped = _xla_grouped(q, num_kv_heads).astype(jnp.float32)
    d_out = _xla_grouped(d_out, num_kv_heads).astype(jnp.float32)
    slot_weights = _slot_weights(indices, weights)
    batch_rows = jnp.arange(q.shape[0])[:, None]

    def step(carry, slot):
        dq, dk_mem, dv_mem = carry
        slot_indices, slot_weight = slot
        k = _xla_gather(k_mem, slot_indices).astype(jnp.float32)
        v = _xla_gather(v_mem, slot_indices).astype(jnp.float32)
        probs = _xla_slot_probs(q_grouped, k, config.scale)
        d_probs = jnp.einsum("bcqhgd,bcshd->bchgqs", d_out, v)
        row_delta = jnp.sum(probs * d_probs, axis=-1, keepdims=True)  # rowsum(dO * O_k)
        d_weight = jnp.sum(row_delta, axis=(2, 3, 4, 5))
        w = slot_weight[:, :, None, None, None, None]
        d_scores = w * probs * (d_probs - row_delta) * config.scale
        dq = dq + jnp.einsum("bchgqs,bcshd->bcqhgd", d_scores, k)
        dk = jnp.einsum("bchgqs,bcqhgd->bcshd", d_scores, q_grouped)
        dv = jnp.einsum("bchgqs,bcqhgd->bcshd", w * probs, d_out)
        # Empty slots have zero weight, so their dk and dv are zero wherever they land.
        target = jnp.maximum(slot_indices, 0)
        dk_mem = dk_mem.at[batch_rows, target].add(dk)
        dv_mem = dv_mem.at[batch_rows, target].add(dv)
        return (dq, dk_mem, dv_mem), d_weight

    init = (
        jnp.zeros(q_grouped.shape, jnp.float32),
        jnp.zeros(k_mem.shape, jnp.float32),
        jnp.zeros(v_mem.shape, jnp.float32),
    )
    (dq, dk_mem, dv_mem), d_weights = lax.scan(
        step, init, (jnp.moveaxis(indices, 2, 0), jnp.moveaxis(slot_weights, 2, 0))
    )
    return (
        dq.reshape(q.shape).astype(q.dtype),
        dk_mem.astype(k_mem.dtype),
        dv_mem.astype(v_mem.dtype),
        jnp.moveaxis(d_weights, 0, 2).astype(weights.dtype),
    )


# --------------------------------------------------------------------------------------
# Pieces shared by the kernels (2-D tiles of one head).
# --------------------------------------------------------------------------------------


def _tile_probs(q, k, scale, num_keys):
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


def _tile_backward(q, k, v, d_out, weight, scale, num_keys):
    """Recomputed probabilities of one head and chunk, and its backward pieces.

    Returns:
        probs [Sq, Sk] float32; d_scores [Sq, Sk] in q's dtype, already multiplied by
        the weight and the scale (dq = d_scores @ k, dk = d_scores^T @ q); and the row
        deltas rowsum(dO * O_k) [Sq, 1] float32, whose total is this head's dweight.
    """
    probs = _tile_probs(q, k, scale, num_keys)
    d_probs = matmul(d_out, v, NT)
    row_delta = jnp.sum(probs * d_probs, axis=1, keepdims=True)
    d_scores = (weight * scale * probs * (d_probs - row_delta)).astype(q.dtype)
    return probs, d_scores, row_delta


# --------------------------------------------------------------------------------------
# impl="pallas", backend="tpu": Mosaic kernels.
#
# Layout: q, out, dq, d_out as [B, C, Hkv, G, Sq, D]; k_mem, v_mem, dk, dv as
# [B, N, Hkv, Sk, D] (transposes of the public layouts), so one block is a whole
# (G, Sq, D) query tile or a whole (Sk, D) chunk of one kv head: full trailing dims,
# which Mosaic tiles whatever their size. Scalar-prefetched SMEM arrays (indices,
# weights, sorted pairs) feed the index maps, so a grid step DMAs only the chunk it
# reads.
#
# Forward and dq/dweights: grid (B, C, Hkv, K), the slot axis sequential, accumulating
# in VMEM scratch. dk/dv: grid (B, Hkv, C*K) over the (query chunk, slot) pairs sorted
# by memory chunk; the output block follows the pair's chunk, so the pairs of one chunk
# are consecutive steps on one resident block: summed in scratch, written at the run's
# last step. A chunk no pair reads is never visited: the outputs alias zero-filled
# inputs, so such chunks keep their zeros.
# --------------------------------------------------------------------------------------


def _tpu_query_layout(x, num_kv_heads):
    batch, num_chunks, seq_len, num_heads, head_dim = x.shape
    group = num_heads // num_kv_heads
    x = x.reshape(batch, num_chunks, seq_len, num_kv_heads, group, head_dim)
    return x.transpose(0, 1, 3, 4, 2, 5)


def _tpu_query_unlayout(x):
    batch, num_chunks, num_kv_heads, group, seq_len, head_dim = x.shape
    x = x.transpose(0, 1, 4, 2, 3, 5)
    return x.reshape(batch, num_chunks, seq_len, num_kv_heads * group, head_dim)


def _tpu_memory_layout(x):
    return x.transpose(0, 1, 3, 2, 4)  # [B, N, Sk, Hkv, D] <-> [B, N, Hkv, Sk, D]


def _tpu_slot_specs(group, seq_len_q, seq_len_k, head_dim, num_chunks, num_slots):
    """BlockSpecs (query tile, memory chunk) for a grid (b, c, h, k) with prefetched indices."""

    def memory_map(b, c, h, k, indices_ref, weights_ref):
        slot = indices_ref[(b * num_chunks + c) * num_slots + k]
        return b, jnp.maximum(slot, 0), h, 0, 0

    query_spec = pl.BlockSpec(
        (None, None, None, group, seq_len_q, head_dim), lambda b, c, h, k, *_: (b, c, h, 0, 0, 0)
    )
    memory_spec = pl.BlockSpec((None, None, None, seq_len_k, head_dim), memory_map)
    return query_spec, memory_spec


def _tpu_retrieval_forward_kernel(
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
            probs = _tile_probs(q_ref[head], keys, scale, keys.shape[0])
            acc_scratch[head] += weight * matmul(probs.astype(values.dtype), values, NN)

    @pl.when(k == num_slots - 1)
    def finalize():
        o_ref[...] = acc_scratch[...].astype(o_ref.dtype)


def _tpu_retrieval_forward(q, k_mem, v_mem, indices, weights, config):
    batch, num_chunks, seq_len_q, _, head_dim = q.shape
    seq_len_k, num_kv_heads = k_mem.shape[2], k_mem.shape[3]
    num_slots = indices.shape[2]
    q_tiles = _tpu_query_layout(q, num_kv_heads)
    group = q_tiles.shape[3]
    query_spec, memory_spec = _tpu_slot_specs(
        group, seq_len_q, seq_len_k, head_dim, num_chunks, num_slots
    )
    out = pl.pallas_call(
        functools.partial(_tpu_retrieval_forward_kernel, scale=config.scale, num_chunks=num_chunks),
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
        _slot_weights(indices, weights).reshape(-1),
        q_tiles,
        _tpu_memory_layout(k_mem),
        _tpu_memory_layout(v_mem),
    )
    return _tpu_query_unlayout(out)


def _tpu_retrieval_dq_kernel(
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
            _, d_scores, row_delta = _tile_backward(
                q_ref[head], keys, values, d_out_ref[head], weight, scale, keys.shape[0]
            )
            dq_scratch[head] += matmul(d_scores, keys, NN)
            d_weight += jnp.sum(row_delta, axis=0, keepdims=True)
        row = lax.broadcasted_iota(jnp.int32, d_weights_ref.shape, 0)
        d_weights_ref[...] = jnp.where(row == k, d_weight, d_weights_ref[...])

    @pl.when(k == num_slots - 1)
    def finalize():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _tpu_retrieval_dkv_kernel(
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
            probs, d_scores, _ = _tile_backward(
                q, keys, values, d_out, weight, scale, keys.shape[0]
            )
            dv_scratch[...] += matmul((weight * probs).astype(d_out.dtype), d_out, TN)
            dk_scratch[...] += matmul(d_scores, q, TN)

    @pl.when(last)
    def finalize():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _tpu_retrieval_backward(q, k_mem, v_mem, indices, weights, d_out, config):
    batch, num_chunks, seq_len_q, _, head_dim = q.shape
    num_memory_chunks, seq_len_k, num_kv_heads = k_mem.shape[1:4]
    num_slots = indices.shape[2]
    q_tiles = _tpu_query_layout(q, num_kv_heads)
    d_out_tiles = _tpu_query_layout(d_out.astype(q.dtype), num_kv_heads)
    k_tiles, v_tiles = _tpu_memory_layout(k_mem), _tpu_memory_layout(v_mem)
    group = q_tiles.shape[3]
    query_spec, memory_spec = _tpu_slot_specs(
        group, seq_len_q, seq_len_k, head_dim, num_chunks, num_slots
    )
    dq, d_weights = pl.pallas_call(
        functools.partial(_tpu_retrieval_dq_kernel, scale=config.scale, num_chunks=num_chunks),
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
        _slot_weights(indices, weights).reshape(-1),
        q_tiles,
        k_tiles,
        v_tiles,
        d_out_tiles,
    )

    targets, pairs, pair_weights = _sorted_pairs(indices, weights, num_memory_chunks)
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
        functools.partial(_tpu_retrieval_dkv_kernel, scale=config.scale, num_pairs=num_pairs),
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
        _tpu_query_unlayout(dq),
        _tpu_memory_layout(dk),
        _tpu_memory_layout(dv),
        jnp.sum(d_weights[..., 0], axis=2).astype(weights.dtype),
    )


# --------------------------------------------------------------------------------------
# impl="pallas", backend="gpu": Triton kernels.
#
# Layout: the public one, [B, C, Sq, H, D] and [B, N, Sk, Hkv, D], with Sq, Sk, D padded
# to powers of two >= 16 (Triton tiles and tl.dot; padded keys are masked, padded
# queries and features are zero and sliced off) and K to a power of two (empty slots).
# A program's memory block is the whole [N, Sk, D] memory of its kv head; it loads the
# chunk of a slot as `ref[index]`, pointer arithmetic rather than a copy.
#
# Forward and dq/dweights: grid (B, C, H), a loop over the K slots. dk/dv: grid
# (B, Hkv, N), each program looping over the sorted (query chunk, slot) pairs that read
# its chunk (their range found by a search over the sorted chunk ids) and over the G
# query heads of its kv head, so dk and dv are summed in registers and written once.
# --------------------------------------------------------------------------------------


def _gpu_pad(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _gpu_padded(q, k_mem, v_mem, indices, weights, d_out=None):
    """Pads Sq, Sk, D and K for Triton; returns the padded arrays and the real Sk."""
    seq_len_q, head_dim = q.shape[2], q.shape[4]
    seq_len_k, num_slots = k_mem.shape[2], indices.shape[2]
    padded_q = next_power_of_two(seq_len_q, MIN_TRITON_DOT_DIM)
    padded_k = next_power_of_two(seq_len_k, MIN_TRITON_DOT_DIM)
    padded_d = next_power_of_two(head_dim, MIN_TRITON_DOT_DIM)
    padded_slots = next_power_of_two(num_slots)
    q = _gpu_pad(_gpu_pad(q, 2, padded_q), 4, padded_d)
    k_mem = _gpu_pad(_gpu_pad(k_mem, 2, padded_k), 4, padded_d)
    v_mem = _gpu_pad(_gpu_pad(v_mem, 2, padded_k), 4, padded_d)
    slot_pad = ((0, 0), (0, 0), (0, padded_slots - num_slots))
    indices = jnp.pad(indices, slot_pad, constant_values=-1)
    weights = jnp.pad(_slot_weights(indices[..., :num_slots], weights), slot_pad)
    if d_out is not None:
        d_out = _gpu_pad(_gpu_pad(d_out, 2, padded_q), 4, padded_d)
    return q, k_mem, v_mem, indices, weights, d_out


def _gpu_slot_specs(q, k_mem, group):
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


def _gpu_retrieval_forward_kernel(
    indices_ref, weights_ref, q_ref, k_ref, v_ref, o_ref, *, scale, num_keys
):
    """Blocks: indices, weights [K]; q, o [Sq, D]; k, v [N, Sk, D] (one kv head)."""
    q = q_ref[...]

    def body(slot, acc):
        index = indices_ref[slot]

        def update(acc):
            keys, values = k_ref[index], v_ref[index]
            probs = _tile_probs(q, keys, scale, num_keys)
            return acc + weights_ref[slot] * matmul(probs.astype(values.dtype), values, NN)

        return lax.cond(index >= 0, update, lambda acc: acc, acc)

    acc = lax.fori_loop(0, indices_ref.shape[0], body, jnp.zeros(q.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _gpu_retrieval_forward(q, k_mem, v_mem, indices, weights, config):
    batch, num_chunks, seq_len_q, num_heads, head_dim = q.shape
    seq_len_k, num_kv_heads = k_mem.shape[2], k_mem.shape[3]
    q_p, k_p, v_p, indices_p, weights_p, _ = _gpu_padded(q, k_mem, v_mem, indices, weights)
    query_spec, memory_spec = _gpu_slot_specs(q_p, k_p, num_heads // num_kv_heads)
    slot_spec = pl.BlockSpec((None, None, indices_p.shape[2]), lambda b, c, n: (b, c, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_retrieval_forward_kernel, scale=config.scale, num_keys=seq_len_k),
        grid=(batch, num_chunks, num_heads),
        in_specs=[slot_spec, slot_spec, query_spec, memory_spec, memory_spec],
        out_specs=query_spec,
        out_shape=jax.ShapeDtypeStruct(q_p.shape, jnp.float32),
        compiler_params=gpu_compiler_params(q_p.shape[4]),
        interpret=config.interpret,
        name="chunk_retrieval_fwd",
    )(indices_p, weights_p, q_p, k_p, v_p)
    return out[:, :, :seq_len_q, :, :head_dim]


def _gpu_retrieval_dq_kernel(
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
            _, d_scores, row_delta = _tile_backward(
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


def _gpu_retrieval_dkv_kernel(
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
            probs, d_scores, _ = _tile_backward(q, keys, values, d_out, weight, scale, num_keys)
            d_values = d_values + matmul((weight * probs).astype(d_out.dtype), d_out, TN)
            d_keys = d_keys + matmul(d_scores, q, TN)
        return d_keys, d_values

    init = (jnp.zeros(keys.shape, jnp.float32), jnp.zeros(values.shape, jnp.float32))
    d_keys, d_values = lax.fori_loop(starts_ref[...], ends_ref[...], body, init)
    dk_ref[...] = d_keys.astype(dk_ref.dtype)
    dv_ref[...] = d_values.astype(dv_ref.dtype)


def _gpu_retrieval_backward(q, k_mem, v_mem, indices, weights, d_out, config):
    batch, num_chunks, seq_len_q, num_heads, head_dim = q.shape
    num_memory_chunks, seq_len_k, num_kv_heads = k_mem.shape[1:4]
    num_slots = indices.shape[2]
    group = num_heads // num_kv_heads
    q_p, k_p, v_p, indices_p, weights_p, d_out_p = _gpu_padded(
        q, k_mem, v_mem, indices, weights, d_out.astype(q.dtype)
    )
    padded_slots = indices_p.shape[2]
    query_spec, memory_spec = _gpu_slot_specs(q_p, k_p, group)
    slot_spec = pl.BlockSpec((None, None, padded_slots), lambda b, c, n: (b, c, 0))
    dq, d_weights = pl.pallas_call(
        functools.partial(_gpu_retrieval_dq_kernel, scale=config.scale, num_keys=seq_len_k),
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

    targets, pairs, pair_weights = _sorted_pairs(indices_p, weights_p, num_memory_chunks)
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
            _gpu_retrieval_dkv_kernel,
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


_FORWARD = {
    "xla": _xla_retrieval_forward,
    "tpu": _tpu_retrieval_forward,
    "gpu": _gpu_retrieval_forward,
}
_BACKWARD = {
    "xla": _xla_retrieval_backward,
    "tpu": _tpu_retrieval_backward,
    "gpu": _gpu_retrieval_backward,
}


# --------------------------------------------------------------------------------------
# Reference.
# --------------------------------------------------------------------------------------


def chunk_retrieval_reference(q, k_mem, v_mem, indices, weights, *, scale=None):
    """Plain-jnp chunk retrieval: gathers every selected chunk and materialises all scores.

    Args:
        q: [B, C, Sq, H, D].
        k_mem, v_mem: [B, N, Sk, Hkv, D] with H a multiple of Hkv.
        indices: int [B, C, K]; outside [0, N) = empty slot.
        weights: float [B, C, K].
        scale: score multiplier, default D ** -0.5.

    Returns:
        [B, C, Sq, H, D] in q.dtype.
    """
    batch, num_chunks, seq_len_q, num_heads, head_dim = q.shape
    num_memory_chunks, num_kv_heads = k_mem.shape[1], k_mem.shape[3]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    valid = (indices >= 0) & (indices < num_memory_chunks)
    safe = jnp.where(valid, indices, 0)
    k_sel = jax.vmap(lambda m, i: m[i])(k_mem, safe)  # [B, C, K, Sk, Hkv, D]
    v_sel = jax.vmap(lambda m, i: m[i])(v_mem, safe)
    q_grouped = q.reshape(batch, num_chunks, seq_len_q, num_kv_heads, group, head_dim)
    scores = jnp.einsum(
        "bcqhgd,bcjshd->bcjhgqs", q_grouped, k_sel, preferred_element_type=jnp.float32
    )
    probs = jax.nn.softmax(scores * scale, axis=-1)
    per_chunk = jnp.einsum(
        "bcjhgqs,bcjshd->bcjqhgd", probs, v_sel.astype(jnp.float32)
    )  # [B, C, K, Sq, Hkv, G, D]
    w = jnp.where(valid, weights, 0).astype(jnp.float32)
    out = jnp.einsum("bcj,bcjqhgd->bcqhgd", w, per_chunk)
    return out.reshape(q.shape).astype(q.dtype)
