"""Split-K decode attention over QuantSpec's packed KV store, dequantized in the kernel.

``quant_kv_attention(q, k_upper, k_lower, k_scale, k_min, v_upper, v_lower, v_scale,
v_min, key_positions, cut, *, bits)`` attends queries ``q [B, T, N, H]`` (one decode
token, or gamma + 1 being verified) to the quantized part of one layer's cache and
returns the attention output over it with its log-sum-exp, which
``merge_attention`` combines with the attention over the full-precision buffer and the
call's own keys (``buffer_attention``: a multi-query pass whose causal tail covers the
gamma + 1 tokens being verified; the paper's LSE merge). Keys are stored per channel over
groups of ``G`` slots (``k_scale``, ``k_min`` ``[B, K, S / G, H]``), values per slot over
groups of ``G`` channels (``v_scale``, ``v_min`` ``[B, K, S, H / G]``), codes two per
byte along the channels (``[B, K, S, H / 2]``, element ``2i`` in the low nibble):
``bits=4`` reads the upper plane only (the draft), ``bits=8`` both (the target). A query
of row ``t`` sees the slots below ``cut[b, t]`` whose position is not negative.

The kernel (``impl="pallas"``; TPU Mosaic, or Triton on GPU) runs a grid ``(B, K, S /
G)``: each program dequantizes one key group and the matching values in VMEM/SRAM and
computes the partial softmax of every query row of its kv head over them (the split-K
of flash decoding); the partials are merged outside by their log-sum-exps. The codes are
never unpacked into an interleaved layout: the dot products run over even and odd
channels separately (``q_even k_low + q_odd k_high``) and the outputs are interleaved
once at the end. The Pallas path needs whole-head value groups (``G == H``, the paper's
setting with G = 128); ``impl="xla"`` takes any G. Forward only: decoding needs no
gradient of the cache. Each kernel has its plain-jnp reference at the bottom.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    DEFAULT_MASK_VALUE,
    IMPLEMENTATIONS,
    MIN_TRITON_DOT_DIM,
    NN,
    NT,
    matmul,
    next_power_of_two,
    resolve_backend,
)

try:  # the Triton lowering parameters
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - older jax
    plgpu = None


def _check(q, k_upper, k_scale, v_scale, key_positions, cut, bits, impl):
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, N, H], got shape {q.shape}")
    b, t, n, h = q.shape
    if k_upper.ndim != 4 or k_upper.shape[0] != b or k_upper.shape[3] * 2 != h:
        raise ValueError(
            f"codes must be [B={b}, K, S, H/2={h // 2}] uint8, got shape {k_upper.shape}"
        )
    kv, s = k_upper.shape[1], k_upper.shape[2]
    if n % kv:
        raise ValueError(f"the {n} query heads must be a multiple of the {kv} kv heads")
    group = s // k_scale.shape[2] if k_scale.shape[2] else 0
    if k_scale.shape != (b, kv, s // max(group, 1), h) or not group or s % group:
        raise ValueError(
            f"k_scale must be [B, K, S/G, H] for codes {k_upper.shape}, got {k_scale.shape}"
        )
    if h % group or v_scale.shape != (b, kv, s, h // group):
        raise ValueError(
            f"v_scale must be [B, K, S, H/G] = {(b, kv, s, h // group)}, got {v_scale.shape}"
        )
    if key_positions.shape != (b, s) or cut.shape != (b, t):
        raise ValueError(
            f"key_positions must be [B, S] = {(b, s)} and cut [B, T] = {(b, t)}, got "
            f"{key_positions.shape} and {cut.shape}"
        )
    return group


def quant_kv_attention(
    q,
    k_upper,
    k_lower,
    k_scale,
    k_min,
    v_upper,
    v_lower,
    v_scale,
    v_min,
    key_positions,
    cut,
    *,
    bits: int = 8,
    scale: float | None = None,
    impl: str = "pallas",
    backend: str | None = None,
    interpret=None,
):
    """Attention of ``q`` over the quantized store (see the module docstring).

    Returns:
        ``(out, lse)``: float32 ``[B, T, N, H]``, the softmax-weighted values over the
        visible slots (0 where none is visible), and float32 ``[B, T, N]``, the
        log-sum-exp of the scaled scores (a very negative number where none is visible).
    """
    group = _check(q, k_upper, k_scale, v_scale, key_positions, cut, bits, impl)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend, interpret = resolve_backend(impl, backend, interpret)
    if backend == "xla":
        return quant_kv_attention_reference(
            q,
            k_upper,
            k_lower,
            k_scale,
            k_min,
            v_upper,
            v_lower,
            v_scale,
            v_min,
            key_positions,
            cut,
            bits=bits,
            scale=scale,
        )
    if group != q.shape[-1]:
        raise ValueError(
            f"impl='pallas' needs value groups of the whole head (G = head_dim = "
            f"{q.shape[-1]}), got G = {group}; use impl='xla'"
        )
    return _pallas(
        q,
        (k_upper, k_lower, k_scale, k_min, v_upper, v_lower, v_scale, v_min),
        key_positions,
        cut,
        bits=bits,
        scale=scale,
        group=group,
        backend=backend,
        interpret=interpret,
    )


def merge_attention(parts):
    """Combines ``[(out [B, T, N, H], lse [B, T, N]), ...]`` over disjoint key sets into
    the attention over their union."""
    lses = jnp.stack([lse for _, lse in parts])
    top = jnp.max(lses, axis=0)
    weights = jnp.exp(lses - top)  # [P, B, T, N]
    total = jnp.sum(weights, axis=0)
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, parts))
    return out / jnp.where(total > 0, total, 1.0)[..., None]


# --------------------------------------------------------------------------------------
# The kernel.
# --------------------------------------------------------------------------------------


def _kernel(
    qe_ref,
    qo_ref,
    cut_ref,
    pos_ref,
    ku_ref,
    kl_ref,
    kse_ref,
    kso_ref,
    kme_ref,
    kmo_ref,
    vu_ref,
    vl_ref,
    vs_ref,
    vm_ref,
    oe_ref,
    oo_ref,
    lse_ref,
    *,
    bits,
    group,
):
    """One kv head, one key group. Blocks: qe, qo [Q, H/2]; cut [Q, 1]; pos [1, G];
    codes [G, H/2]; key scales and minima (even / odd channels) [1, H/2]; value scale and
    minimum [G, 1]; outputs [Q, H/2] twice and [Q, 1]."""
    j = pl.program_id(2)
    ku = ku_ref[...].astype(jnp.int32)
    vu = vu_ref[...].astype(jnp.int32)
    kse, kso = kse_ref[...].astype(jnp.float32), kso_ref[...].astype(jnp.float32)
    k_even = kme_ref[...].astype(jnp.float32) + kse * (ku & 15).astype(jnp.float32)
    k_odd = kmo_ref[...].astype(jnp.float32) + kso * (ku >> 4).astype(jnp.float32)
    vs, vm = vs_ref[...].astype(jnp.float32), vm_ref[...].astype(jnp.float32)
    v_even = vm + vs * (vu & 15).astype(jnp.float32)
    v_odd = vm + vs * (vu >> 4).astype(jnp.float32)
    if bits == 8:
        kl = kl_ref[...].astype(jnp.int32)
        vl = vl_ref[...].astype(jnp.int32)
        k_even += (kse / 16.0) * ((kl & 15) - 8).astype(jnp.float32)
        k_odd += (kso / 16.0) * ((kl >> 4) - 8).astype(jnp.float32)
        v_even += (vs / 16.0) * ((vl & 15) - 8).astype(jnp.float32)
        v_odd += (vs / 16.0) * ((vl >> 4) - 8).astype(jnp.float32)
    scores = matmul(qe_ref[...], k_even, NT) + matmul(qo_ref[...], k_odd, NT)  # [Q, G]
    slots = j * group + lax.broadcasted_iota(jnp.int32, (1, group), 1)
    visible = (slots < cut_ref[...]) & (pos_ref[...] >= 0)
    scores = jnp.where(visible, scores, DEFAULT_MASK_VALUE)
    top = jnp.max(scores, axis=1, keepdims=True)
    probs = jnp.where(visible, jnp.exp(scores - top), 0.0)
    total = jnp.sum(probs, axis=1, keepdims=True)
    inverse = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    oe_ref[...] = matmul(probs, v_even, NN) * inverse
    oo_ref[...] = matmul(probs, v_odd, NN) * inverse
    lse_ref[...] = jnp.where(
        total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), DEFAULT_MASK_VALUE
    )


def _pallas(q, store, key_positions, cut, *, bits, scale, group, backend, interpret):
    k_upper, k_lower, k_scale, k_min, v_upper, v_lower, v_scale, v_min = store
    b, t, n, h = q.shape
    kv, s = k_upper.shape[1], k_upper.shape[2]
    blocks, half = s // group, h // 2
    # Query rows of a kv head: its query heads x the T tokens, [B, K, Q, H] (scaled).
    rows = jnp.transpose(q.reshape(b, t, kv, n // kv, h), (0, 2, 3, 1, 4)).reshape(b, kv, -1, h)
    rows = rows.astype(jnp.float32) * scale
    num_rows = rows.shape[2]
    cut_rows = jnp.tile(cut.astype(jnp.int32), (1, n // kv))[..., None]  # [B, Q, 1]
    padded = num_rows
    if backend == "gpu":  # tl.dot needs at least 16 rows
        padded = next_power_of_two(num_rows, MIN_TRITON_DOT_DIM)
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, padded - num_rows), (0, 0)))
        cut_rows = jnp.pad(cut_rows, ((0, 0), (0, padded - num_rows), (0, 0)))
    q_even, q_odd = rows[..., 0::2], rows[..., 1::2]
    # Scales and minima in float32 (Mosaic loads no float16 vectors; they are a 1/G or
    # 1/H share of the store's bytes).
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    k_scale, k_min, v_scale, v_min = f32(k_scale), f32(k_min), f32(v_scale), f32(v_min)
    per_group = lambda x: x.reshape(b, kv, blocks, 1, h)  # noqa: E731
    kse, kso = per_group(k_scale)[..., 0::2], per_group(k_scale)[..., 1::2]
    kme, kmo = per_group(k_min)[..., 0::2], per_group(k_min)[..., 1::2]
    positions = key_positions.astype(jnp.int32).reshape(b, blocks, 1, group)

    query_spec = pl.BlockSpec((None, None, padded, half), lambda i, k, j: (i, k, 0, 0))
    cut_spec = pl.BlockSpec((None, padded, 1), lambda i, k, j: (i, 0, 0))
    pos_spec = pl.BlockSpec((None, None, 1, group), lambda i, k, j: (i, j, 0, 0))
    code_spec = pl.BlockSpec((None, None, group, half), lambda i, k, j: (i, k, j, 0))
    key_scale_spec = pl.BlockSpec((None, None, None, 1, half), lambda i, k, j: (i, k, j, 0, 0))
    value_scale_spec = pl.BlockSpec((None, None, group, 1), lambda i, k, j: (i, k, j, 0))
    out_spec = pl.BlockSpec((None, None, None, padded, half), lambda i, k, j: (i, k, j, 0, 0))
    lse_spec = pl.BlockSpec((None, None, None, padded, 1), lambda i, k, j: (i, k, j, 0, 0))
    if backend == "gpu":
        params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    out_even, out_odd, lse = pl.pallas_call(
        functools.partial(_kernel, bits=bits, group=group),
        grid=(b, kv, blocks),
        in_specs=[
            query_spec,
            query_spec,
            cut_spec,
            pos_spec,
            code_spec,
            code_spec,
            key_scale_spec,
            key_scale_spec,
            key_scale_spec,
            key_scale_spec,
            code_spec,
            code_spec,
            value_scale_spec,
            value_scale_spec,
        ],
        out_specs=[out_spec, out_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv, blocks, padded, half), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, blocks, padded, half), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, blocks, padded, 1), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="quant_kv_attention",
    )(
        q_even,
        q_odd,
        cut_rows,
        positions,
        k_upper,
        k_lower,
        kse,
        kso,
        kme,
        kmo,
        v_upper,
        v_lower,
        v_scale,
        v_min,
    )
    # Merge the key groups (split-K) by their log-sum-exps, then interleave the channels.
    lse = lse[..., 0]  # [B, K, NB, Q]
    top = jnp.max(lse, axis=2, keepdims=True)
    weights = jnp.exp(lse - top)
    total = jnp.sum(weights, axis=2, keepdims=True)
    denominator = jnp.where(total > 0, total, 1.0)[:, :, 0, :, None]  # [B, K, Q, 1]

    def merge(o):
        return jnp.sum(weights[..., None] * o, axis=2) / denominator

    out = jnp.stack([merge(out_even), merge(out_odd)], axis=-1).reshape(b, kv, padded, h)
    lse_all = (top + jnp.log(jnp.where(total > 0, total, 1.0)))[:, :, 0]  # [B, K, Q]
    out, lse_all = out[:, :, :num_rows], lse_all[:, :, :num_rows]
    out = jnp.transpose(out.reshape(b, kv, n // kv, t, h), (0, 3, 1, 2, 4)).reshape(b, t, n, h)
    lse_all = jnp.transpose(lse_all.reshape(b, kv, n // kv, t), (0, 3, 1, 2)).reshape(b, t, n)
    return out, lse_all


# --------------------------------------------------------------------------------------
# The full-precision buffer: a multi-query pass with a causal tail.
# --------------------------------------------------------------------------------------


def buffer_attention(
    q,
    keys,
    values,
    key_slots,
    key_positions,
    query_positions,
    cut,
    *,
    scale: float | None = None,
    impl: str = "pallas",
    backend: str | None = None,
    interpret=None,
):
    """Attention of ``q [B, T, N, H]`` over full-precision keys and values ``[B, L, K,
    H]`` (the buffer's recent tokens followed by the call's own), each with its slot and
    position ``[B, L]``: a query of row ``t`` sees a key whose slot is at least
    ``cut[b, t]`` and whose position is not negative and at most the query's (the causal
    tail over the verified tokens). Returns ``(out, lse)`` as ``quant_kv_attention``."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    b, t, n, h = q.shape
    length, kv = keys.shape[1], keys.shape[2]
    if keys.shape != (b, length, kv, h) or values.shape != keys.shape or n % kv:
        raise ValueError(
            f"keys and values must be [B, L, K, H] with B, H of q {q.shape} and K dividing "
            f"N; got {keys.shape} and {values.shape}"
        )
    if key_slots.shape != (b, length) or key_positions.shape != (b, length):
        raise ValueError(f"key_slots and key_positions must be [B, L] = {(b, length)}")
    if query_positions.shape != (b, t) or cut.shape != (b, t):
        raise ValueError(f"query_positions and cut must be [B, T] = {(b, t)}")
    scale = h**-0.5 if scale is None else float(scale)
    backend, interpret = resolve_backend(impl, backend, interpret)
    if backend == "xla":
        return buffer_attention_reference(
            q, keys, values, key_slots, key_positions, query_positions, cut, scale=scale
        )
    group = n // kv
    rows = jnp.transpose(q.reshape(b, t, kv, group, h), (0, 2, 3, 1, 4)).reshape(b, kv, -1, h)
    rows = rows.astype(jnp.float32) * scale
    per_row = lambda x: jnp.tile(x.astype(jnp.int32), (1, group))[..., None]  # noqa: E731
    cut_rows, query_rows = per_row(cut), per_row(query_positions)  # [B, Q, 1]
    keys_t = jnp.swapaxes(keys, 1, 2).astype(jnp.float32)  # [B, K, L, H]
    values_t = jnp.swapaxes(values, 1, 2).astype(jnp.float32)
    slots = key_slots.astype(jnp.int32)[:, None, :]  # [B, 1, L]
    positions = key_positions.astype(jnp.int32)[:, None, :]
    num_rows, padded_rows, padded_keys = rows.shape[2], rows.shape[2], length
    if backend == "gpu":  # Triton: power-of-two blocks, tl.dot dimensions of at least 16
        padded_rows = next_power_of_two(num_rows, MIN_TRITON_DOT_DIM)
        padded_keys = next_power_of_two(length, MIN_TRITON_DOT_DIM)
        pad_rows = ((0, 0), (0, padded_rows - num_rows), (0, 0))
        rows = jnp.pad(rows, ((0, 0),) + pad_rows)
        cut_rows, query_rows = jnp.pad(cut_rows, pad_rows), jnp.pad(query_rows, pad_rows)
        pad_keys = ((0, 0), (0, 0), (0, padded_keys - length))
        keys_t = jnp.pad(keys_t, pad_keys + ((0, 0),))
        values_t = jnp.pad(values_t, pad_keys + ((0, 0),))
        positions = jnp.pad(positions, pad_keys, constant_values=-1)
        slots = jnp.pad(slots, pad_keys)
    row_spec = pl.BlockSpec((None, None, padded_rows, h), lambda i, k: (i, k, 0, 0))
    key_spec = pl.BlockSpec((None, None, padded_keys, h), lambda i, k: (i, k, 0, 0))
    vector_spec = pl.BlockSpec((None, padded_rows, 1), lambda i, k: (i, 0, 0))
    key_vector_spec = pl.BlockSpec((None, 1, padded_keys), lambda i, k: (i, 0, 0))
    lse_spec = pl.BlockSpec((None, None, padded_rows, 1), lambda i, k: (i, k, 0, 0))
    if backend == "gpu":
        params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    out, lse = pl.pallas_call(
        _buffer_kernel,
        grid=(b, kv),
        in_specs=[
            row_spec,
            key_spec,
            key_spec,
            key_vector_spec,
            key_vector_spec,
            vector_spec,
            vector_spec,
        ],
        out_specs=[row_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv, padded_rows, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, padded_rows, 1), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="quant_kv_buffer_attention",
    )(rows, keys_t, values_t, slots, positions, cut_rows, query_rows)
    out, lse = out[:, :, :num_rows], lse[:, :, :num_rows, 0]
    out = jnp.transpose(out.reshape(b, kv, group, t, h), (0, 3, 1, 2, 4)).reshape(b, t, n, h)
    lse = jnp.transpose(lse.reshape(b, kv, group, t), (0, 3, 1, 2)).reshape(b, t, n)
    return out, lse


