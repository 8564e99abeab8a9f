"""Projections: an einsum layer with logically partitioned weights, and token embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def default_kernel_init(in_dims: int, rank: int) -> nn.initializers.Initializer:
    """Fan-in scaled normal for a kernel whose first ``in_dims`` axes are inputs.

    A plain normal rather than a truncated one: the truncated sampler's inverse error
    function costs seconds of compile time per parameter on CPU, for no measurable gain.
    """
    return nn.initializers.variance_scaling(
        1.0,
        "fan_in",
        "normal",
        in_axis=tuple(range(in_dims)),
        out_axis=tuple(range(in_dims, rank)),
    )


class Einsum(nn.Module):
    """A weight of a given shape applied with an explicit einsum equation.

    The equation names every axis (``"BTD,DNH->BTNH"``), which keeps multi-head
    projections free of reshapes and lets each weight axis carry its own logical name.

    Attributes:
        shape: weight shape, e.g. ``(D, N, H)``.
        logical_axes: one logical name per weight axis, e.g. ``("embed", "heads", "kv")``.
        in_dims: how many leading weight axes are contracted with the input (fan-in of
            the initializer); the remaining axes are outputs.
        use_bias: add a bias over the output axes ``shape[in_dims:]``.
        dtype: compute dtype (inputs and weight are cast to it).
        out_dtype: dtype the einsum accumulates into and returns (``dtype`` by default);
            float32 for logits, so they are never rounded to bf16.
        param_dtype: storage dtype of the weight and bias.
        kernel_init: weight initializer; fan-in scaled normal by default.
        bias_init: bias initializer.
        equation_shape: the weight's shape as the equation sees it, a reshape of
            ``shape`` (e.g. ``(N * H, D)`` for ``(N, H, D)``). Contracting one merged
            axis instead of two keeps XLA from transposing the weight to match the
            input's layout (it would otherwise copy the whole weight on every call).
    """

    shape: Sequence[int]
    logical_axes: Sequence[str | None]
    in_dims: int = 1
    use_bias: bool = False
    dtype: DTypeLike = jnp.float32
    out_dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    kernel_init: nn.initializers.Initializer | None = None
    bias_init: nn.initializers.Initializer = nn.initializers.zeros
    equation_shape: Sequence[int] | None = None

    @nn.compact
    def __call__(self, equation: str, x: jax.Array) -> jax.Array:
        """Applies ``jnp.einsum(equation, x, kernel) (+ bias)``.

        Args:
            equation: two-operand einsum, input first, e.g. ``"BTD,DNH->BTNH"``.
            x: input whose shape matches the first operand of ``equation``.

        Returns:
            The einsum result in ``out_dtype`` (default ``dtype``).
        """
        shape = tuple(self.shape)
        if len(self.logical_axes) != len(shape):
            raise ValueError(f"{self.logical_axes=} must name every axis of {shape=}")
        if not 0 < self.in_dims <= len(shape):
            raise ValueError(f"{self.in_dims=} must be in [1, {len(shape)}] for {shape=}")
        kernel_init = self.kernel_init or default_kernel_init(self.in_dims, len(shape))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(kernel_init, tuple(self.logical_axes)),
            shape,
            self.param_dtype,
        )
        kernel = kernel.astype(self.dtype)
        if self.equation_shape is not None:
            kernel = kernel.reshape(tuple(self.equation_shape))
        y = jnp.einsum(
            equation, x.astype(self.dtype), kernel, preferred_element_type=self.out_dtype
        )
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(
                    self.bias_init, tuple(self.logical_axes[self.in_dims :])
                ),
                shape[self.in_dims :],
                self.param_dtype,
            )
            y = y + bias.astype(y.dtype)
        return y


class Embed(nn.Module):
    """Token embedding table, usable both ways (lookup and tied output projection).

    Attributes:
        vocab_size: V.
        embed_dim: D.
        dtype: compute dtype of looked-up embeddings.
        param_dtype: storage dtype of the table.
        embedding_init: table initializer; std ``1/sqrt(D)`` keeps tied logits O(1).
    """

    vocab_size: int
    embed_dim: int
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    embedding_init: nn.initializers.Initializer | None = None

    def setup(self):
        init = self.embedding_init or nn.initializers.normal(stddev=self.embed_dim**-0.5)
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(init, ("vocab", "embed")),
            (self.vocab_size, self.embed_dim),
            self.param_dtype,
        )

    def encode(self, tokens: jax.Array) -> jax.Array:
        """Looks up ``tokens`` (int ``[...]``) and returns ``[..., D]`` in ``dtype``."""
        return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        """Tied output projection: float32 logits ``[B, T, V]`` from ``x`` ``[B, T, D]``."""
        return jnp.einsum(
            "BTD,VD->BTV",
            x.astype(self.dtype),
            self.embedding.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
