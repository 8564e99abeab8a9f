"""Feed-forward layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from lhc.nn import remat
from lhc.nn.linear import Einsum


class SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Llama, Qwen2).

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

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps ``x`` ``[B, T, D]`` to ``[B, T, D]``."""
        embed_dim = x.shape[-1]

        def projection(shape, axes, name):
            return Einsum(
                shape=shape,
                logical_axes=axes,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_layout=self.kernel_layout,
                name=name,
            )

        gate = projection((embed_dim, self.mlp_dim), ("embed", "mlp"), "gate")("BTD,DF->BTF", x)
        up = projection((embed_dim, self.mlp_dim), ("embed", "mlp"), "up")("BTD,DF->BTF", x)
        gate = checkpoint_name(gate, remat.MLP_GATE)
        up = checkpoint_name(up, remat.MLP_UP)
        hidden = nn.with_logical_constraint(
            jax.nn.silu(gate) * up, ("act_batch", "act_len", "act_mlp")
        )
        out = projection((self.mlp_dim, embed_dim), ("mlp", "embed"), "down")("BTF,FD->BTD", hidden)
        return checkpoint_name(out, remat.MLP_OUT)


class GeluMLP(nn.Module):
    """Two-layer MLP ``down(gelu(up(x)))`` with the exact (erf) GELU (GPT-2, nanoGPT).

    Attributes:
        mlp_dim: F, the hidden width (4 D in GPT-2).
        dtype: compute dtype.
        param_dtype: storage dtype.
        kernel_layout: ``"in_out"`` or ``"out_in"`` (see ``lhc.nn.Einsum``).
    """

    mlp_dim: int
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    kernel_layout: str = "in_out"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps ``x`` ``[B, T, D]`` to ``[B, T, D]``."""
        embed_dim = x.shape[-1]
        up = Einsum(
            shape=(embed_dim, self.mlp_dim), logical_axes=("embed", "mlp"), dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_layout=self.kernel_layout, name="up",
        )("BTD,DF->BTF", x)  # fmt: skip
        up = checkpoint_name(up, remat.MLP_UP)
        hidden = nn.with_logical_constraint(
            jax.nn.gelu(up, approximate=False), ("act_batch", "act_len", "act_mlp")
        )
        out = Einsum(
            shape=(self.mlp_dim, embed_dim), logical_axes=("mlp", "embed"), dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_layout=self.kernel_layout, name="down",
        )("BTF,FD->BTD", hidden)  # fmt: skip
        return checkpoint_name(out, remat.MLP_OUT)
