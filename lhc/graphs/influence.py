"""Influence matrices by Jacobians (node level) and Hessians (graph level), and the range.

For ``f: x[N, C] -> y[N, D]`` (a node-level model or task on one graph, its other
inputs closed over) the node-level influence is ``I_uv = sum_ij |dy_ui / dx_vj|``; for
``f: x[N, C] -> y[K]`` (graph level) it is ``I_uv = sum_kij |d2 y_k / dx_ui dx_vj|``
(Bamberger et al., 2025). The chunked forms build the same matrices a block of rows
(VJPs) or columns (Hessian-vector products) at a time under ``lax.map``, so memory
grows with ``chunk_size * N * C`` instead of the full ``N * D * N * C`` Jacobian or
``K * (N * C)^2`` Hessian; ``chunk_size=None`` takes the full derivative at once.

The range of node u is ``rho_u = sum_v I_uv d(u, v)``, normalised
``sum_v I_uv d(u, v) / sum_v I_uv`` (the expected distance under u's influence, 0 when
u has no influence at all); the graph's range is the mean over its nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _check(x: jax.Array, chunk_size: int | None) -> None:
    if x.ndim != 2:
        raise ValueError(f"x: expected node features [N, C], got shape {x.shape}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size}")


def _blocks(count: int, chunk_size: int, block_fn: Callable[[jax.Array], jax.Array]):
    """``block_fn`` over ``arange(count)`` in blocks of ``chunk_size`` (padded), stacked."""
    blocks = -(-count // chunk_size)
    index = jnp.arange(blocks * chunk_size).reshape(blocks, chunk_size)
    out = jax.lax.map(block_fn, index)
    return out.reshape((blocks * chunk_size,) + out.shape[2:])[:count]


def node_influence(
    fn: Callable[[jax.Array], jax.Array], x: jax.Array, *, chunk_size: int | None = None
) -> jax.Array:
    """float32[N, N]: ``I_uv = sum_ij |d fn(x)_ui / d x_vj|`` (u the output node).

    Args:
      fn: ``x[N, C] -> y[N, D]`` (or ``y[N]``).
      x: float[N, C], the point the Jacobian is taken at.
      chunk_size: output scalars ``(u, i)`` per block of VJPs; None for ``jax.jacrev``.
    """
    _check(x, chunk_size)
    num_nodes = x.shape[0]
    shape = jax.eval_shape(fn, x).shape
    if len(shape) not in (1, 2) or shape[0] != num_nodes:
        raise ValueError(f"fn: expected node outputs [{num_nodes}, D], got shape {shape}")
    outputs = lambda z: fn(z).reshape(num_nodes, -1)  # noqa: E731
    if chunk_size is None:
        jacobian = jax.jacrev(outputs)(x)  # [N, D, N, C]
        return jnp.abs(jacobian).sum((1, 3)).astype(jnp.float32)
    y, vjp = jax.vjp(outputs, x)
    width = y.shape[1]

    def rows(index):  # [c] flat (u, i) -> [c, N]: sum_j |dy_ui / dx_vj|
        cotangents = jax.nn.one_hot(index, num_nodes * width, dtype=y.dtype)
        grads = jax.vmap(lambda t: vjp(t.reshape(y.shape))[0])(cotangents)
        return jnp.abs(grads).sum(-1)

    flat = _blocks(num_nodes * width, int(chunk_size), rows)  # [N * D, N]
    return flat.reshape(num_nodes, width, num_nodes).sum(1).astype(jnp.float32)


def graph_influence(
    fn: Callable[[jax.Array], jax.Array], x: jax.Array, *, chunk_size: int | None = None
) -> jax.Array:
    """float32[N, N]: ``I_uv = sum_kij |d2 fn(x)_k / dx_ui dx_vj|``.

    Args:
      fn: ``x[N, C] -> y[K]`` (or a scalar), e.g. a graph-level model's pooled output.
      x: float[N, C].
      chunk_size: input directions ``(v, j)`` per block of Hessian-vector products
        (forward over reverse); None for ``jax.hessian``.
    """
    _check(x, chunk_size)
    num_nodes, channels = x.shape
    outputs = lambda z: jnp.atleast_1d(fn(z))  # noqa: E731
    if jax.eval_shape(outputs, x).ndim != 1:
        raise ValueError(
            f"fn: expected graph outputs [K] or a scalar, got {jax.eval_shape(fn, x).shape}"
        )
    if chunk_size is None:
        hessian = jax.hessian(outputs)(x)  # [K, N, C, N, C]
        return jnp.abs(hessian).sum((0, 2, 4)).astype(jnp.float32)
    jacobian = jax.jacrev(outputs)  # z -> [K, N, C]

    def columns(index):  # [c] flat (v, j) -> [c, N]: sum_ki |d2 y_k / dx_ui dx_vj|
        tangents = jax.nn.one_hot(index, num_nodes * channels, dtype=x.dtype)
        hvp = lambda t: jax.jvp(jacobian, (x,), (t.reshape(x.shape),))[1]  # noqa: E731
        return jnp.abs(jax.vmap(hvp)(tangents)).sum((1, 3))

    flat = _blocks(num_nodes * channels, int(chunk_size), columns)  # [N * C, N] (v, j; u)
    return flat.reshape(num_nodes, channels, num_nodes).sum(1).T.astype(jnp.float32)


def node_ranges(
    influence: jax.Array,
    distances: jax.Array,
    *,
    normalized: bool,
    node_mask: jax.Array | None = None,
) -> jax.Array:
    """float32[N]: ``rho_u`` per node (0 on masked nodes)."""
    influence = jnp.asarray(influence, jnp.float32)
    distances = jnp.asarray(distances, jnp.float32)
    if influence.ndim != 2 or influence.shape != distances.shape:
        raise ValueError(
            f"influence and distances: expected the same [N, N] shape, got "
            f"{influence.shape} and {distances.shape}"
        )
    if node_mask is not None:
        mask = jnp.asarray(node_mask, bool)
        influence = jnp.where(mask[:, None] & mask[None, :], influence, 0.0)
    rho = (influence * distances).sum(1)
    if normalized:
        total = influence.sum(1)
        rho = jnp.where(total > 0, rho / jnp.where(total > 0, total, 1.0), 0.0)
    return rho


def range_measure(
    influence: jax.Array,
    distances: jax.Array,
    *,
    normalized: bool,
    node_mask: jax.Array | None = None,
) -> float:
    """The graph's range: the mean over its (unmasked) nodes u of ``rho_u``.

    Args:
      influence: float[N, N], ``I_uv`` with u the receiving (output) node.
      distances: float[N, N], e.g. ``shortest_path_distances`` or
        ``resistance_distances``.
      normalized: divide each ``rho_u`` by ``sum_v I_uv``.
      node_mask: bool[N], the real nodes of a padded graph (default: all).

    Returns:
      The range as a Python float (0.0 for a graph without nodes). Use ``node_ranges``
      inside ``jax.jit``.
    """
    rho = node_ranges(influence, distances, normalized=normalized, node_mask=node_mask)
    count = rho.shape[0] if node_mask is None else int(jnp.asarray(node_mask).sum())
    return float(rho.sum() / count) if count else 0.0
