"""All-pairs distances on a graph: shortest path and resistance, per connected component.

Both take an adjacency of an undirected, unweighted graph: dense ``[N, N]`` (numpy or
jax), a scipy sparse matrix or a ``jax.experimental.sparse.BCOO``; an entry is an edge
when it is nonzero, in either direction (the adjacency is symmetrised), and the diagonal
is ignored. Both return dense ``float32[N, N]`` with 0 between nodes of different
components, as the official range-measure code does, and jit when given a dense array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dense_adjacency(adjacency) -> jax.Array:
    """bool[N, N]: the symmetrised edge set of ``adjacency`` without self-loops."""
    if hasattr(adjacency, "todense") and not isinstance(adjacency, np.ndarray):
        adjacency = adjacency.todense()  # scipy sparse or BCOO
    adjacency = jnp.asarray(adjacency)
    if adjacency.ndim != 2 or adjacency.shape[0] != adjacency.shape[1]:
        raise ValueError(f"adjacency: expected a square [N, N] matrix, got {adjacency.shape}")
    edges = adjacency != 0
    edges = edges | edges.T
    return edges & ~jnp.eye(adjacency.shape[0], dtype=bool)


@jax.jit
def _hops(edges: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Breadth-first search from every node at once: (hops, reachable)."""
    num_nodes = edges.shape[0]
    step_matrix = edges.astype(jnp.float32)
    reached = jnp.eye(num_nodes, dtype=bool)

    def body(carry):
        hops, reached, frontier, step = carry
        new = ((frontier.astype(jnp.float32) @ step_matrix) > 0) & ~reached
        return jnp.where(new, step, hops), reached | new, new, step + 1

    def more(carry):
        return carry[2].any()

    hops = jnp.zeros((num_nodes, num_nodes), jnp.float32)
    hops, reached, _, _ = jax.lax.while_loop(more, body, (hops, reached, reached, 1.0))
    return hops, reached


def connected(adjacency) -> jax.Array:
    """bool[N, N]: whether u and v lie in the same connected component (u ~ u)."""
    return _hops(dense_adjacency(adjacency))[1]


def shortest_path_distances(adjacency) -> jax.Array:
    """float32[N, N]: the number of edges on a shortest u-v path; 0 across components."""
    return _hops(dense_adjacency(adjacency))[0]


@jax.jit
def _resistance(edges: jax.Array) -> jax.Array:
    _, same = _hops(edges)
    weights = edges.astype(jnp.float32)
    laplacian = jnp.diag(weights.sum(1)) - weights
    # L + sum_c 1_c 1_c^T / n_c is invertible (one constant vector per component fills
    # L's null space); its inverse is L^+ + sum_c 1_c 1_c^T / n_c, and the added block
    # cancels in M_uu + M_vv - 2 M_uv within a component.
    component = same.astype(jnp.float32)
    shift = component / component.sum(1, keepdims=True)
    inverse = jnp.linalg.inv(laplacian + shift)
    diagonal = jnp.diag(inverse)
    resistance = diagonal[:, None] + diagonal[None, :] - inverse - inverse.T
    return jnp.where(same, jnp.maximum(resistance, 0.0), 0.0)


def resistance_distances(adjacency) -> jax.Array:
    """float32[N, N]: effective resistance between u and v with unit-resistance edges
    (``L+_uu + L+_vv - 2 L+_uv`` with ``L+`` the Laplacian pseudo-inverse of u's
    component); 0 across components."""
    edges = dense_adjacency(adjacency)
    if edges.shape[0] == 0:
        return jnp.zeros((0, 0), jnp.float32)
    return _resistance(edges)
