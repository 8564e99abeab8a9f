"""The kernel sections of the accelerator run: the ceilings, flash attention, GCA's
chunk retrieval and QuantSpec's store and buffer attention, each compiled (interpreted
in --smoke without an accelerator), timed against the XLA path (and cuDNN where it
applies) and checked against its float32 reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from harness import Section, errors, per_second, timed

from kernels_pallas.chunk_retrieval import chunk_retrieval, chunk_retrieval_reference
from kernels_pallas.flash_attention import BlockSizes, flash_attention, flash_attention_reference
from kernels_pallas.quant_kv_attention import (
    buffer_attention,
    buffer_attention_reference,
    quant_kv_attention,
    quant_kv_attention_reference,
)
from lhc.nn.attention_ops import attention_segments
from lhc.quantspec import quantize


def _f32(x):
    return x.astype(jnp.float32)


# --------------------------------------------------------------------------------------
# Ceilings: the copy bandwidth and the bf16 matmul rate of this device.
# --------------------------------------------------------------------------------------


def section_ceilings(s: Section) -> None:
    def copy():
        x = jax.random.normal(jax.random.key(0), (2**20 if s.smoke else 2**28,), jnp.float32)
        timing, _ = timed(jax.jit(lambda x: x + 1.0), x, smoke=s.smoke)
        return dict(copy_gbps=per_second(2 * x.nbytes, timing, 1e9), copy_bytes=2 * x.nbytes)

    def matmul():
        n = 256 if s.smoke else 8192
        a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (1, 2))
        timing, _ = timed(jax.jit(jnp.dot), a, b, smoke=s.smoke)
        return dict(matmul_tflops=per_second(2 * n**3, timing, 1e12), matmul_n=n)

    row = {}
    for measure in (copy, matmul):
        row.update(s.run("ceiling_parts", {"part": measure.__name__}, measure) or {})
    s.emit("ceilings", **row)


# --------------------------------------------------------------------------------------
# Flash attention: causal, GQA, bf16.
# --------------------------------------------------------------------------------------


def _flash_inputs(length, batch, heads, kv_heads, head_dim):
    keys = jax.random.split(jax.random.key(length), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return q, k, v, d_out, positions


def _flash_flops(q, backward: bool) -> float:
    """FLOPs of causal attention: 4 B N H per visible pair forward; the backward
    recomputes the scores and takes 2.5 times the forward (FlashAttention-2's count)."""
    batch, length, heads, head_dim = q.shape
    pairs = length * (length + 1) / 2
    return 4 * batch * heads * head_dim * pairs * (3.5 if backward else 1.0)


def _attention_grad(fn, d_out):
    """``jit(grad)`` of ``sum(fn(q, k, v, positions, positions) * d_out)`` in q, k, v."""

    def loss(q, k, v, positions):
        return jnp.sum(fn(q, k, v, positions, positions).astype(jnp.float32) * d_out)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _flash_impls(s: Section) -> dict:
    def vendor(q, k, v, query_positions, key_positions):
        del query_positions, key_positions  # causal by index: positions are 0..T-1 here
        implementation = "cudnn" if s.platform == "gpu" else "xla"
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    return {
        "pallas": functools.partial(flash_attention, impl="pallas", backend=s.backend,
                                    interpret=s.interpret),
        # The XLA path's scan is sequential: large blocks suit an accelerator.
        "xla": functools.partial(flash_attention, impl="xla",
                                 block_sizes=None if s.smoke else BlockSizes(512, 512)),
        "cudnn" if s.platform == "gpu" else "jax.nn (xla)": vendor,
    }  # fmt: skip


def _flash_length(s: Section, length: int, shape: tuple, impls: dict, grad_reference_max: int):
    """Forward and forward+backward of every implementation at one length."""
    q, k, v, d_out, positions = _flash_inputs(length, *shape)
    rows = length if length <= 8192 else 512  # longer: the reference covers the last 512
    expected = jax.jit(flash_attention_reference)(
        _f32(q[:, -rows:]), _f32(k), _f32(v), positions[:, -rows:], positions
    )

    def forward(fn):
        timing, out = timed(jax.jit(fn), q, k, v, positions, positions, smoke=s.smoke)
        tflops = per_second(_flash_flops(q, False), timing, 1e12)
        return dict(**timing, tflops=tflops, matmul_fraction=s.fraction(tflops, "matmul_tflops"),
                    checked_queries=rows, **errors(out[:, -rows:], expected))  # fmt: skip

    for name, fn in impls.items():
        s.run("flash", dict(length=length, direction="fwd", impl=name), lambda fn=fn: forward(fn))
    expected = None  # free it before the gradients
    expected_grads = None
    if length <= grad_reference_max:
        expected_grads = _attention_grad(flash_attention_reference, d_out)(
            _f32(q), _f32(k), _f32(v), positions
        )

    def backward(fn):
        timing, grads = timed(_attention_grad(fn, d_out), q, k, v, positions, smoke=s.smoke)
        tflops = per_second(_flash_flops(q, True), timing, 1e12)
        checked = errors(grads, expected_grads) if expected_grads is not None else {}
        return dict(**timing, tflops=tflops, matmul_fraction=s.fraction(tflops, "matmul_tflops"),
                    **checked)  # fmt: skip

    for name, fn in impls.items():
        s.run("flash", dict(length=length, direction="fwd+bwd", impl=name),
              lambda fn=fn: backward(fn))  # fmt: skip


def _flash_blocks(s: Section, length: int, shape: tuple, sweep: list):
    """The Pallas kernels' block sizes at one length, forward and forward+backward."""
    q, k, v, d_out, positions = _flash_inputs(length, *shape)

    def measure(block_q, block_k, direction):
        blocked = functools.partial(
            flash_attention, impl="pallas", backend=s.backend, interpret=s.interpret,
            block_sizes=BlockSizes(block_q, block_k),
        )  # fmt: skip
        if direction == "fwd":
            timing, _ = timed(jax.jit(blocked), q, k, v, positions, positions, smoke=s.smoke)
        else:
            timing, _ = timed(_attention_grad(blocked, d_out), q, k, v, positions, smoke=s.smoke)
        return dict(**timing, tflops=per_second(_flash_flops(q, direction != "fwd"), timing, 1e12))

    for block_q, block_k in sweep:
        for direction in ("fwd",) if s.smoke else ("fwd", "fwd+bwd"):
            label = dict(length=length, block_q=block_q, block_k=block_k, direction=direction)
            s.run("flash_blocks", label, functools.partial(measure, block_q, block_k, direction))


def section_flash(s: Section) -> None:
    # batch, query heads, kv heads, head dim: Llama-3.1-8B's attention.
    shape = (1, 4, 2, 32) if s.smoke else (1, 32, 8, 128)
    lengths = (128,) if s.smoke else (4096, 16384, 32768)
    impls = _flash_impls(s)
    for length in lengths:
        if s.time_left() <= 0:
            s.emit("flash", length=length, skipped="time budget spent")
            continue
        _flash_length(s, length, shape, impls, grad_reference_max=128 if s.smoke else 4096)
    # The default (128, 128) is in the table above.
    sweep = [(64, 32)] if s.smoke else [(64, 64), (128, 64), (64, 128)]
    _flash_blocks(s, lengths[-1] if s.smoke else 16384, shape, sweep)


# --------------------------------------------------------------------------------------
# Chunk retrieval (GCA).
# --------------------------------------------------------------------------------------

# name: (B, C query chunks, Sq, H, Hkv, D, N memory chunks, Sk, K slots, with backward)
CHUNK_SHAPES = {
    "GCA-128M training step (4 x 16K tokens)": (4, 256, 64, 12, 12, 64, 256, 64, 8, True),
    "official kernel's test shape": (1, 512, 64, 40, 40, 64, 512, 64, 32, True),
    "one decoding token at 128K, batch 8": (8, 1, 1, 12, 12, 64, 2048, 64, 8, False),
}
CHUNK_SHAPES_SMOKE = {
    "train": (1, 4, 16, 2, 2, 16, 4, 16, 2, True),
    "decode": (2, 1, 1, 2, 2, 16, 8, 16, 2, False),
}


def _chunk_shape(s: Section, name: str, shape: tuple) -> None:
    b, c, sq, h, hkv, d, n, sk, slots, with_backward = shape
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, c, sq, h, d), jnp.bfloat16)
    k_mem = jax.random.normal(keys[1], (b, n, sk, hkv, d), jnp.bfloat16)
    v_mem = jax.random.normal(keys[2], (b, n, sk, hkv, d), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    # Distinct chunks per query chunk; one query chunk in ten has an empty last slot.
    indices = np.stack([rng.choice(n, slots, replace=False) for _ in range(b * c)])
    indices[rng.random(b * c) < 0.1, -1] = -1
    indices = jnp.asarray(indices.reshape(b, c, slots), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, c, slots)), jnp.float32), -1)
    valid = int(jnp.sum(indices >= 0))
    forward_flops = 4 * valid * sq * sk * h * d
    # Each query chunk reads its selected chunks' keys and values; q in and out back.
    forward_bytes = 2 * valid * sk * hkv * d * 2 + 2 * q.size * 2
    args = (q, k_mem, v_mem, indices, weights)
    expected = jax.jit(chunk_retrieval_reference)(
        _f32(q), _f32(k_mem), _f32(v_mem), indices, weights
    )

    def gradient(fn):
        def loss(q, k_mem, v_mem, weights):
            return jnp.sum(fn(q, k_mem, v_mem, indices, weights).astype(jnp.float32) * d_out)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    expected_grads = None
    if with_backward and (s.smoke or b * c * slots <= 8192):  # the reference's memory
        expected_grads = gradient(chunk_retrieval_reference)(
            _f32(q), _f32(k_mem), _f32(v_mem), weights
        )

    def forward(fn):
        timing, out = timed(jax.jit(fn), *args, smoke=s.smoke)
        tflops, gbps = (
            per_second(forward_flops, timing, 1e12),
            per_second(forward_bytes, timing, 1e9),
        )
        return dict(**timing, tflops=tflops, gbps=gbps,
                    matmul_fraction=s.fraction(tflops, "matmul_tflops"),
                    copy_fraction=s.fraction(gbps, "copy_gbps"), **errors(out, expected))  # fmt: skip

    def backward(fn):
        timing, grads = timed(gradient(fn), q, k_mem, v_mem, weights, smoke=s.smoke)
        tflops = per_second(3.5 * forward_flops, timing, 1e12)
        checked = errors(grads, expected_grads) if expected_grads is not None else {}
        return dict(**timing, tflops=tflops, matmul_fraction=s.fraction(tflops, "matmul_tflops"),
                    **checked)  # fmt: skip

    impls = {
        "pallas": functools.partial(chunk_retrieval, impl="pallas", backend=s.backend,
                                    interpret=s.interpret),
        "xla": functools.partial(chunk_retrieval, impl="xla"),
    }  # fmt: skip
    for impl, fn in impls.items():
        s.run("chunk", dict(shape=name, direction="fwd", impl=impl), lambda fn=fn: forward(fn))
        if with_backward:
            s.run("chunk", dict(shape=name, direction="fwd+bwd", impl=impl),
                  lambda fn=fn: backward(fn))  # fmt: skip


