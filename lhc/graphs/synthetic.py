"""Synthetic graph tasks with a known range, and the graphs they are posed on.

A task is ``y_v = sum_u M_uv phi(x_u, x_v)`` (the official code's convention: the
operator's first index is the source) with node features ``x ~ N(0, 1)``; the graph
label is the mean of the node labels. Operators ``M``:

- ``power``: ``(D^-1/2 (A + I) D^-1/2)^k``, degrees counted with the self-loop;
- ``hop``: the indicator of ``spd(u, v) = k``, each row divided by its sum;
- ``nbhd``: the indicator of ``spd(u, v) <= k`` within u's component, row-normalised
  (the official code also counts nodes of other components, whose spd it stores as 0).

Interactions ``phi``: ``copy`` (``x_u``, node level, the label has x's width),
``l2`` (``||x_u - x_v||^2``, scalar, for graph level: its Hessian is nonzero) and
``cosine`` (cosine similarity, scalar; needs at least two feature channels, for with
one it is ``sign(x_u) sign(x_v)`` and has zero gradient).

The task's ground-truth range is the range measure of its own Jacobian (node level) or
Hessian (graph level): ``task_influence``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lhc.graphs.distances import connected, dense_adjacency, shortest_path_distances
from lhc.graphs.influence import graph_influence, node_influence

OPERATORS = ("power", "hop", "nbhd")
INTERACTIONS = ("copy", "l2", "cosine")


# Graphs: dense float32 adjacencies of undirected graphs.


def grid_graph(rows: int, cols: int) -> np.ndarray:
    """The ``rows x cols`` 4-neighbour grid; node ``r * cols + c``."""
    index = np.arange(rows * cols).reshape(rows, cols)
    adjacency = np.zeros((rows * cols, rows * cols), np.float32)
    for a, b in ((index[:, :-1], index[:, 1:]), (index[:-1, :], index[1:, :])):
        adjacency[a.ravel(), b.ravel()] = adjacency[b.ravel(), a.ravel()] = 1
    return adjacency


def path_graph(num_nodes: int) -> np.ndarray:
    return grid_graph(1, num_nodes)


def erdos_renyi_graph(num_nodes: int, p: float, rng: np.random.Generator) -> np.ndarray:
    upper = np.triu(rng.random((num_nodes, num_nodes)) < p, 1)
    return (upper | upper.T).astype(np.float32)


def sbm_graph(sizes, p_in: float, p_out: float, rng: np.random.Generator) -> np.ndarray:
    """Stochastic block model: blocks of ``sizes``, edge probability ``p_in`` within a
    block and ``p_out`` across."""
    block = np.repeat(np.arange(len(sizes)), sizes)
    p = np.where(block[:, None] == block[None, :], p_in, p_out)
    upper = np.triu(rng.random(p.shape) < p, 1)
    return (upper | upper.T).astype(np.float32)


def barabasi_albert_graph(num_nodes: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """Preferential attachment: each new node links to ``m`` distinct earlier nodes
    drawn with probability proportional to their degree (the first ``m + 1`` nodes
    start as a clique)."""
    if not 1 <= m < num_nodes:
        raise ValueError(f"m: expected 1 <= m < num_nodes={num_nodes}, got {m}")
    adjacency = np.zeros((num_nodes, num_nodes), np.float32)
    adjacency[: m + 1, : m + 1] = 1 - np.eye(m + 1)
    for node in range(m + 1, num_nodes):
        degree = adjacency[:node, :node].sum(1)
        targets = rng.choice(node, m, replace=False, p=degree / degree.sum())
        adjacency[node, targets] = adjacency[targets, node] = 1
    return adjacency


# Operators and interactions.


def operator(adjacency, kind: str, k: int) -> jax.Array:
    """float32[N, N]: the task operator ``M`` (see the module docstring)."""
    if kind not in OPERATORS:
        raise ValueError(f"kind: expected one of {OPERATORS}, got {kind!r}")
    if int(k) < 0:
        raise ValueError(f"k: expected a non-negative integer, got {k}")
    edges = dense_adjacency(adjacency)
    if kind == "power":
        with_loops = edges.astype(jnp.float32) + jnp.eye(edges.shape[0])
        scale = jax.lax.rsqrt(with_loops.sum(1))
        return jnp.linalg.matrix_power(scale[:, None] * with_loops * scale[None, :], int(k))
    spd = shortest_path_distances(edges)
    if kind == "hop":
        chosen = (spd == k) & connected(edges)
    else:
        chosen = (spd <= k) & connected(edges)
    chosen = chosen.astype(jnp.float32)
    total = chosen.sum(1, keepdims=True)
    return chosen / jnp.where(total > 0, total, 1.0)


def interaction(name: str, x: jax.Array) -> jax.Array:
    """``phi(x_u, x_v)`` for all pairs: float[N, N, D] (D = C for copy, else 1)."""
    if name == "copy":
        return jnp.broadcast_to(x[:, None, :], (x.shape[0],) + x.shape)
    if name == "l2":
        return ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1, keepdims=True)
    if name == "cosine":
        if x.shape[1] < 2:
            raise ValueError(
                "interaction 'cosine': expected at least 2 feature channels (with one, "
                "it is sign(x_u) sign(x_v), whose gradient is zero)"
            )
        unit = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return (unit @ unit.T)[..., None]
    raise ValueError(f"interaction: expected one of {INTERACTIONS}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """``y_v = sum_u M_uv phi(x_u, x_v)`` on one graph.

    Attributes:
      operator: ``M``, float[N, N] (from ``operator``).
      interaction: a name in ``INTERACTIONS``.
      graph_level: the label is the mean of the node labels.
    """

    operator: jax.Array
    interaction: str = "copy"
    graph_level: bool = False

    def __call__(self, x: jax.Array) -> jax.Array:
        """float[N, C] -> float[N, D] (node level) or float[D] (graph level)."""
        labels = jnp.einsum("uv,uvd->vd", self.operator, interaction(self.interaction, x))
        return labels.mean(0) if self.graph_level else labels


def task_influence(task: SyntheticTask, x: jax.Array, *, chunk_size: int | None = None):
    """The task's own influence matrix at ``x``: Jacobian (node level) or Hessian."""
    influence = graph_influence if task.graph_level else node_influence
    return influence(task, x, chunk_size=chunk_size)
