"""The chunked head loss against the whole logits, and that it never forms them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.nn.losses import chunked_token_nll

B, T, D, V = 2, 37, 16, 50


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    w = rng.normal(size=(D, V)).astype(np.float32) * 0.5
    targets = rng.integers(0, V, (B, T))
    return x, w, targets


@pytest.mark.parametrize("outputs_first", [False, True])
def test_nll_and_gradients_equal_the_whole_logits(outputs_first):
    x, w, targets = _inputs()
    logits = x.astype(np.float64) @ w.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    weight = w.T if outputs_first else w
    nll, hit = chunked_token_nll(x, weight, targets, outputs_first=outputs_first, chunk=8)
    np.testing.assert_allclose(np.asarray(nll), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hit), logits.argmax(-1) == targets)

    def chunked(x, weight):
        return chunked_token_nll(x, weight, targets, outputs_first=outputs_first, chunk=8)[0].sum()

    def whole(x, weight):
        logits = x @ (weight.T if outputs_first else weight)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
        return -picked.sum()

    got = jax.grad(chunked, argnums=(0, 1))(x, weight)
    want = jax.grad(whole, argnums=(0, 1))(x, weight)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_no_array_of_the_whole_logits_is_formed_forward_or_backward():
    x, w, targets = _inputs()
    loss = lambda x, w: chunked_token_nll(x, w, targets, outputs_first=False, chunk=8)[0].sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    shapes = set()

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.core.jaxprs_in_params(eqn.params):
                collect(sub)

    collect(jaxpr.jaxpr)
    assert (B, 8, V) in shapes  # one chunk's logits
    assert not any(len(s) >= 2 and s[-1] == V and np.prod(s) >= B * T * V for s in shapes)


@pytest.mark.parametrize("tie, layout", [(True, "in_out"), (False, "out_in")])
def test_the_model_gives_each_targets_log_probability(tie, layout):
    config = lm.LMConfig.tiny(tie_embeddings=tie, kernel_layout=layout)
    params = lm.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 12)))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    targets = jnp.roll(tokens, -1, axis=1)
    model = lm.Transformer(config)
    logits, _ = jax.jit(model.apply)({"params": params}, tokens, positions)
    apply = jax.jit(
        lambda p: model.apply({"params": p}, tokens, positions, targets=targets, loss_chunk=5)
    )
    (nll, hit), cache = apply(params)
    assert cache is None
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    expected = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(nll), np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hit), np.asarray(logits.argmax(-1) == targets))
