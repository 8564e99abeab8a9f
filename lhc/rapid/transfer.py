"""RAPID's inference-time knowledge transfer: the target's distribution moved toward the
RAG drafter's, as the acceptance rule of speculative decoding.

With target logits z, the target's distribution ``p = softmax(z / T)`` and the drafter's
q (after the same temperature), the corrected logits are one gradient step of
``T^2 KL(q || p)`` with respect to z::

    z_hat = z + eta * T * (q - p)     where q >= alpha * max(q) (elsewhere z),

and ``p_hat = softmax(z_hat / T)``. A draft x is accepted when ``r <= p_hat(x) / q(x)``;
at the first rejection the next token is drawn from ``norm(max(p - q, p - p_hat, 0))``;
after every draft is accepted, from p. With ``eta = 0`` this is standard speculative
sampling. With ``eta > 0`` the output is *not* distributed as p: tokens that both the
drafter and the corrected target favour are boosted, which is the point.

Greedy decoding (temperature 0) uses ``T = 1`` in the correction and the drafter's
one-hot q: a draft is kept when it is the argmax of ``z_hat``, and otherwise the target's
argmax follows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lhc.lm.sampling import SamplingParams, logits_to_probs
from lhc.lm.speculative import SpeculativeSampling


def transfer_logits(
    target_logits: jax.Array,
    draft_probs: jax.Array,
    *,
    eta: float,
    temperature: float = 1.0,
    alpha: float = 0.1,
) -> jax.Array:
    """``z_hat = z + eta * T * (q - softmax(z / T))`` where ``q >= alpha * max q``, else z.

    Args:
        target_logits: z, float ``[..., V]``.
        draft_probs: q, float ``[..., V]`` (the same leading shape).
        eta: the step size (0 returns z unchanged).
        temperature: T > 0.
        alpha: tail protection in [0, 1]: only tokens with ``q >= alpha * max q`` move.

    Returns:
        float32 ``[..., V]``.
    """
    if target_logits.shape != draft_probs.shape:
        raise ValueError(
            f"transfer_logits: target_logits {target_logits.shape} and draft_probs "
            f"{draft_probs.shape} must have the same shape"
        )
    if not temperature > 0:
        raise ValueError(f"transfer_logits: temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"transfer_logits: alpha must lie in [0, 1], got {alpha}")
    z = target_logits.astype(jnp.float32)
    q = draft_probs.astype(jnp.float32)
    p = jax.nn.softmax(z / temperature, axis=-1)
    protected = q >= alpha * q.max(axis=-1, keepdims=True)
    return jnp.where(protected, z + eta * temperature * (q - p), z)


def residual_probs(p: jax.Array, q: jax.Array, p_hat: jax.Array) -> jax.Array:
    """``norm(max(p - q, p - p_hat, 0))`` over the trailing axis; p where that is all zero
    (q and p_hat both cover p everywhere, which happens only when p == q == p_hat)."""
    residual = jnp.maximum(jnp.maximum(p - q, p - p_hat), 0.0)
    total = residual.sum(axis=-1, keepdims=True)
    return jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)


@dataclasses.dataclass(frozen=True)
class RapidSampling(SpeculativeSampling):
    """The RAPID verifier for ``lhc.lm.speculative_generate``.

    Attributes:
        eta: the knowledge-transfer step (paper: 5-20 for self-speculation, 40-50 for
            upward speculation; 0 is standard speculative sampling).
        alpha: tail protection (the official code's ``spec_alpha``, 0.1).
    """

    eta: float = 10.0
    alpha: float = 0.1

    def adjust(
        self, target_logits: jax.Array, draft_probs: jax.Array, sampling: SamplingParams
    ) -> tuple[jax.Array, jax.Array]:
        """``(p, p_hat)``: p_hat corrected at the G draft positions, p at the bonus."""
        target_probs = logits_to_probs(target_logits, sampling)
        temperature = sampling.temperature if not sampling.greedy else 1.0
        corrected = transfer_logits(
            target_logits[:, :-1],
            draft_probs,
            eta=self.eta,
            temperature=temperature,
            alpha=self.alpha,
        )
        adjusted = logits_to_probs(corrected, sampling)
        return target_probs, jnp.concatenate([adjusted, target_probs[:, -1:]], axis=1)

    def residual(
        self, target_probs: jax.Array, adjusted: jax.Array, draft_probs: jax.Array
    ) -> jax.Array:
        return residual_probs(target_probs[:, :-1], draft_probs, adjusted[:, :-1])
