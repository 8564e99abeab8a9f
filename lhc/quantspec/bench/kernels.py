"""The attention over the quantized store against bfloat16 attention over the same
context: the Pallas kernel on a TPU or GPU, its XLA reference on a CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench
from lhc.stats import markdown_table


def kernel_rows(contexts, *, verify_tokens: int = 7, repeats: int = 5):
    """Attention over the quantized store (4-bit draft, 8-bit target; ``T = 1`` and
    ``verify_tokens`` queries) against bfloat16 attention over the same context, one
    layer of Llama-2 shape (32 heads of 128, G = 128), batch 1. The Pallas kernel on a
    TPU or GPU; elsewhere its XLA reference (interpreting the kernel would time nothing
    real)."""
    from kernels_pallas.quant_kv_attention import quant_kv_attention

    platform = jax.devices()[0].platform
    impl = "pallas" if platform in ("tpu", "gpu") else "xla"
    kv, n, h, g = 32, 32, 128, 128
    r = np.random.default_rng(0)
    rows = []
    for context in contexts:
        s = g * (context // g)
        codes = jnp.asarray(r.integers(0, 256, (1, kv, s, h // 2)), jnp.uint8)
        k_scale = jnp.asarray(r.uniform(0, 1, (1, kv, s // g, h)), jnp.float16)
        v_scale = jnp.asarray(r.uniform(0, 1, (1, kv, s, 1)), jnp.float16)
        keys = jnp.asarray(r.normal(size=(1, s, kv, h)), jnp.bfloat16)
        positions = jnp.arange(s, dtype=jnp.int32)[None]
        for t in (1, verify_tokens):
            q = jnp.asarray(r.normal(size=(1, t, n, h)), jnp.bfloat16)
            cut = jnp.full((1, t), s, jnp.int32)
            query_positions = s + jnp.arange(t, dtype=jnp.int32)[None]
            dense = jax.jit(functools.partial(_dense_attention, scale=h**-0.5))
            row = dict(context=s, queries=t, impl=impl)
            row["bf16_ms"] = 1e3 * bench.best_time(
                functools.partial(dense, q, keys, keys, positions, query_positions), repeats
            )
            for bits in (4, 8):
                quant = jax.jit(functools.partial(quant_kv_attention, bits=bits, impl=impl))
                args = (
                    q,
                    codes,
                    codes,
                    k_scale,
                    k_scale,
                    codes,
                    codes,
                    v_scale,
                    v_scale,
                    positions,
                    cut,
                )
                row[f"int{bits}_ms"] = 1e3 * bench.best_time(
                    functools.partial(quant, *args), repeats
                )
            rows.append(row)
    return rows


def _dense_attention(q, keys, values, positions, query_positions, *, scale):
    from lhc.nn.attention_ops import attention_segments

    return attention_segments(q, [(keys, values, positions)], query_positions, scale=scale)


def kernel_table(rows) -> str:
    rows = [
        {**r, **{f"int{bits}_ratio": r["bf16_ms"] / r[f"int{bits}_ms"] for bits in (4, 8)}}
        for r in rows
    ]
    columns = [
        ("context", "context"), ("queries", "queries"), ("store read by", "impl"),
        ("bf16 ms", "bf16_ms", ".3f"), ("4-bit ms", "int4_ms", ".3f"),
        ("4-bit ratio", "int4_ratio", ".2fx"), ("8-bit ms", "int8_ms", ".3f"),
        ("8-bit ratio", "int8_ratio", ".2fx"),
    ]  # fmt: skip
    return markdown_table(columns, rows)
