"""Normalisation layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-feature scale.

    ``y = x / sqrt(mean(x**2) + epsilon) * (scale_offset + scale)``. The statistics and
    the scaling run in float32 whatever the compute dtype, because a bf16 mean of squares
    loses the small features that the normalisation is meant to preserve.

    Attributes:
        epsilon: added to the mean square before the square root.
        dtype: dtype of the output.
        param_dtype: storage dtype of ``scale``.
        scale_offset: added to ``scale`` (Gemma stores ``scale - 1``: offset 1).
        scale_init: initializer of ``scale``; by default ones, or zeros with an offset
            of 1, so the layer starts as plain RMS normalisation.
    """

    epsilon: float = 1e-6
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    scale_offset: float = 0.0
    scale_init: nn.initializers.Initializer | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises the last axis.

        Args:
            x: ``[..., D]``.

        Returns:
            ``[..., D]`` in ``dtype``.
        """
        init = self.scale_init
        if init is None:
            init = nn.initializers.constant(1.0 - self.scale_offset)
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(init, ("norm",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_square + self.epsilon)
        return (normed * (self.scale_offset + scale.astype(jnp.float32))).astype(self.dtype)


class LayerNorm(nn.Module):
    """Layer normalisation with a learned scale and an optional bias (GPT-2, nanoGPT).

    ``y = (x - mean(x)) / sqrt(var(x) + epsilon) * scale (+ bias)``, statistics and
    scaling in float32 as in ``RMSNorm``.

    Attributes:
        epsilon: added to the variance before the square root.
        use_bias: learn a bias (nanoGPT's ``bias=False`` drops it).
        dtype: dtype of the output.
        param_dtype: storage dtype of ``scale`` and ``bias``.
    """

    epsilon: float = 1e-5
    use_bias: bool = False
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises the last axis of ``x`` ``[..., D]``."""
        features = (x.shape[-1],)
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            features,
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
        out = centred * jax.lax.rsqrt(variance + self.epsilon) * scale.astype(jnp.float32)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                features,
                self.param_dtype,
            )
            out = out + bias.astype(jnp.float32)
        return out.astype(self.dtype)
