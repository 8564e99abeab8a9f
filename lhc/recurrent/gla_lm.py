"""A gated-linear-attention language model (Yang et al., 2024) on the causal-LM protocol.

Each layer (pre-RMSNorm, residual): GLA over heads (queries, keys and values; forget
gates ``log_sigmoid(W2 W1 x + b) / temperature`` per key channel from a rank-16
projection; ``lhc.recurrent.gla``), a per-head RMSNorm of the output gated by
``silu(W_r x)``, the output projection; then a SwiGLU MLP. The cache
(``RecurrentCache``) holds each layer's ``[H, Dk, Dv]`` state; padding (position -1)
has zero keys and zero log-gates, so it leaves the state unchanged.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.nn import Einsum, RMSNorm, SwiGLU
from lhc.nn.config import register_model
from lhc.recurrent.config import GLAConfig
from lhc.recurrent.scan import gla, gla_step
from lhc.recurrent.stack import RecurrentLM


class GLALayer(nn.Module):
    """GLA and an MLP, each residual; returns the new stream, the state after all but
    the last ``tail`` tokens and the states after each of those (or None)."""

    config: GLAConfig

    @nn.compact
    def __call__(self, x, real, states, tail: int):
        c = self.config
        state = None if states is None else states[0]
        h, dk, dv, d = c.num_heads, c.key_dim, c.value_dim, c.embed_dim

        precision = dict(dtype=c.dtype, param_dtype=c.param_dtype)

        def proj(shape, axes, name, **kw):
            return Einsum(shape, axes, **precision, name=name, **kw)

        y = RMSNorm(epsilon=c.norm_eps, **precision, name="attn_norm")(x)
        q = proj((d, h, dk), ("embed", "heads", "kv"), "q")("BTD,DHK->BTHK", y)
        k = proj((d, h, dk), ("embed", "heads", "kv"), "k")("BTD,DHK->BTHK", y)
        v = proj((d, h, dv), ("embed", "heads", "kv"), "v")("BTD,DHV->BTHV", y)
        low = proj((d, c.gate_rank), ("embed", None), "gate_down")("BTD,DR->BTR", y)
        gates = proj((c.gate_rank, h, dk), (None, "heads", "kv"), "gate_up", use_bias=True)(
            "BTR,RHK->BTHK", low
        )
        log_gates = jax.nn.log_sigmoid(gates.astype(jnp.float32)) / c.gate_temperature
        keep = real[..., None, None]
        k = jnp.where(keep, k, 0)  # padding adds nothing and forgets nothing
        log_gates = jnp.where(keep, log_gates, 0.0)
        q = q * dk**-0.5
        t = x.shape[1]
        head = t - tail
        outs = []
        if head:
            o, state = gla(
                q[:, :head],
                k[:, :head],
                v[:, :head],
                log_gates[:, :head],
                chunk_size=c.chunk_size,
                initial_state=state,
            )
            outs.append(o)
        head_end, tail_states = state, None
        if tail:

            def step(s, inputs):
                o, s = gla_step(*inputs, s)
                return s, (o, s)

            swap = lambda a: jnp.swapaxes(a[:, head:], 0, 1)  # noqa: E731
            state = jnp.zeros((x.shape[0], h, dk, dv), jnp.float32) if state is None else state
            _, (o, states) = jax.lax.scan(step, state, tuple(map(swap, (q, k, v, log_gates))))
            outs.append(jnp.swapaxes(o, 0, 1))
            tail_states = jnp.swapaxes(states, 0, 1)
        o = jnp.concatenate(outs, axis=1)
        o = RMSNorm(
            epsilon=c.norm_eps, dtype=jnp.float32, param_dtype=c.param_dtype, name="head_norm"
        )(o)
        r = proj((d, h, dv), ("embed", "heads", "kv"), "out_gate")("BTD,DHV->BTHV", y)
        o = (o * jax.nn.silu(r.astype(jnp.float32))).astype(c.dtype)
        x = x + proj((h, dv, d), ("heads", "kv", "embed"), "o", in_dims=2)("BTHV,HVD->BTD", o)
        y = RMSNorm(epsilon=c.norm_eps, **precision, name="mlp_norm")(x)
        x = x + SwiGLU(c.mlp_dim, **precision, name="mlp")(y)
        return x, (head_end,), None if tail_states is None else (tail_states,)


@register_model("gla", GLAConfig)
class GLALM(RecurrentLM):
    """A stack of GLA layers (``RecurrentLM``: the causal-LM protocol)."""

    config: GLAConfig
    layer = GLALayer

    @nn.nowrap
    def state_specs(self):
        c = self.config
        return {"gla": ((c.num_heads, c.key_dim, c.value_dim), jnp.float32)}