def _buffer_kernel(q_ref, k_ref, v_ref, slot_ref, pos_ref, cut_ref, qpos_ref, o_ref, lse_ref):
    """One kv head: q [Q, H], k, v [L, H], slots and positions [1, L], cut and query
    positions [Q, 1]; out [Q, H], lse [Q, 1]."""
    scores = matmul(q_ref[...], k_ref[...], NT)  # [Q, L]
    positions = pos_ref[...]
    visible = (slot_ref[...] >= cut_ref[...]) & (positions >= 0) & (positions <= qpos_ref[...])
    scores = jnp.where(visible, scores, DEFAULT_MASK_VALUE)
    top = jnp.max(scores, axis=1, keepdims=True)
    probs = jnp.where(visible, jnp.exp(scores - top), 0.0)
    total = jnp.sum(probs, axis=1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0)
    o_ref[...] = matmul(probs, v_ref[...], NN) * jnp.where(total > 0, 1.0 / safe, 0.0)
    lse_ref[...] = jnp.where(total > 0, top + jnp.log(safe), DEFAULT_MASK_VALUE)


def buffer_attention_reference(
    q, keys, values, key_slots, key_positions, query_positions, cut, *, scale=None
):
    """``buffer_attention`` in plain jnp."""
    b, t, n, h = q.shape
    kv = keys.shape[2]
    scale = h**-0.5 if scale is None else float(scale)
    rows = q.astype(jnp.float32).reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->btkgs", rows, keys.astype(jnp.float32)) * scale
    visible = (
        (key_slots[:, None, :] >= cut[:, :, None])
        & (key_positions[:, None, :] >= 0)
        & (key_positions[:, None, :] <= query_positions[:, :, None])
    )[:, :, None, None, :]
    return _softmax_parts(scores, visible, values.astype(jnp.float32), "btkgs,bskh->btkgh")


