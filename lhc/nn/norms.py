"""Normalisation layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-feature scale.

    ``y = x / sqrt(mean(x**2) + epsilon) * scale``. The statistics and the scaling run in
    float32 whatever the compute dtype, because a bf16 mean of squares loses the small
    features that the normalisation is meant to preserve.

    Attributes:
        epsilon: added to the mean square before the square root.
        dtype: dtype of the output.
        param_dtype: storage dtype of ``scale``.
        scale_init: initializer of ``scale`` (ones, so the layer starts as plain RMS
            normalisation).
    """

    epsilon: float = 1e-6
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    scale_init: nn.initializers.Initializer = nn.initializers.ones

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises the last axis.

        Args:
            x: ``[..., D]``.

        Returns:
            ``[..., D]`` in ``dtype``.
        """
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(self.scale_init, ("norm",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_square + self.epsilon)
        return (normed * scale.astype(jnp.float32)).astype(self.dtype)
