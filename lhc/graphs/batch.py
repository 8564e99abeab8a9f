"""Padded graph batches and the message-passing primitives every model uses.

A batch holds ``B`` graphs, each padded to ``N`` nodes and ``E`` directed edges (an
undirected edge is two directed ones). Padding edges point at node 0 and are masked;
padding nodes are masked and never send or receive. Shapes use these letters:
``B`` graphs, ``N`` nodes, ``E`` edges, ``F`` node features, ``G`` edge features.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Graphs:
    """A batch of padded graphs (a pytree, so it passes through ``jax.jit``).

    Attributes:
      nodes: float[B, N, F] node features.
      senders: int32[B, E] source node of each directed edge.
      receivers: int32[B, E] target node of each directed edge.
      node_mask: bool[B, N], False on padding nodes.
      edge_mask: bool[B, E], False on padding edges.
      edges: float[B, E, G] edge features, or None.
    """

    nodes: jax.Array
    senders: jax.Array
    receivers: jax.Array
    node_mask: jax.Array
    edge_mask: jax.Array
    edges: jax.Array | None = None

    @property
    def num_nodes(self) -> int:
        return self.nodes.shape[1]

    def replace_nodes(self, nodes: jax.Array) -> Graphs:
        return self.replace(nodes=nodes)


def from_adjacencies(
    adjacencies: Sequence[np.ndarray],
    features: Sequence[np.ndarray],
    *,
    edge_features: Sequence[np.ndarray] | None = None,
    max_nodes: int | None = None,
    max_edges: int | None = None,
) -> Graphs:
    """A padded batch from dense adjacencies: every nonzero ``A[u, v]`` is an edge u -> v.

    Args:
      adjacencies: per graph ``[n, n]`` (symmetric for an undirected graph).
      features: per graph ``[n, F]`` node features.
      edge_features: per graph ``[n, n, G]``, read at the edges; optional.
      max_nodes, max_edges: padded sizes (default: the largest in the batch).
    """
    if len(adjacencies) != len(features) or not adjacencies:
        raise ValueError(
            f"adjacencies and features: expected the same nonzero number of graphs, got "
            f"{len(adjacencies)} and {len(features)}"
        )
    edge_lists = []
    for index, (adjacency, feature) in enumerate(zip(adjacencies, features)):
        adjacency = np.asarray(adjacency)
        if adjacency.ndim != 2 or adjacency.shape[0] != adjacency.shape[1]:
            raise ValueError(f"adjacencies[{index}]: expected [n, n], got {adjacency.shape}")
        if np.asarray(feature).shape[0] != adjacency.shape[0]:
            raise ValueError(
                f"features[{index}]: expected {adjacency.shape[0]} rows (the graph's nodes), "
                f"got {np.asarray(feature).shape}"
            )
        edge_lists.append(np.nonzero(adjacency))
    n_max = max(len(f) for f in features) if max_nodes is None else int(max_nodes)
    e_max = max(len(s) for s, _ in edge_lists) if max_edges is None else int(max_edges)
    e_max = max(e_max, 1)
    return from_edge_lists(
        [s for s, _ in edge_lists],
        [r for _, r in edge_lists],
        features,
        edge_features=None
        if edge_features is None
        else [np.asarray(ef)[s, r] for ef, (s, r) in zip(edge_features, edge_lists)],
        max_nodes=n_max,
        max_edges=e_max,
    )


def from_edge_lists(
    senders: Sequence[np.ndarray],
    receivers: Sequence[np.ndarray],
    features: Sequence[np.ndarray],
    *,
    edge_features: Sequence[np.ndarray] | None = None,
    max_nodes: int | None = None,
    max_edges: int | None = None,
) -> Graphs:
    """A padded batch from per-graph edge lists (``senders[i][e] -> receivers[i][e]``)."""
    count = len(features)
    if len(senders) != count or len(receivers) != count:
        raise ValueError(
            f"senders, receivers, features: expected one entry per graph, got "
            f"{len(senders)}, {len(receivers)}, {count}"
        )
    n_max = max(len(f) for f in features) if max_nodes is None else int(max_nodes)
    e_max = max(max(len(s) for s in senders), 1) if max_edges is None else int(max_edges)
    width = np.asarray(features[0]).reshape(len(features[0]), -1).shape[1]
    nodes = np.zeros((count, n_max, width), np.float32)
    send = np.zeros((count, e_max), np.int32)
    receive = np.zeros((count, e_max), np.int32)
    node_mask = np.zeros((count, n_max), bool)
    edge_mask = np.zeros((count, e_max), bool)
    edges = None
    if edge_features is not None:
        edge_width = np.asarray(edge_features[0]).reshape(len(edge_features[0]), -1).shape[1]
        edges = np.zeros((count, e_max, edge_width), np.float32)
    for i in range(count):
        feature = np.asarray(features[i], np.float32).reshape(len(features[i]), -1)
        s, r = np.asarray(senders[i]), np.asarray(receivers[i])
        n, e = len(feature), len(s)
        if n > n_max or e > e_max:
            raise ValueError(
                f"graph {i}: {n} nodes and {e} edges exceed max_nodes={n_max}, max_edges={e_max}"
            )
        if len(r) != e or (e and (min(s.min(), r.min()) < 0 or max(s.max(), r.max()) >= n)):
            raise ValueError(
                f"graph {i}: senders and receivers must have equal lengths and index its {n} nodes"
            )
        nodes[i, :n] = feature
        send[i, :e], receive[i, :e] = s, r
        node_mask[i, :n], edge_mask[i, :e] = True, True
        if edges is not None:
            edges[i, :e] = np.asarray(edge_features[i], np.float32).reshape(e, -1)
    return Graphs(
        nodes=jnp.asarray(nodes),
        senders=jnp.asarray(send),
        receivers=jnp.asarray(receive),
        node_mask=jnp.asarray(node_mask),
        edge_mask=jnp.asarray(edge_mask),
        edges=None if edges is None else jnp.asarray(edges),
    )


def gather(values: jax.Array, index: jax.Array) -> jax.Array:
    """``values[b, index[b, e]]``: float[B, N, D], int32[B, E] -> float[B, E, D]."""
    return jnp.take_along_axis(values, index[..., None], axis=1)


def scatter_sum(messages: jax.Array, index: jax.Array, mask: jax.Array, num_nodes: int):
    """Sums masked messages into their nodes: float[B, E, D] -> float[B, N, D]."""
    messages = jnp.where(mask[..., None], messages, 0)
    return jax.vmap(lambda m, i: jax.ops.segment_sum(m, i, num_segments=num_nodes))(messages, index)


def scatter_max(messages: jax.Array, index: jax.Array, mask: jax.Array, num_nodes: int):
    """Masked per-node maximum of messages; nodes that receive none get 0."""
    low = jnp.finfo(messages.dtype).min
    messages = jnp.where(mask[..., None], messages, low)
    out = jax.vmap(lambda m, i: jax.ops.segment_max(m, i, num_segments=num_nodes))(messages, index)
    return jnp.where(out <= low, 0, out)


def in_degrees(graphs: Graphs) -> jax.Array:
    """float32[B, N]: the number of (unmasked) edges into each node."""
    ones = jnp.ones(graphs.receivers.shape + (1,), jnp.float32)
    return scatter_sum(ones, graphs.receivers, graphs.edge_mask, graphs.num_nodes)[..., 0]


def mean_pool(values: jax.Array, node_mask: jax.Array) -> jax.Array:
    """Mean over each graph's real nodes: float[B, N, D] -> float[B, D]."""
    weights = node_mask.astype(values.dtype)[..., None]
    return (values * weights).sum(1) / jnp.maximum(weights.sum(1), 1)
