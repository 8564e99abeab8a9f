"""Feed-forward layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from lhc.nn import remat
from lhc.nn.linear import Einsum


class _MLP(nn.Module):
    """Fields and projections the MLPs share.

    Attributes:
        mlp_dim: F, the hidden width.
        dtype: compute dtype.
        param_dtype: storage dtype.
        kernel_layout: ``"in_out"`` or ``"out_in"`` (see ``lhc.nn.Einsum``).
    """

    mlp_dim: int
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    kernel_layout: str = "in_out"

    @nn.nowrap
    def _up(self, x: jax.Array, name: str) -> jax.Array:
        """``[B, T, D] -> [B, T, F]``."""
        return self._projection((x.shape[-1], self.mlp_dim), ("embed", "mlp"), name)(
            "BTD,DF->BTF", x
        )

    @nn.nowrap
    def _down(self, hidden: jax.Array, embed_dim: int) -> jax.Array:
        """``[B, T, F] -> [B, T, D]``, named ``down``."""
        out = self._projection((self.mlp_dim, embed_dim), ("mlp", "embed"), "down")(
            "BTF,FD->BTD", hidden
        )
        return checkpoint_name(out, remat.MLP_OUT)

    @nn.nowrap
    def _projection(self, shape, axes, name) -> Einsum:
        return Einsum(
            shape=shape,
            logical_axes=axes,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_layout=self.kernel_layout,
            name=name,
        )


class SwiGLU(_MLP):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Llama, Qwen2); fields as ``_MLP``'s."""

    @nn.nowrap
    def _activation(self, gate: jax.Array) -> jax.Array:
        return jax.nn.silu(gate)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps ``x`` ``[B, T, D]`` to ``[B, T, D]``."""
        gate = checkpoint_name(self._up(x, "gate"), remat.MLP_GATE)
        up = checkpoint_name(self._up(x, "up"), remat.MLP_UP)
        hidden = nn.with_logical_constraint(
            self._activation(gate) * up, ("act_batch", "act_len", "act_mlp")
        )
        return self._down(hidden, x.shape[-1])


class GeGLU(SwiGLU):
    """Gated MLP ``down(gelu_tanh(gate(x)) * up(x))`` with the tanh-approximate GELU
    (Gemma); fields as ``_MLP``'s."""

    @nn.nowrap
    def _activation(self, gate: jax.Array) -> jax.Array:
        return jax.nn.gelu(gate, approximate=True)


class GeluMLP(_MLP):
    """Two-layer MLP ``down(gelu(up(x)))`` with the exact (erf) GELU (GPT-2, nanoGPT; F is
    4 D there); fields as ``_MLP``'s."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps ``x`` ``[B, T, D]`` to ``[B, T, D]``."""
        up = checkpoint_name(self._up(x, "up"), remat.MLP_UP)
        hidden = nn.with_logical_constraint(
            jax.nn.gelu(up, approximate=False), ("act_batch", "act_len", "act_mlp")
        )
        return self._down(hidden, x.shape[-1])
