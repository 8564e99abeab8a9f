"""Losses of a language-model head that never hold the whole ``[B, T, V]`` logits.

A 32K-token window of a 49,152-token vocabulary has 6.4 GB of float32 logits before
their gradient; ``chunked_token_nll`` computes them ``chunk`` positions at a time inside
a scan whose body is rematerialised, so the forward and the backward pass each hold one
chunk's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_token_nll(
    x: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    *,
    outputs_first: bool,
    chunk: int,
    dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Negative log-likelihood of ``targets`` under the logits ``x @ W``, and whether
    each target is the argmax.

    Args:
        x: ``[B, T, D]``, the final hidden states.
        weight: the head, ``[V, D]`` with ``outputs_first`` (a tied embedding table, an
            ``out_in`` kernel), else ``[D, V]``.
        targets: int ``[B, T]``.
        chunk: positions per step of the scan (``T`` is padded to a multiple of it).
        dtype: the matmul's input dtype; logits accumulate in float32.

    Returns:
        ``(nll, hit)``: float32 ``[B, T]`` and bool ``[B, T]``.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"loss_chunk: expected an int >= 1, got {chunk!r}")
    batch, length, width = x.shape
    chunk = min(chunk, length)
    steps = -(-length // chunk)
    pad = steps * chunk - length
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(batch, steps, chunk, width)
    ts = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad))).reshape(batch, steps, chunk)
    w = weight.astype(dtype)
    equation = "BTD,VD->BTV" if outputs_first else "BTD,DV->BTV"

    @jax.checkpoint
    def step(carry, inputs):
        x_chunk, t_chunk = inputs
        logits = jnp.einsum(equation, x_chunk.astype(dtype), w, preferred_element_type=jnp.float32)
        picked = jnp.take_along_axis(logits, t_chunk[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        return carry, (nll, jnp.argmax(logits, axis=-1) == t_chunk)

    _, (nll, hit) = jax.lax.scan(step, None, (xs.swapaxes(0, 1), ts.swapaxes(0, 1)))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(batch, steps * chunk)[:, :length]
    return unchunk(nll), unchunk(hit)