def section_chunk(s: Section) -> None:
    for name, shape in (CHUNK_SHAPES_SMOKE if s.smoke else CHUNK_SHAPES).items():
        if s.time_left() <= 0:
            s.emit("chunk", shape=name, skipped="time budget spent")
            continue
        _chunk_shape(s, name, shape)


# --------------------------------------------------------------------------------------
# QuantSpec's store and buffer.
# --------------------------------------------------------------------------------------


def quantized_store(keys, values, group_size):
    """The store arrays of ``quant_kv_attention`` (``[B, K, S, ...]``) for keys and
    values ``[B, K, S, H]``, quantized as QuantSpec's cache quantizes them."""
    qk = quantize(keys, group_axis=2, group_size=group_size)
    qv = quantize(values, group_axis=3, group_size=group_size)
    return (qk.upper, qk.lower, qk.scale, qk.minimum, qv.upper, qv.lower, qv.scale, qv.minimum)


def _dense_attention(q, keys, values, positions, query_positions, *, impl):
    """bf16 attention of ``q`` over the whole context ``[B, S, K, H]``."""
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, keys, values, implementation="cudnn")
    return attention_segments(q, [(keys, values, positions)], query_positions,
                              scale=q.shape[-1] ** -0.5)  # fmt: skip


def _quant_context(s: Section, context: int, shape: tuple, queries: tuple) -> None:
    """The store at 4 and 8 bits and bf16 attention over the same context."""
    batch, heads, kv_heads, head_dim = shape
    group = head_dim  # the Pallas path reads whole-head value groups (the paper's G = 128)
    keys = jax.random.split(jax.random.key(context), 3)
    k = jax.random.normal(keys[0], (batch, kv_heads, context, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[1], (batch, kv_heads, context, head_dim), jnp.bfloat16)
    store = jax.jit(functools.partial(quantized_store, group_size=group))(k, v)
    dense = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))  # [B, S, K, H]
    del k, v
    for t in queries:
        q = jax.random.normal(keys[2], (batch, t, heads, head_dim), jnp.bfloat16)
        _quant_queries(s, q, store, dense)


