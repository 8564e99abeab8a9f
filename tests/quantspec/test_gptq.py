"""GPTQ against a float64 numpy version of the paper's algorithm (blocked, lazy batch
updates), its output error against round-to-nearest, asymmetric groups against their
formula, and the layer-by-layer calibration against Hessians from the float64 reference
forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.quantspec import Int4Weight, dequantize_weight, quantize_weight
from lhc.quantspec.gptq import calibrate, gptq_weight

from ..support import forward, random_params, rms_norm, silu


def _grid(block, symmetric):
    if symmetric:
        return np.abs(block).max(axis=0) / 7, None
    return (block.max(axis=0) - block.min(axis=0)) / 15, block.min(axis=0)


def _round(w, scale, minimum):
    safe = np.where(scale > 0, scale, 1)
    if minimum is None:
        return np.clip(np.round(w / safe), -8, 7) * scale
    return minimum + np.clip(np.round((w - minimum) / safe), 0, 15) * scale


def reference_gptq(w, hessian, group_size, symmetric, damp=0.01, block=16):
    """Algorithm 1 of the GPTQ paper in float64, on W [in, out] (rows = the paper's
    columns), with lazy batch updates over blocks of ``block`` rows. Returns the
    dequantized kernel."""
    w, h = np.array(w, np.float64), np.array(hessian, np.float64)
    rows = w.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(rows)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    grid = None
    for start in range(0, rows, block):
        end = min(start + block, rows)
        errors = np.zeros((end - start, w.shape[1]))
        for i in range(start, end):
            if i % group_size == 0:
                grid = _grid(w[i : i + group_size], symmetric)
            q[i] = _round(w[i], *grid)
            errors[i - start] = (w[i] - q[i]) / u[i, i]
            w[i + 1 : end] -= np.outer(u[i, i + 1 : end], errors[i - start])
        w[end:] -= u[start:end, end:].T @ errors
    return q


def _correlated_inputs(rng, n, dim):
    mixing = rng.normal(size=(dim, dim)) * (rng.random(dim) < 0.3)
    return rng.normal(size=(n, dim)) @ (np.eye(dim) + mixing) * rng.uniform(0.2, 3, dim)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_equals_the_blocked_float64_algorithm_and_beats_rounding(symmetric):
    rng = np.random.default_rng(0)
    x = _correlated_inputs(rng, 256, 32)
    w = rng.normal(size=(32, 8))
    hessian = 2 * x.T @ x / len(x)
    q = gptq_weight(
        jnp.asarray(w, jnp.float32),
        jnp.asarray(hessian, jnp.float32),
        group_size=8,
        scale_dtype=jnp.float32,
        symmetric=symmetric,
    )
    assert (q.minimum is None) == symmetric
    got = np.asarray(dequantize_weight(q), np.float64)
    want = reference_gptq(w, hessian, 8, symmetric)
    same = np.isclose(got, want, rtol=1e-4, atol=1e-5)
    assert same.mean() > 0.97, same.mean()  # float32 against float64: a rare code flips
    rtn = np.asarray(
        dequantize_weight(
            quantize_weight(
                jnp.asarray(w, jnp.float32),
                group_size=8,
                scale_dtype=jnp.float32,
                symmetric=symmetric,
            )
        ),
        np.float64,
    )
    error = lambda k: np.linalg.norm(x @ (w - k))  # noqa: E731
    assert error(got) < 0.8 * error(rtn), (error(got), error(rtn))


def test_asymmetric_groups_hold_minimum_and_scale():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(32, 6)).astype(np.float32) + 0.5
    q = quantize_weight(w, group_size=16, symmetric=False, scale_dtype=jnp.float32)
    assert isinstance(q, Int4Weight) and q.minimum.shape == q.scale.shape == (2, 6)
    deq = np.asarray(dequantize_weight(q), np.float64)
    for g in range(2):
        rows = w[16 * g : 16 * g + 16].astype(np.float64)
        scale, minimum = _grid(rows, symmetric=False)
        np.testing.assert_allclose(q.scale[g], scale, rtol=1e-6)
        np.testing.assert_allclose(q.minimum[g], minimum, rtol=1e-6)
        np.testing.assert_allclose(
            deq[16 * g : 16 * g + 16], _round(rows, scale, minimum), rtol=1e-5, atol=1e-6
        )
    # The group's extremes are on the grid: asymmetric groups waste no code on one side.
    assert np.abs(deq - w).max() <= np.asarray(q.scale).max() / 2 + 1e-6


def test_calibration_quantizes_each_layer_for_the_inputs_the_quantized_layers_below_give():
    config = lm.LMConfig.tiny(num_layers=2, max_len=64)
    params = random_params(config, scale=8**-0.5, norms=0.2)
    model = lm.Transformer(config)
    tokens = np.random.default_rng(2).integers(3, config.vocab_size, (2, 12))
    draft = calibrate(model, params, tokens, group_size=8, scale_dtype=jnp.float32)
    as_dense = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: dequantize_weight(a) if isinstance(a, Int4Weight) else a,
        tree,
        is_leaf=lambda a: isinstance(a, Int4Weight),
    )
    for layer in range(config.num_layers):
        # The float64 reference forward with the layers below as calibrated.
        mixed = dict(
            params, **{f"layers_{i}": as_dense(draft[f"layers_{i}"]) for i in range(layer)}
        )
        inputs = []
        for row in tokens:
            states = {}
            forward(config, mixed, row, states=states)
            residual = states["layer_input", layer] + states["attention", layer]
            scale = np.asarray(params[f"layers_{layer}"]["mlp_norm"]["scale"], np.float64)
            inputs.append(rms_norm(residual, scale, config.norm_eps))
        h = np.concatenate(inputs)
        mlp = params[f"layers_{layer}"]["mlp"]
        as64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        hidden = silu(h @ as64(mlp["gate"]["kernel"])) * (h @ as64(mlp["up"]["kernel"]))
        for proj, x in (("gate", h), ("up", h), ("down", hidden)):
            want = reference_gptq(as64(mlp[proj]["kernel"]), 2 * x.T @ x / len(x), 8, True)
            got = np.asarray(dequantize_weight(draft[f"layers_{layer}"]["mlp"][proj]["kernel"]))
            same = np.isclose(got, want, rtol=1e-3, atol=1e-4)
            assert same.mean() > 0.95, (layer, proj, same.mean())
        # Everything but the MLP kernels is left as it was.
        attention = draft[f"layers_{layer}"]["attention"]
        np.testing.assert_array_equal(
            attention["query"]["kernel"], params[f"layers_{layer}"]["attention"]["query"]["kernel"]
        )
    with pytest.raises(ValueError, match="tokens must be int"):
        calibrate(model, params, tokens[0])
    with pytest.raises(ValueError, match=r"hessian must be \[16, 16\]"):
        gptq_weight(jnp.ones((16, 4)), jnp.eye(8), group_size=8)
