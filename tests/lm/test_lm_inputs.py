"""Model inputs beyond token ids: input embeddings, interventions, last-column logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc import nn as lnn

CONFIG = lm.LMConfig.tiny(max_len=32)


def _inputs(batch=2, length=9, seed=1):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 128, (batch, length)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


@jax.jit
def _apply(params, tokens, positions, embeddings=None, embedding_mask=None, intervention=None):
    return lm.Transformer(CONFIG).apply(
        {"params": params},
        tokens,
        positions,
        embeddings=embeddings,
        embedding_mask=embedding_mask,
        intervention=intervention,
    )[0]


def test_embeddings_of_the_tokens_give_the_same_logits():
    params = lm.random_params(CONFIG)
    tokens, positions = _inputs()
    table = params["embed"]["embedding"]
    want = _apply(params, tokens, positions)
    got = _apply(params, None, positions, embeddings=table[tokens])
    np.testing.assert_allclose(got, want, atol=1e-5)
    # Interleaved: other vectors at masked places change the logits from there on only.
    mask = jnp.zeros(tokens.shape, bool).at[:, 4].set(True)
    other = jnp.asarray(np.random.default_rng(3).normal(size=(2, 9, 32)), jnp.float32)
    mixed = _apply(params, tokens, positions, embeddings=other, embedding_mask=mask)
    np.testing.assert_allclose(mixed[:, :4], want[:, :4], atol=1e-5)
    assert np.abs(np.asarray(mixed[:, 4:] - want[:, 4:])).max() > 1e-3
    # The embedding of token 7 placed at column 4 is token 7 at column 4.
    swapped = tokens.at[:, 4].set(7)
    placed = jnp.broadcast_to(table[7], (2, 9, 32))
    np.testing.assert_allclose(
        _apply(params, tokens, positions, embeddings=placed, embedding_mask=mask),
        _apply(params, swapped, positions),
        atol=1e-5,
    )


@pytest.mark.parametrize("scan_layers", [False, True])
def test_interventions_against_numpy(numpy_lm, scan_layers):
    config = CONFIG.replace(scan_layers=scan_layers)
    params = lm.random_params(CONFIG)
    model_params = lm.stack_layer_params(params, 2) if scan_layers else params
    apply = jax.jit(
        lambda p, t, q, i: lm.Transformer(config).apply({"params": p}, t, q, intervention=i)[0]
    )
    tokens, positions = _inputs(batch=1)
    plain = apply(model_params, tokens, positions, None)
    zero = lnn.Intervention.at(2, layers=[0, 1], values=jnp.zeros(32))
    np.testing.assert_array_equal(apply(model_params, tokens, positions, zero), plain)

    rng = np.random.default_rng(4)
    vector = rng.normal(size=32)
    residual = lnn.Intervention.at(2, layers=[0], values=jnp.asarray(vector, jnp.float32))
    got = apply(model_params, tokens, positions, residual)
    expected = numpy_lm.forward(CONFIG, params, np.asarray(tokens[0]), residual_add={0: vector})
    np.testing.assert_allclose(got[0], expected, atol=1e-4)

    # Attention output of layer 1 at positions 3.. only (a [T, D] vector under a mask).
    per_token = rng.normal(size=(9, 32))
    mask = np.arange(9) >= 3
    attention = lnn.Intervention.at(
        2, layers=[1], values=jnp.asarray(per_token, jnp.float32), mask=mask, site="attention"
    )
    got = apply(model_params, tokens, positions, attention)
    expected = numpy_lm.forward(
        CONFIG, params, np.asarray(tokens[0]), attention_add={1: per_token * mask[:, None]}
    )
    np.testing.assert_allclose(got[0], expected, atol=1e-4)

    # Replacing the residual stream after layer 0 with what it already is changes nothing.
    (_, _), state = lm.Transformer(config).apply(
        {"params": model_params}, tokens, positions, mutable=["intermediates"]
    )
    inter = state["intermediates"]
    recorded = (
        inter["layers"]["residual"][0][0] if scan_layers else inter["layers_0"]["residual"][0]
    )
    same = lnn.Intervention.at(2, layers=[0], values=recorded, mode="replace")
    np.testing.assert_allclose(apply(model_params, tokens, positions, same), plain, atol=1e-5)
    both = residual.merge(attention)
    assert both.residual is residual.residual and both.attention is attention.attention


def test_attention_output_is_sown_and_last_only_logits():
    params = lm.random_params(CONFIG)
    tokens, positions = _inputs()
    model = lm.Transformer(CONFIG)
    (logits, _), state = model.apply(
        {"params": params}, tokens, positions, mutable=["intermediates"]
    )
    attention = state["intermediates"]["layers_1"]["attention_out"][0]
    assert attention.shape == (2, 9, 32)
    before = state["intermediates"]["layers_0"]["residual"][0]
    after = state["intermediates"]["layers_1"]["residual"][0]
    # The residual after layer 1 is the one before plus attention plus the MLP's output.
    assert np.abs(np.asarray(after - before - attention)).max() > 1e-3
    last, _ = model.apply({"params": params}, tokens, positions, last_only=True)
    assert last.shape == (2, 1, 128)
    np.testing.assert_allclose(last[:, 0], logits[:, -1], atol=1e-5)


def test_input_and_intervention_errors():
    params = lm.random_params(CONFIG)
    tokens, positions = _inputs()
    model = lm.Transformer(CONFIG)
    apply = lambda *a, **k: model.apply({"params": params}, *a, **k)
    with pytest.raises(ValueError, match="give tokens, embeddings"):
        apply(None, positions)
    with pytest.raises(ValueError, match="embedding_mask"):
        apply(tokens, positions, embeddings=jnp.zeros((2, 9, 32)))
    with pytest.raises(ValueError, match=r"embeddings must be float \[B, T, D\]"):
        apply(None, positions, embeddings=jnp.zeros((2, 9, 16)))
    with pytest.raises(ValueError, match="covers 3 layers"):
        apply(
            tokens, positions, intervention=lnn.Intervention.at(3, layers=[0], values=jnp.zeros(32))
        )
    with pytest.raises(ValueError, match="outside"):
        lnn.Intervention.at(2, layers=[2], values=jnp.zeros(32))
    with pytest.raises(ValueError, match="site must be one of"):
        lnn.Intervention.at(2, layers=[0], values=jnp.zeros(32), site="mlp")
    with pytest.raises(ValueError, match="both interventions edit the residual site"):
        one = lnn.Intervention.at(2, layers=[0], values=jnp.zeros(32))
        one.merge(one)
