"""A Mamba-2 language model on the causal-LM protocol, its cache the recurrent state.

Each block (pre-RMSNorm, residual): an input projection to ``z``, ``xBC`` and ``dt``;
the short causal convolution of ``xBC`` with its own state (``causal_conv``) and SiLU;
the SSD over heads of ``head_dim`` channels with a state of ``state_dim``
(``lhc.recurrent.ssd``) plus the skip ``D x``; the gated RMSNorm ``norm(y * silu(z))``;
the output projection.

The cache (``RecurrentCache``) holds, per layer, the convolution's last ``K - 1`` inputs
and the SSM state, so its memory does not depend on the context; padding (position -1)
leaves both unchanged. A call runs the chunked SSD over all but its last ``rollback``
tokens and steps through those, recording the state after each, so truncation for
speculative rollback within them is exact.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.nn import Einsum, RMSNorm
from lhc.nn.config import register_model
from lhc.recurrent.config import Mamba2Config
from lhc.recurrent.conv import causal_conv
from lhc.recurrent.scan import ssd, ssd_step
from lhc.recurrent.stack import RecurrentLM


def _param(module, name, init, shape, axes, param_dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, param_dtype)


class Mamba2Block(nn.Module):
    """One residual Mamba-2 block; returns the new residual stream and, with states in,
    the states after each of the call's last ``tail`` tokens and after the call."""

    config: Mamba2Config

    def _split(self, zxbcdt):
        c = self.config
        z, xbc, dt = jnp.split(zxbcdt, [c.inner_dim, c.inner_dim + c.conv_dim], axis=-1)
        return z, xbc, dt

    def _ssd_inputs(self, xbc, dt, dt_bias, real):
        c = self.config
        x, b, cc = jnp.split(xbc, [c.inner_dim, c.inner_dim + c.num_groups * c.state_dim], -1)
        lead = x.shape[:-1]
        x = x.reshape(*lead, c.num_heads, c.head_dim)
        b = b.reshape(*lead, c.num_groups, c.state_dim)
        cc = cc.reshape(*lead, c.num_groups, c.state_dim)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias)
        dt = jnp.where(real[..., None], dt, 0.0)  # padding: no decay, no input
        return x, dt, b, cc

    @nn.compact
    def __call__(self, x, real, states, tail: int):
        c = self.config
        conv_state, ssm_state = (None, None) if states is None else states
        h = c.num_heads
        precision = dict(dtype=c.dtype, param_dtype=c.param_dtype)
        param = lambda *args: _param(self, *args, c.param_dtype)  # noqa: E731
        in_proj = Einsum(
            (c.embed_dim, 2 * c.inner_dim + 2 * c.num_groups * c.state_dim + h),
            ("embed", "mlp"),
            **precision,
            name="in_proj",
        )
        conv_weight = param(
            "conv_weight",
            nn.initializers.lecun_normal(in_axis=0, out_axis=1),
            (c.conv_width, c.conv_dim),
            (None, "mlp"),
        )
        conv_bias = param("conv_bias", nn.initializers.zeros, (c.conv_dim,), ("mlp",))
        a_log = param(
            "A_log",
            lambda k, s, d: jnp.log(jnp.linspace(1.0, 16.0, s[0], dtype=d)),
            (h,),
            ("heads",),
        )
        skip = param("D", nn.initializers.ones, (h,), ("heads",))

        def dt_bias_init(key, shape, dtype):  # softplus^-1 of dt in [1e-3, 1e-1], log-uniform
            dt = jnp.exp(jax.random.uniform(key, shape, dtype, jnp.log(1e-3), jnp.log(1e-1)))
            return dt + jnp.log(-jnp.expm1(-dt))

        dt_bias = param("dt_bias", dt_bias_init, (h,), ("heads",))
        norm = RMSNorm(epsilon=c.norm_eps, **precision, name="norm")
        gated_norm = RMSNorm(
            epsilon=c.norm_eps, dtype=jnp.float32, param_dtype=c.param_dtype, name="gated_norm"
        )
        out_proj = Einsum(
            (c.inner_dim, c.embed_dim), ("mlp", "embed"), **precision, name="out_proj"
        )
        a = -jnp.exp(a_log)

        z, xbc, dt = self._split(in_proj("BTD,DF->BTF", norm(x)))
        t = x.shape[1]
        head = t - tail
        ys = []
        if head:  # the chunked form over all but the call's last `tail` tokens
            conv_out, conv_state = causal_conv(
                xbc[:, :head], conv_weight, conv_bias, real=real[:, :head], state=conv_state
            )
            xs, dts, bs, cs = self._ssd_inputs(
                jax.nn.silu(conv_out), dt[:, :head], dt_bias, real[:, :head]
            )
            y, ssm_state = ssd(xs, dts, a, bs, cs, chunk_size=c.chunk_size, initial_state=ssm_state)
            ys.append(y + skip[:, None] * xs)
        head_end = (conv_state, ssm_state)
        tail_states = None
        if tail:  # token by token, keeping the state after each one

            def step(carry, inputs):
                conv_s, ssm_s = carry
                xbc_t, dt_t, real_t = inputs
                out, conv_s = causal_conv(
                    xbc_t[:, None], conv_weight, conv_bias, real=real_t[:, None], state=conv_s
                )
                xs, dts, bs, cs = self._ssd_inputs(jax.nn.silu(out[:, 0]), dt_t, dt_bias, real_t)
                y, ssm_s = ssd_step(xs, dts, a, bs, cs, ssm_s)
                return (conv_s, ssm_s), (y + skip[:, None] * xs, conv_s, ssm_s)

            swap = lambda v: jnp.swapaxes(v, 0, 1)  # noqa: E731
            (conv_state, ssm_state), (y, conv_hist, ssm_hist) = jax.lax.scan(
                step,
                (conv_state, ssm_state),
                (swap(xbc[:, head:]), swap(dt[:, head:]), swap(real[:, head:])),
            )
            ys.append(swap(y))
            tail_states = (swap(conv_hist), swap(ssm_hist))  # [B, tail, ...], oldest first
        y = jnp.concatenate(ys, axis=1).reshape(x.shape[0], t, c.inner_dim)
        y = gated_norm(y * jax.nn.silu(z.astype(jnp.float32)))
        x = x + out_proj("BTF,FD->BTD", y)
        return x, head_end, tail_states


@register_model("mamba2", Mamba2Config)
class Mamba2LM(RecurrentLM):
    """A stack of Mamba-2 blocks (``RecurrentLM``: the causal-LM protocol)."""

    config: Mamba2Config
    layer = Mamba2Block

    @nn.nowrap
    def state_specs(self):
        c = self.config
        return {
            "conv": ((c.conv_width - 1, c.conv_dim), c.dtype),
            "ssm": ((c.num_heads, c.head_dim, c.state_dim), jnp.float32),
        }
