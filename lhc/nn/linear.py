"""Projections: an einsum layer with logically partitioned weights, and token embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

KERNEL_LAYOUTS = ("in_out", "out_in")


def default_kernel_init(
    in_dims: int, rank: int, layout: str = "in_out"
) -> nn.initializers.Initializer:
    """Fan-in scaled normal for a kernel whose first (``in_out``) or last (``out_in``)
    ``in_dims`` axes are inputs.

    A plain normal rather than a truncated one: the truncated sampler's inverse error
    function costs seconds of compile time per parameter on CPU, for no measurable gain.
    """
    inputs, outputs = tuple(range(in_dims)), tuple(range(in_dims, rank))
    if layout == "out_in":
        inputs, outputs = tuple(range(rank - in_dims, rank)), tuple(range(rank - in_dims))
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "normal", in_axis=inputs, out_axis=outputs
    )


def accumulation_dtype(dtype: DTypeLike, out_dtype: DTypeLike) -> Any:
    """The dtype a matmul of ``dtype`` operands accumulates into: float32 for floats
    narrower than it (bf16, f16; the result is then rounded to ``out_dtype``), else
    ``out_dtype``. TPU and GPU matrix units accumulate bf16 products in float32 whatever
    the result dtype; XLA's CPU backend multiplies bf16 operands several times faster
    (AMX / AVX-512 BF16 kernels) when asked for a float32 result than for a bf16 one."""
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
    narrow = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    return jnp.promote_types(out_dtype, jnp.float32) if narrow else out_dtype


def _parse_equation(equation: str) -> tuple[str, str, str]:
    try:
        operands, output = equation.replace(" ", "").split("->")
        lhs, kernel = operands.split(",")
    except ValueError:
        raise ValueError(f"equation must be 'input,kernel->output', got {equation!r}") from None
    return lhs, kernel, output


def kernel_first_einsum(
    equation: str, x: jax.Array, kernel: jax.Array, *, preferred_element_type=None
) -> jax.Array:
    """``jnp.einsum(equation, x, kernel)`` for a kernel stored outputs-first.

    ``kernel`` holds the equation's kernel axes with its output axes first (``"DF"`` is
    stored ``[F, D]``). The matmul is written kernel-first, ``[F, D] . [M, D] -> [F, M]``,
    and the (small) result transposed back: with the kernel's contracted axis minor and
    the result kernel-major, XLA's CPU matmul streams the weight once for a handful of
    rows, which at decoding batch sizes is up to several times faster than ``x @ W``.
    """
    lhs, kernel_spec, output = _parse_equation(equation)
    contracted = [c for c in kernel_spec if c in lhs]
    free = kernel_spec[len(contracted) :]
    stored = free + "".join(contracted)
    kernel_major = free + "".join(c for c in output if c not in free)
    y = jnp.einsum(
        f"{stored},{lhs}->{kernel_major}", kernel, x, preferred_element_type=preferred_element_type
    )
    return jnp.transpose(y, [kernel_major.index(c) for c in output])


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
        kernel_layout: ``"in_out"`` stores the weight as ``shape`` (inputs first, flax's
            convention); ``"out_in"`` stores the output axes first (``nn.Linear``'s
            layout, what Hugging Face checkpoints hold) and multiplies kernel-first
            (``kernel_first_einsum``), the faster form for small-batch decoding on CPU.
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
    kernel_layout: str = "in_out"

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
        if self.kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(
                f"kernel_layout must be one of {KERNEL_LAYOUTS}, got {self.kernel_layout!r}"
            )
        out_in = self.kernel_layout == "out_in"
        # out_in: output axes first, in both the stored and the equation's shape.
        first_out = lambda dims, n_in: tuple(dims[n_in:]) + tuple(dims[:n_in])
        stored_shape = first_out(shape, self.in_dims) if out_in else shape
        stored_axes = tuple(self.logical_axes)
        if out_in:
            stored_axes = first_out(stored_axes, self.in_dims)
        kernel_init = self.kernel_init or default_kernel_init(
            self.in_dims, len(shape), self.kernel_layout
        )
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(kernel_init, stored_axes),
            stored_shape,
            self.param_dtype,
        )
        kernel = kernel.astype(self.dtype)
        x = x.astype(self.dtype)
        out_dtype = self.out_dtype or self.dtype
        accumulate = accumulation_dtype(self.dtype, out_dtype)
        if not out_in:
            if self.equation_shape is not None:
                kernel = kernel.reshape(tuple(self.equation_shape))
            y = jnp.einsum(equation, x, kernel, preferred_element_type=accumulate)
        else:
            if self.equation_shape is not None:
                lhs, kernel_spec, _ = _parse_equation(equation)
                num_in = sum(c in lhs for c in kernel_spec)
                kernel = kernel.reshape(first_out(tuple(self.equation_shape), num_in))
            y = kernel_first_einsum(equation, x, kernel, preferred_element_type=accumulate)
        y = y.astype(out_dtype)
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
        kernel_first_decode: compute the tied projection table-first
            (``kernel_first_einsum``), the faster form for small-batch decoding on CPU.
    """

    vocab_size: int
    embed_dim: int
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    embedding_init: nn.initializers.Initializer | None = None
    kernel_first_decode: bool = False

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
        table = self.embedding.astype(self.dtype)
        if self.kernel_first_decode:  # the table is [V, D]: outputs first already
            return kernel_first_einsum(
                "BTD,DV->BTV", x.astype(self.dtype), table, preferred_element_type=jnp.float32
            )
        return jnp.einsum(
            "BTD,VD->BTV", x.astype(self.dtype), table, preferred_element_type=jnp.float32
        )


def output_logits(
    embed: Embed, x: jax.Array, *, tie: bool, kernel_layout: str = "in_out"
) -> jax.Array:
    """float32 logits ``[B, T, V]`` of ``x`` ``[B, T, D]``: the tied projection
    ``embed.decode``, or an untied ``lm_head`` (``[D, V]``, in ``embed``'s dtypes).

    Called from a module's compact method (the head belongs to that module).
    """
    if tie:
        return embed.decode(x)
    head = Einsum(
        shape=(embed.embed_dim, embed.vocab_size),
        logical_axes=("embed", "vocab"),
        dtype=embed.dtype,
        out_dtype=jnp.float32,
        param_dtype=embed.param_dtype,
        kernel_layout=kernel_layout,
        name="lm_head",
    )
    return head("BTD,DV->BTV", x)


def dense(features: int, axes: tuple[str | None, str | None], name: str, **kwargs: Any) -> nn.Dense:
    """``nn.Dense`` (its initialisation: LeCun normal kernel, zero bias) with the kernel's
    axes named ``axes`` (in, out) and the bias's by the output axis; ``kwargs`` go to
    ``nn.Dense`` (``use_bias``, ``dtype``, ``param_dtype``)."""
    return nn.Dense(
        features,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]),
        name=name,
        **kwargs,
    )
