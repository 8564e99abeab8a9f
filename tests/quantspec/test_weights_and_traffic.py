"""The draft's INT4 weights (codes, error bound, the on-the-fly matmul, which kernels of
a Transformer are quantized) and the memory-traffic model against the paper's
Llama-2-7B figures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.quantspec import (
    NAMED,
    Int4Weight,
    dequantize_params,
    dequantize_weight,
    int4_matmul,
    predicted_speedup,
    quantize_params,
    quantize_weight,
    step_bytes,
)


def test_int4_codes_bound_and_matmul():
    r = np.random.default_rng(0)
    w = r.normal(size=(4, 8, 32)).astype(np.float32)  # an attention "out" kernel: 2 input axes
    q = quantize_weight(w, group_size=16, in_axes=2, scale_dtype=jnp.float32)
    assert q.codes.shape == (32, 16) and q.scale.shape == (2, 32)
    deq = np.asarray(dequantize_weight(q), np.float64)
    flat, scale = w.reshape(32, 32).astype(np.float64), np.asarray(q.scale, np.float64)
    for g in range(2):  # symmetric: scale = max |w| / 7 over each group of 16 input rows
        rows = slice(16 * g, 16 * g + 16)
        np.testing.assert_allclose(scale[g], np.abs(flat[rows]).max(axis=0) / 7, rtol=1e-6)
        codes = np.clip(np.round(flat[rows] / scale[g]), -8, 7)
        np.testing.assert_allclose(deq.reshape(32, 32)[rows], codes * scale[g], rtol=1e-6)
    assert (np.abs(deq - w) <= np.repeat(scale, 16, axis=0).reshape(w.shape) / 2 + 1e-6).all()
    x = r.normal(size=(3, 5, 4, 8)).astype(np.float32)
    want = np.einsum("btnh,nhd->btd", x.astype(np.float64), deq)
    np.testing.assert_allclose(int4_matmul(jnp.asarray(x), q), want, rtol=1e-4, atol=1e-4)


def test_dequantized_kernel_keeps_its_dtype():
    # A bfloat16 model's draft reads bfloat16 kernels (the values the float32
    # dequantization rounds to), not float32 ones of twice the bytes.
    w = jnp.asarray(np.random.default_rng(1).normal(size=(32, 8)), jnp.bfloat16)
    q = quantize_weight(w, group_size=16)
    deq = dequantize_weight(q)
    assert deq.dtype == jnp.bfloat16
    want = (np.asarray(unpack_codes(q), np.float32) - 8) * np.repeat(
        np.asarray(q.scale, np.float32), 16, axis=0
    )
    np.testing.assert_array_equal(
        np.asarray(deq, np.float32), np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32)
    )
    assert dequantize_weight(q, jnp.float32).dtype == jnp.float32
    params = {"layers_0": {"mlp": {"up": {"kernel": q}}}, "norm": {"scale": jnp.ones(8)}}
    assert dequantize_params(params)["layers_0"]["mlp"]["up"]["kernel"].dtype == jnp.bfloat16


def unpack_codes(q):
    """The 4-bit codes of ``q`` ``[in, out]``, element 2i in the low nibble, by numpy."""
    packed = np.asarray(q.codes)
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def test_quantize_params_picks_the_mlp_or_every_projection():
    config = lm.LMConfig(
        vocab_size=64,
        num_layers=2,
        embed_dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_len=64,
    )
    model = lm.Transformer(config)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    params = jax.tree.map(lambda x: x, model.init(jax.random.key(0), tokens, positions)["params"])
    params = jax.tree.map(
        lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value")
    )
    for layers, quantized in (
        ("mlp", {"gate", "up", "down"}),
        ("all", {"gate", "up", "down", "query", "key", "value", "out"}),
    ):
        q = quantize_params(params, group_size=8, layers=layers)
        found = {
            jax.tree_util.keystr(path).split("'")[-4]
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                q, is_leaf=lambda x: isinstance(x, Int4Weight)
            )[0]
            if isinstance(leaf, Int4Weight)
        }
        assert found == quantized
        draft = dequantize_params(q)
        assert jax.tree.structure(draft) == jax.tree.structure(params)
        np.testing.assert_array_equal(draft["embed"]["embedding"], params["embed"]["embedding"])
        logits, _ = model.apply({"params": draft}, tokens, positions)
        full, _ = model.apply({"params": params}, tokens, positions)
        assert 0 < float(jnp.abs(logits - full).max()) < 0.5 * float(jnp.abs(full).max())
    with pytest.raises(
        ValueError, match="group_size must be a positive int dividing the input size 32"
    ):
        quantize_params(params, group_size=12)
    with pytest.raises(ValueError, match="layers must be 'mlp' or 'all'"):
        quantize_params(params, layers="attention")


def test_traffic_model_matches_the_papers_llama_2_7b_figures():
    # The facts file's worked example (gamma 6, G 128): 128K context, acceptance 0.943:
    # AR 81.9 GB, draft 21.7 (all 4-bit) / 25.0 (MLP-only) GB, verify 48.6 GB, predicted
    # speedup 3.05x / 2.74x; 32K, acceptance 0.912: AR 30.4 GB, 2.81x / 2.18x.
    size = NAMED["llama-2-7b"]
    assert size.kv_elements == 262_144
    b_all = step_bytes(size, 131_072, weights="all")
    b_mlp = step_bytes(size, 131_072, weights="mlp")
    assert round(b_all["ar"] / 1e9, 1) == 81.9
    assert round(b_all["draft"] / 1e9, 1) == 21.7 and round(b_mlp["draft"] / 1e9, 1) == 25.0
    assert round(b_all["verify"] / 1e9, 1) == 48.6
    speed = lambda context, a, w: predicted_speedup(size, context, gamma=6, acceptance=a, weights=w)  # noqa: E731
    assert round(speed(131_072, 0.943, "all"), 2) == 3.05
    assert round(speed(131_072, 0.943, "mlp"), 2) == 2.74
    assert round(step_bytes(size, 32_768)["ar"] / 1e9, 1) == 30.4
    assert round(speed(32_768, 0.912, "all"), 2) == 2.81
    assert round(speed(32_768, 0.912, "mlp"), 2) == 2.18
