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

Files: this one holds the public function, the custom_vjp and its dispatch, the XLA path
and the reference (last); `chunk_retrieval_tpu` the Mosaic kernels, `chunk_retrieval_gpu`
the Triton kernels, and `_chunk_retrieval_common` the slot weights, the sorted pairs and
the per-tile softmax and backward that they share.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import chunk_retrieval_gpu, chunk_retrieval_tpu
from kernels_pallas._chunk_retrieval_common import masked_slot_weights
from kernels_pallas._common import check_impl, check_scale, resolve_backend


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


# --------------------------------------------------------------------------------------
# impl="xla": a scan over the slots.
# --------------------------------------------------------------------------------------


def _softmax_rows(scores):
    """Exact softmax over the last axis of float32 scores (a whole chunk per row)."""
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


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
    slot_weights = masked_slot_weights(indices, weights)

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
    slot_weights = masked_slot_weights(indices, weights)
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


_FORWARD = {
    "xla": _xla_retrieval_forward,
    "tpu": chunk_retrieval_tpu.forward,
    "gpu": chunk_retrieval_gpu.forward,
}
_BACKWARD = {
    "xla": _xla_retrieval_backward,
    "tpu": chunk_retrieval_tpu.backward,
    "gpu": chunk_retrieval_gpu.backward,
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
