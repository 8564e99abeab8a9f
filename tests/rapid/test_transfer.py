"""RAPID's knowledge transfer against the formulas computed directly in numpy, and its
acceptance rule by Monte Carlo against closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.lm.decoding import GREEDY
from lhc.rapid import RapidSampling, residual_probs, transfer_logits


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def _simplex(rng, shape):
    probs = rng.gamma(0.7, size=shape)
    return probs / probs.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    ("eta", "temperature", "alpha"),
    [(0.0, 1.0, 0.1), (10.0, 0.5, 0.1), (40.0, 1.3, 0.0), (5.0, 1.0, 1.0)],
)
def test_transfer_logits_is_the_formula(eta, temperature, alpha):
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2, 3, 11)) * 2
    q = _simplex(rng, (2, 3, 11))
    got = np.asarray(
        transfer_logits(
            jnp.asarray(z, jnp.float32),
            jnp.asarray(q, jnp.float32),
            eta=eta,
            temperature=temperature,
            alpha=alpha,
        )
    )
    want = z.copy()
    for index in np.ndindex(z.shape[:-1]):
        p = _softmax(z[index] / temperature)
        for v in range(z.shape[-1]):
            if q[index][v] >= alpha * q[index].max():
                want[index][v] = z[index][v] + eta * temperature * (q[index][v] - p[v])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if eta == 0.0:
        np.testing.assert_array_equal(got, z.astype(np.float32))


def test_residual_probs_is_the_formula():
    rng = np.random.default_rng(1)
    p, q, p_hat = (_simplex(rng, (4, 9)) for _ in range(3))
    got = np.asarray(residual_probs(*(jnp.asarray(x, jnp.float32) for x in (p, q, p_hat))))
    for row in range(4):
        r = np.array([max(p[row, v] - q[row, v], p[row, v] - p_hat[row, v], 0.0) for v in range(9)])
        np.testing.assert_allclose(got[row], r / r.sum(), rtol=1e-5, atol=1e-6)
    # Where p, q and p_hat agree there is no residual mass: p itself.
    same = np.asarray(residual_probs(*(jnp.asarray(p, jnp.float32),) * 3))
    np.testing.assert_allclose(same, p, rtol=1e-6)


def _verify_many(verifier, z, q, samples, seed):
    """G = 1 draft per row, ``samples`` rows of the same distributions."""
    sampling = lm.SamplingParams(temperature=1.0)
    z = jnp.broadcast_to(jnp.asarray(z, jnp.float32), (samples, *z.shape))
    q = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (samples, *q.shape))
    draft_key, verify_key = jax.random.split(jax.random.key(seed))
    drafts = jax.random.categorical(draft_key, jnp.log(q))
    accepted, next_token = verifier(verify_key, drafts, q, z, sampling)
    return np.asarray(drafts[:, 0]), np.asarray(accepted), np.asarray(next_token)


@pytest.mark.parametrize("eta", [0.0, 8.0])
def test_accept_and_residual_follow_the_rule(eta):
    """P(accept d) = min(1, p_hat(d) / q(d)); after a rejection of d the next token follows
    norm(max(p - q, p - p_hat, 0)), p and p_hat computed here in numpy."""
    rng = np.random.default_rng(2)
    vocab, samples = 5, 200_000
    z = rng.normal(size=(2, vocab)) * 1.5
    q = _simplex(rng, (1, vocab))
    drafts, accepted, next_token = _verify_many(RapidSampling(eta=eta, alpha=0.1), z, q, samples, 3)
    p = _softmax(z[0])
    protected = q[0] >= 0.1 * q[0].max()
    p_hat = _softmax(np.where(protected, z[0] + eta * (q[0] - p), z[0]))
    residual = np.maximum(np.maximum(p - q[0], p - p_hat), 0)
    residual /= residual.sum()
    for d in range(vocab):
        rows = drafts == d
        if rows.sum() < 2000:
            continue
        np.testing.assert_allclose(accepted[rows].mean(), min(1, p_hat[d] / q[0, d]), atol=0.02)
    rejected = accepted == 0
    np.testing.assert_allclose(
        np.bincount(next_token[rejected], minlength=vocab) / rejected.sum(), residual, atol=0.01
    )
    # All accepted: the bonus token is drawn from p at the next position.
    bonus = np.bincount(next_token[~rejected], minlength=vocab) / (~rejected).sum()
    np.testing.assert_allclose(bonus, _softmax(z[1]), atol=0.01)
    if eta == 0.0:
        # Standard speculative sampling: the emitted token is distributed as p.
        first = np.where(accepted == 1, drafts, next_token)
        np.testing.assert_allclose(np.bincount(first, minlength=vocab) / samples, p, atol=5e-3)


def test_acceptance_rises_with_eta():
    """A draft that prefers what the target finds unlikely: the more knowledge is
    transferred, the more of its tokens are accepted, each rate equal to the closed form
    sum_x min(p_hat(x), q(x)). A step far past q overshoots (p_hat beyond q on the
    favoured token, below it elsewhere) and acceptance falls again."""
    z = np.log(np.array([[0.6, 0.3, 0.05, 0.05], [0.25] * 4]))
    q = np.array([[0.1, 0.1, 0.7, 0.1]])
    p = np.exp(z[0])
    rates = []
    for eta in (0.0, 2.0, 5.0, 20.0):
        _, accepted, _ = _verify_many(RapidSampling(eta=eta, alpha=0.1), z, q, 50_000, 4)
        p_hat = _softmax(z[0] + eta * (q[0] - p))
        np.testing.assert_allclose(accepted.mean(), np.minimum(p_hat, q[0]).sum(), atol=0.01)
        rates.append(accepted.mean())
    assert rates[0] < rates[1] < rates[2], rates
    assert rates[3] < rates[2], rates


def test_greedy_keeps_a_draft_only_when_it_wins_the_corrected_argmax():
    # Target argmax 0 (logit 2.0), draft token 1 (logit 1.9): the correction
    # eta * (1 - p(1)) + eta * p(0) must exceed the 0.1 gap.
    z = jnp.asarray([[[2.0, 1.9, -1.0], [0.0, 0.0, 1.0]]])
    q = jnp.asarray([[[0.0, 1.0, 0.0]]])
    drafts = jnp.asarray([[1]])
    for eta, want in ((0.0, (0, 0)), (0.05, (0, 0)), (1.0, (1, 2))):
        accepted, next_token = RapidSampling(eta=eta)(jax.random.key(0), drafts, q, z, GREEDY)
        assert (int(accepted[0]), int(next_token[0])) == want, eta


def test_bad_arguments():
    z = jnp.zeros((2, 5))
    with pytest.raises(ValueError, match="same shape"):
        transfer_logits(z, jnp.zeros((2, 4)), eta=1.0)
    with pytest.raises(ValueError, match="temperature"):
        transfer_logits(z, z, eta=1.0, temperature=0.0)
    with pytest.raises(ValueError, match="alpha"):
        transfer_logits(z, z, eta=1.0, alpha=1.5)