def _softmax_parts(scores, visible, values, contraction):
    """``(out, lse)`` of masked scores ``[B, T, K, G, S]`` over values, rows with no
    visible key giving 0 and ``DEFAULT_MASK_VALUE``; shaped ``[B, T, N, H]`` / ``[B, T, N]``."""
    b, t, kv, g, _ = scores.shape
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    probs = jnp.where(visible, jnp.exp(scores - top), 0.0)
    total = probs.sum(-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0)
    out = jnp.einsum(contraction, probs, values) / safe
    lse = jnp.where(total > 0, top + jnp.log(safe), DEFAULT_MASK_VALUE)
    return out.reshape(b, t, kv * g, -1), lse[..., 0].reshape(b, t, kv * g)


# --------------------------------------------------------------------------------------
# The reference, in plain jnp.
# --------------------------------------------------------------------------------------


def _unpack(codes):
    low, high = codes & 0xF, codes >> 4
    return jnp.stack([low, high], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def quant_kv_attention_reference(
    q,
    k_upper,
    k_lower,
    k_scale,
    k_min,
    v_upper,
    v_lower,
    v_scale,
    v_min,
    key_positions,
    cut,
    *,
    bits: int = 8,
    scale: float | None = None,
):
    """``quant_kv_attention`` by dequantizing the whole store and one masked softmax."""
    b, t, n, h = q.shape
    kv, s = k_upper.shape[1], k_upper.shape[2]
    group = s // k_scale.shape[2]
    scale = h**-0.5 if scale is None else float(scale)

    def deq(upper, lower, sc, mn, axis):
        sc = jnp.repeat(sc.astype(jnp.float32), group, axis=axis)
        mn = jnp.repeat(mn.astype(jnp.float32), group, axis=axis)
        x = mn + sc * _unpack(upper).astype(jnp.float32)
        if bits == 8:
            x = x + (sc / 16.0) * (_unpack(lower).astype(jnp.float32) - 8.0)
        return x  # [B, K, S, H]

    keys = deq(k_upper, k_lower, k_scale, k_min, 2)
    values = deq(v_upper, v_lower, v_scale, v_min, 3)
    rows = q.astype(jnp.float32).reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bksh->btkgs", rows, keys) * scale
    visible = (jnp.arange(s)[None, None, :] < cut[:, :, None]) & (key_positions[:, None, :] >= 0)
    return _softmax_parts(scores, visible[:, :, None, None, :], values, "btkgs,bksh->btkgh")