def _quant_queries(s: Section, q, store: tuple, dense: tuple) -> None:
    """``q [B, T, N, H]`` over the whole context: bf16 (XLA, cuDNN) and the store."""
    batch, t = q.shape[:2]
    context = dense[0].shape[1]
    positions = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context))
    query_positions = context + jnp.arange(t, dtype=jnp.int32)[None]
    cut = jnp.full((batch, t), context, jnp.int32)
    scale_bytes = sum(x.nbytes for x in store[2:4] + store[6:8])
    baseline = {}

    def bf16(impl):
        fn = functools.partial(_dense_attention, impl=impl)
        timing, _ = timed(jax.jit(fn), q, *dense, positions, query_positions, smoke=s.smoke)
        baseline.setdefault("ms", timing["ms"])
        gbps = per_second(dense[0].nbytes + dense[1].nbytes, timing, 1e9)
        return dict(**timing, gbps=gbps, copy_fraction=s.fraction(gbps, "copy_gbps"))

    def quantized(bits, impl, expected):
        fn = functools.partial(quant_kv_attention, bits=bits, impl=impl,
                               backend=s.backend if impl == "pallas" else None,
                               interpret=s.interpret if impl == "pallas" else None)  # fmt: skip
        timing, out = timed(jax.jit(fn), q, *store, positions, cut, smoke=s.smoke)
        code_bytes = (store[0].nbytes + store[4].nbytes) * (bits // 4)
        gbps = per_second(code_bytes + scale_bytes, timing, 1e9)
        speedup = baseline["ms"] / timing["ms"] if baseline else None
        return dict(**timing, gbps=gbps, copy_fraction=s.fraction(gbps, "copy_gbps"),
                    vs_bf16_xla=speedup, **errors(out, expected))  # fmt: skip

    label = dict(context=context, queries=t)
    for impl in ("xla", "cudnn") if s.platform == "gpu" else ("xla",):
        s.run("quant", dict(label, store=f"bf16 ({impl})"), functools.partial(bf16, impl))
    for bits in (4, 8):
        reference = jax.jit(functools.partial(quant_kv_attention_reference, bits=bits))
        expected = reference(q, *store, positions, cut)
        for impl in ("pallas", "xla"):
            s.run("quant", dict(label, store=f"{bits}-bit ({impl})"),
                  functools.partial(quantized, bits, impl, expected))  # fmt: skip


def _buffer(s: Section, shape: tuple, t: int) -> dict:
    """``buffer_attention`` over a ring of 2G + 6 keys and ``t`` new ones."""
    batch, heads, kv_heads, head_dim = shape
    length = 2 * head_dim + 6 + t
    keys = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(keys[0], (batch, t, heads, head_dim), jnp.bfloat16)
    ring_k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.bfloat16)
    ring_v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.bfloat16)
    slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    cut = jnp.full((batch, t), head_dim, jnp.int32)
    args = (q, ring_k, ring_v, slots, slots, slots[:, -t:], cut)
    expected = jax.jit(buffer_attention_reference)(*args)
    fn = functools.partial(buffer_attention, impl="pallas", backend=s.backend,
                           interpret=s.interpret)  # fmt: skip
    timing, out = timed(jax.jit(fn), *args, smoke=s.smoke)
    reference_timing, _ = timed(jax.jit(buffer_attention_reference), *args, smoke=s.smoke)
    return dict(length=length, **timing, xla_ms=reference_timing["ms"], **errors(out, expected))


def section_quant(s: Section) -> None:
    # batch, query heads, kv heads, head dim: one layer of Llama-3.1-8B.
    shape = (1, 4, 2, 32) if s.smoke else (1, 32, 8, 128)
    contexts = (256,) if s.smoke else (8192, 32768, 131072)
    queries = (1, 4) if s.smoke else (1, 7)  # one decoding token; gamma + 1 verified
    for context in contexts:
        if s.time_left() <= 0:
            s.emit("quant", context=context, skipped="time budget spent")
            continue
        _quant_context(s, context, shape, queries)
    for t in queries:
        s.run("buffer", dict(queries=t), functools.partial(_buffer, s, shape, t))
