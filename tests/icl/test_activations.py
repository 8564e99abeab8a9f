"""Reading and steering activations against the float64 numpy decoder."""

import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.icl import activations
from lhc.icl.activations import edit_at, read_activations

from ..support import forward
from .conftest import CONFIG

TOKENS = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 9))


def _apply(model, params, tokens, intervention=None):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    extra = {} if intervention is None else {"intervention": intervention}
    return model.apply({"params": params}, jnp.asarray(tokens), positions, **extra)[0]


@pytest.mark.parametrize("site", ["residual", "attention", "layer_input"])
@pytest.mark.parametrize("scan", [False, True])
def test_read_matches_the_numpy_decoder(tiny, site, scan):
    model, params = tiny
    if scan:
        model = lm.Transformer(CONFIG.replace(scan_layers=True))
        params = lm.stack_layer_params(params, CONFIG.num_layers)
    at = np.array([[0, 4, 8], [2, 3, 7]])
    acts, logits = read_activations(model, params, TOKENS, at, site=site)
    assert acts.shape == (CONFIG.num_layers, 2, 3, CONFIG.embed_dim)
    for b in range(2):
        states = {}
        want_logits = forward(
            CONFIG, lm.unstack_layer_params(params) if scan else params, TOKENS[b], states=states
        )
        np.testing.assert_allclose(logits[b], want_logits[at[b]], rtol=1e-4, atol=1e-4)
        for layer in range(CONFIG.num_layers):
            want = states[site, layer][at[b]]
            np.testing.assert_allclose(acts[layer, b], want, rtol=1e-4, atol=1e-4)


def test_zero_vectors_change_nothing(tiny):
    model, params = tiny
    plain = _apply(model, params, TOKENS)
    for site in ("residual", "attention"):
        zero = edit_at(
            CONFIG.num_layers, 9, [[3, 8], [0, 5]], np.zeros(CONFIG.embed_dim), site=site
        )
        np.testing.assert_array_equal(_apply(model, params, TOKENS, zero), plain)


@pytest.mark.parametrize("site", ["residual", "attention"])
def test_added_vectors_match_the_numpy_decoder(tiny, site):
    model, params = tiny
    rng = np.random.default_rng(4)
    at = np.array([[2, 6], [5, 8]])
    values = rng.normal(size=(2, 2, 2, CONFIG.embed_dim))  # [layers, B, K, D]
    steer = edit_at(CONFIG.num_layers, 9, at, values, layers=[0, 2], per_layer=True, site=site)
    got = _apply(model, params, TOKENS, steer)
    for b in range(2):
        adds = {}
        for i, layer in enumerate([0, 2]):
            dense = np.zeros((9, CONFIG.embed_dim))
            dense[at[b]] = values[i, b]
            adds[layer] = dense
        key = "residual_add" if site == "residual" else "attention_add"
        want = forward(CONFIG, params, TOKENS[b], **{key: adds})
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4)


def test_a_replaced_residual_equals_a_pass_resumed_from_the_edited_stream(tiny):
    """Replacing the residual at layer l, column p with v == running layers l+1.. from
    the unedited stream after layer l with column p set to v."""
    model, params = tiny
    layer, column = 1, 6
    vector = np.random.default_rng(5).normal(size=CONFIG.embed_dim)
    steer = edit_at(CONFIG.num_layers, 9, [[column]] * 2, vector, layers=[layer], mode="replace")
    got = _apply(model, params, TOKENS, steer)
    stream = np.array(read_activations(model, params, TOKENS, np.tile(np.arange(9), (2, 1)))[0])
    edited = stream[layer].copy()
    edited[:, column] = vector
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    want, _ = model.apply(
        {"params": params}, None, positions, embeddings=jnp.asarray(edited), start_layer=layer + 1
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        got[:, :column], _apply(model, params, TOKENS)[:, :column], rtol=1e-6, atol=1e-6
    )


def test_a_read_under_an_edit_sees_the_edit(tiny):
    model, params = tiny
    vector = np.ones(CONFIG.embed_dim)
    steer = edit_at(CONFIG.num_layers, 9, [[4], [4]], vector, layers=[2], site="attention")
    plain, _ = read_activations(model, params, TOKENS, [[4], [4]], site="attention")
    edited, _ = read_activations(
        model, params, TOKENS, [[4], [4]], site="attention", intervention=steer
    )
    np.testing.assert_allclose(edited[2], plain[2] + 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(edited[:2], plain[:2])


def test_bad_input_is_refused(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match=r"at\[1, 0\] = 9 is not a position of the prompt"):
        read_activations(model, params, TOKENS, [[0], [9]])
    with pytest.raises(ValueError, match=r"row 0 has 5 tokens"):
        read_activations(model, params, TOKENS, [[6], [2]], lengths=[5, 9])
    with pytest.raises(ValueError, match="site must be one of"):
        read_activations(model, params, TOKENS, [[0], [1]], site="mlp")
    with pytest.raises(ValueError, match=r"layers \[3\] lie outside \[0, num_layers=3\)"):
        edit_at(3, 9, [[1]], np.zeros(32), layers=[3])
    with pytest.raises(ValueError, match="is not a position"):
        edit_at(3, 9, [[-1]], np.zeros(32))
    with pytest.raises(ValueError, match=r"per column \(\[2, D\]\).*got \(3, 32\)"):
        edit_at(3, 9, [[1, 2]], np.zeros((3, 32)))
    assert set(activations.SITES) == {"residual", "attention", "layer_input"}
