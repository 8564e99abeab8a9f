"""Norms, RoPE, projections and the MLP against numpy references."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import nn as lnn


def test_rms_norm_matches_numpy_and_keeps_float32_statistics():
    x = np.random.default_rng(0).normal(size=(3, 5, 16)).astype(np.float32) * 3
    layer = lnn.RMSNorm(epsilon=1e-5)
    params = layer.init(jax.random.key(0), x)
    scale = np.random.default_rng(1).normal(size=16).astype(np.float32)
    params = {"params": {"scale": nn.meta.unbox(params)["params"]["scale"] * 0 + scale}}
    y = layer.apply(params, x)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)

    # bf16 input and output, float32 statistics: the only error is the final rounding.
    layer16 = lnn.RMSNorm(epsilon=1e-5, dtype=jnp.bfloat16)
    y16 = layer16.apply(params, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    x16 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    expected16 = x16 / np.sqrt((x16**2).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(np.asarray(y16, np.float64), expected16, rtol=1e-2, atol=1e-2)


def test_rms_norm_param_is_logically_partitioned():
    variables = lnn.RMSNorm().init(jax.random.key(0), jnp.ones((2, 8)))
    assert variables["params"]["scale"].names == ("norm",)


def _llama3_reference(head_dim, theta, factor, low, high, original):
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_frequencies_default_linear_llama3(head_dim):
    theta = 500_000.0
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(lnn.rope_frequencies(head_dim, theta), plain, rtol=1e-6)
    linear = {"rope_type": "linear", "factor": 4.0}
    np.testing.assert_allclose(lnn.rope_frequencies(head_dim, theta, linear), plain / 4, rtol=1e-6)
    llama3 = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    expected = _llama3_reference(head_dim, theta, 8.0, 1.0, 4.0, 8192)
    got = lnn.rope_frequencies(head_dim, theta, llama3)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    if head_dim == 128:  # all three bands are present at this size
        assert (got < plain * 0.99).any() and (np.isclose(got, plain)).any()
        assert (~np.isclose(got, plain) & ~np.isclose(got, plain / 8)).any()


def test_rope_scaling_validation():
    assert lnn.validate_rope_scaling(None) is None
    assert lnn.validate_rope_scaling({"rope_type": "default"}) is None
    assert lnn.validate_rope_scaling({"type": "linear", "factor": 2}) == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    with pytest.raises(ValueError, match="yarn"):
        lnn.validate_rope_scaling({"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="missing"):
        lnn.validate_rope_scaling({"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ValueError, match="unknown keys"):
        lnn.validate_rope_scaling({"rope_type": "linear", "factor": 2.0, "beta": 1})
    with pytest.raises(ValueError, match="positive"):
        lnn.validate_rope_scaling({"rope_type": "linear", "factor": 0.0})
    with pytest.raises(ValueError, match="even"):
        lnn.rope_frequencies(7, 10_000.0)


def test_apply_rope_is_complex_rotation_of_half_pairs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    positions = rng.integers(-1, 300, size=(2, 5))
    freqs = lnn.rope_frequencies(8, 10_000.0)
    y = np.asarray(lnn.apply_rope(jnp.asarray(x), jnp.asarray(positions), freqs))
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * positions[:, :, None, None] * freqs)
    np.testing.assert_allclose(y, np.concatenate([z.real, z.imag], -1), atol=2e-5)
    # Rotations preserve norms and relative-position dot products.
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        lnn.apply_rope(jnp.asarray(x), jnp.zeros((2, 4), jnp.int32), freqs)


def test_einsum_projection_with_bias_and_logical_axes():
    x = np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32)
    layer = lnn.Einsum(shape=(6, 4, 5), logical_axes=("embed", "heads", "kv"), use_bias=True)
    variables = layer.init(jax.random.key(0), "BTD,DNH->BTNH", x)
    assert variables["params"]["kernel"].names == ("embed", "heads", "kv")
    assert variables["params"]["bias"].names == ("heads", "kv")
    params = nn.meta.unbox(variables)
    params["params"]["bias"] = jnp.asarray(
        np.random.default_rng(1).normal(size=(4, 5)), jnp.float32
    )
    y = layer.apply(params, "BTD,DNH->BTNH", x)
    kernel = np.asarray(params["params"]["kernel"])
    expected = np.tensordot(x, kernel, axes=([2], [0])) + np.asarray(params["params"]["bias"])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # Fan-in scaling over the contracted axis only: std ~ 1/sqrt(6).
    big = lnn.Einsum(shape=(256, 8, 64), logical_axes=("embed", "heads", "kv"))
    init = jax.jit(big.init, static_argnums=1)
    k = nn.meta.unbox(init(jax.random.key(0), "BTD,DNH->BTNH", jnp.ones((1, 1, 256))))
    assert abs(float(np.std(k["params"]["kernel"])) * 16 - 1) < 0.05


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_bf16_einsum_accumulates_in_float32(layout):
    # The dot takes bf16 operands and returns float32 (rounded to bf16 after): what a
    # TPU's matrix unit does, and the fast bf16 path of XLA's CPU backend.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    layer = lnn.Einsum(
        shape=(64, 4, 8),
        logical_axes=("embed", "heads", "kv"),
        dtype=jnp.bfloat16,
        kernel_layout=layout,
    )
    params = nn.meta.unbox(layer.init(jax.random.key(0), "BTD,DNH->BTNH", x))
    apply = lambda p, x: layer.apply(p, "BTD,DNH->BTNH", x)
    dots = [e for e in jax.make_jaxpr(apply)(params, x).eqns if e.primitive.name == "dot_general"]
    assert [e.params["preferred_element_type"] for e in dots] == [jnp.float32]
    assert [tuple(v.aval.dtype for v in e.invars) for e in dots] == [(jnp.bfloat16,) * 2]
    y = apply(params, x)
    assert y.dtype == jnp.bfloat16
    kernel = np.asarray(params["params"]["kernel"]).astype(jnp.bfloat16).astype(np.float32)
    if layout == "out_in":  # stored [N, H, D]
        kernel = np.transpose(kernel, (2, 0, 1))
    rounded = x.astype(jnp.bfloat16).astype(np.float32)
    expected = np.tensordot(rounded, kernel, axes=([2], [0])).astype(jnp.bfloat16)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), expected.astype(np.float32), rtol=2**-7, atol=1e-6
    )


def test_swiglu_matches_numpy():
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    layer = lnn.SwiGLU(mlp_dim=16)
    params = nn.meta.unbox(layer.init(jax.random.key(0), x))["params"]
    y = layer.apply({"params": params}, x)
    gate, up, down = (np.asarray(params[n]["kernel"], np.float64) for n in ("gate", "up", "down"))
    g = x @ gate
    expected = (g / (1 + np.exp(-g)) * (x @ up)) @ down
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_embed_encode_and_tied_decode():
    layer = lnn.Embed(vocab_size=11, embed_dim=4)
    tokens = jnp.array([[1, 5, 10]])
    variables = layer.init(jax.random.key(0), tokens, method=layer.encode)
    table = np.asarray(nn.meta.unbox(variables)["params"]["embedding"])
    assert variables["params"]["embedding"].names == ("vocab", "embed")
    np.testing.assert_array_equal(
        layer.apply(variables, tokens, method=layer.encode), table[[[1, 5, 10]]]
    )
    x = np.random.default_rng(0).normal(size=(1, 2, 4)).astype(np.float32)
    logits = layer.apply(variables, x, method=layer.decode)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, x @ table.T, rtol=1e-5, atol=1e-6)


def test_remat_policy_menu():
    assert "none" in lnn.REMAT_POLICIES and "minimal" in lnn.REMAT_POLICIES
    assert lnn.remat_policy("full") is None
    assert callable(lnn.remat_policy("dots_saveable"))
    with pytest.raises(ValueError, match="remat_policy must be one of"):
        lnn.remat_policy("everything")


class _SwitchedBlock(nn.Module):
    """A norm and a biased projection, each run by a branch per layer."""

    @nn.compact
    def __call__(self, x):
        h = lnn.RMSNorm(name="norm")(x)
        wide = lnn.Einsum((16, 8192), ("embed", "mlp"), use_bias=True, name="up")("BD,DF->BF", h)
        return x + wide[:, :16]


def test_apply_switched_equals_applying_the_chosen_layer():
    block, x = _SwitchedBlock(), jnp.asarray(np.random.default_rng(0).normal(size=(2, 16)))
    layers = [nn.meta.unbox(block.init(jax.random.key(i), x))["params"] for i in range(3)]
    layers = [  # distinct norm scales and biases too
        jax.tree.map(lambda a, i=i: a + 0.3 * i * jnp.sin(jnp.arange(a.size)).reshape(a.shape), t)
        for i, t in enumerate(layers)
    ]
    switched = jax.jit(lambda i: lnn.apply_switched(block, layers, i, x))
    for i, params in enumerate(layers):
        want = block.apply({"params": params}, x)
        np.testing.assert_allclose(switched(jnp.int32(i)), want, rtol=1e-5, atol=1e-6)
    # One switch per leaf, each branch the leaf's call: the projection's one product.
    jaxpr = jax.make_jaxpr(lambda i: lnn.apply_switched(block, layers, i, x))(jnp.int32(0))
    conds = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
    assert [len(eqn.params["branches"]) for eqn in conds] == [3, 3]
    products = [
        sum(e.primitive.name == "dot_general" for e in branch.jaxpr.eqns)
        for branch in conds[1].params["branches"]
    ]
    assert products == [1, 1, 1] and not any(
        e.primitive.name == "dot_general" for e in conds[0].params["branches"][0].jaxpr.eqns
    )


def test_apply_switched_refuses_parameters_outside_the_leaves():
    class Owner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("gain", nn.initializers.ones, (16,))

    x = jnp.ones((1, 16))
    params = Owner().init(jax.random.key(0), x)["params"]
    with pytest.raises(Exception, match="gain"):
        lnn.apply_switched(Owner(), [params, params], jnp.int32(0), x)
