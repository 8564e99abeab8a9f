"""Long Range Graph Benchmark (LRGB) splits the user already has, as padded ``Graphs``.

Nothing is downloaded. ``load_voc_superpixels`` reads an official PascalVOC-SP split
pickle with numpy alone: its torch tensors come back as numpy arrays, and a global the
file names that is not part of a tensor or an array is refused rather than run, so a
file cannot execute code when read. ``save_npz_graphs`` writes any list of graphs to one
``.npz`` that ``load_npz_graphs`` reads back without pickles, so a split is converted
once::

    records = load_voc_superpixels("voc_superpixels_edge_wt_region_boundary/train.pickle")
    save_npz_graphs("voc_train.npz", records)
    graphs = to_graphs(load_npz_graphs("voc_train.npz")[:32])

The ``.npz`` layout (graph ``i`` is rows ``offsets[i]:offsets[i + 1]``; node indices
are local to their graph):

- ``nodes``: float32[total_nodes, F]; ``node_offsets``: int64[num_graphs + 1].
- ``senders``, ``receivers``: int32[total_edges]; ``edge_offsets``: int64[num_graphs + 1].
- ``edges``: float32[total_edges, G], only when the graphs have edge features.
- ``labels`` [total_labels, ...] and ``label_offsets`` int64[num_graphs + 1], only when
  the graphs have labels (per node, as VOC's, or per graph).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lhc.graphs.batch import Graphs, from_edge_lists
from lhc.graphs.tensor_pickle import load_tensor_pickle

_REQUIRED_KEYS = ("nodes", "node_offsets", "senders", "receivers", "edge_offsets")


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    """One graph as numpy arrays.

    Attributes:
      nodes: float32[n, F] node features.
      senders, receivers: int32[e], edge ``senders[k] -> receivers[k]``.
      edges: float32[e, G] edge features, or None.
      labels: targets (``[n]`` per node, or per graph), or None.
    """

    nodes: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    edges: np.ndarray | None = None
    labels: np.ndarray | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_edges(self) -> int:
        return len(self.senders)


def _voc_record(index: int, graph: Any) -> GraphRecord:
    if not isinstance(graph, tuple | list) or len(graph) != 4:
        got = f"{len(graph)} elements" if isinstance(graph, tuple | list) else type(graph).__name__
        raise ValueError(
            f"graph {index}: expected a tuple (x, edge_attr, edge_index, y) of 4 elements, "
            f"got {got}"
        )
    nodes, edges, edge_index, labels = (np.asarray(part) for part in graph)
    if nodes.ndim != 2:
        raise ValueError(f"graph {index}: expected x of shape [n, F], got {nodes.shape}")
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"graph {index}: expected edge_index of shape [2, e], got {edge_index.shape}"
        )
    num_nodes, num_edges = nodes.shape[0], edge_index.shape[1]
    if edges.ndim == 1:
        edges = edges[:, None]
    if edges.ndim != 2 or edges.shape[0] != num_edges:
        raise ValueError(
            f"graph {index}: expected edge_attr of shape [{num_edges}, G] (one row per "
            f"column of edge_index), got {edges.shape}"
        )
    if labels.shape != (num_nodes,):
        raise ValueError(
            f"graph {index}: expected y of shape [{num_nodes}] (one label per node), "
            f"got {labels.shape}"
        )
    if not np.issubdtype(edge_index.dtype, np.integer):
        raise ValueError(f"graph {index}: expected integer edge_index, got {edge_index.dtype}")
    if num_edges and (edge_index.min() < 0 or edge_index.max() >= num_nodes):
        raise ValueError(
            f"graph {index}: expected edge_index in [0, {num_nodes}), got values in "
            f"[{edge_index.min()}, {edge_index.max()}]"
        )
    return GraphRecord(
        nodes=nodes.astype(np.float32),
        senders=edge_index[0].astype(np.int32),
        receivers=edge_index[1].astype(np.int32),
        edges=edges.astype(np.float32),
        labels=labels,
    )


def load_voc_superpixels(path: str | os.PathLike) -> list[GraphRecord]:
    """Reads a PascalVOC-SP split pickle of LRGB (e.g. ``.../train.pickle``).

    The file is a pickled list of ``(x [n, 14], edge_attr [e, 2], edge_index [2, e],
    y [n])`` per graph, torch tensors in the official files (numpy arrays also do);
    ``edge_index[0]`` are the senders, as in PyG. Torch is not needed: tensors are
    rebuilt with numpy, and a file naming any other global (a function to call, a
    class to build) is refused before anything of it runs.

    Returns:
      One ``GraphRecord`` per graph, node labels as ``labels``.

    Raises:
      ValueError: a global other than a tensor's or an array's (the message names it),
        a tensor that does not fit its storage, or a malformed graph (the message
        names its index).
    """
    with open(path, "rb") as file:
        graphs = load_tensor_pickle(file, os.fspath(path))
    if not isinstance(graphs, list | tuple):
        raise ValueError(
            f"{os.fspath(path)}: expected a list of graphs, got {type(graphs).__name__}"
        )
    return [_voc_record(index, graph) for index, graph in enumerate(graphs)]


def _all_or_none(records: Sequence[GraphRecord], field: str) -> bool:
    present = [getattr(record, field) is not None for record in records]
    if any(present) and not all(present):
        raise ValueError(
            f"{field}: expected every graph or none to have it, graph "
            f"{present.index(not present[0])} differs from graph 0"
        )
    return present[0]


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def save_npz_graphs(path: str | os.PathLike, records: Sequence[GraphRecord]) -> None:
    """Writes graphs to one ``.npz`` in the layout of this module's docstring."""
    if not records:
        raise ValueError("save_npz_graphs: expected at least one graph, got none")
    arrays = dict(
        nodes=np.concatenate([np.asarray(r.nodes, np.float32) for r in records]),
        node_offsets=_offsets([r.num_nodes for r in records]),
        senders=np.concatenate([np.asarray(r.senders, np.int32) for r in records]),
        receivers=np.concatenate([np.asarray(r.receivers, np.int32) for r in records]),
        edge_offsets=_offsets([r.num_edges for r in records]),
    )
    if _all_or_none(records, "edges"):
        arrays["edges"] = np.concatenate([np.asarray(r.edges, np.float32) for r in records])
    if _all_or_none(records, "labels"):
        labels = [np.asarray(r.labels) for r in records]
        # A graph-level label is a scalar; store it as one row.
        labels = [label.reshape(1) if label.ndim == 0 else label for label in labels]
        arrays["labels"] = np.concatenate(labels)
        arrays["label_offsets"] = _offsets([len(label) for label in labels])
    np.savez(path, **arrays)


def _check_offsets(name: str, offsets: np.ndarray, total: int, count: int) -> None:
    if offsets.shape != (count + 1,) or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"{name}: expected {count + 1} offsets from 0 to {total}, got shape "
            f"{offsets.shape} from {offsets[:1]} to {offsets[-1:]}"
        )
    if np.any(np.diff(offsets) < 0):
        raise ValueError(f"{name}: expected nondecreasing offsets")


def load_npz_graphs(path: str | os.PathLike) -> list[GraphRecord]:
    """Reads graphs written by ``save_npz_graphs`` (numpy only, no pickles)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    for key in _REQUIRED_KEYS:
        if key not in arrays:
            raise ValueError(f"{os.fspath(path)}: missing key {key!r} (has {sorted(arrays)})")
    if ("labels" in arrays) != ("label_offsets" in arrays):
        missing = "labels" if "label_offsets" in arrays else "label_offsets"
        raise ValueError(f"{os.fspath(path)}: missing key {missing!r} (labels need both)")
    node_offsets, edge_offsets = arrays["node_offsets"], arrays["edge_offsets"]
    count = len(node_offsets) - 1
    _check_offsets("node_offsets", node_offsets, len(arrays["nodes"]), count)
    _check_offsets("edge_offsets", edge_offsets, len(arrays["senders"]), count)
    if len(arrays["receivers"]) != len(arrays["senders"]):
        raise ValueError(
            f"receivers: expected {len(arrays['senders'])} entries (as senders), got "
            f"{len(arrays['receivers'])}"
        )
    if "edges" in arrays and len(arrays["edges"]) != len(arrays["senders"]):
        raise ValueError(
            f"edges: expected {len(arrays['senders'])} rows (one per edge), got "
            f"{len(arrays['edges'])}"
        )
    if "labels" in arrays:
        _check_offsets("label_offsets", arrays["label_offsets"], len(arrays["labels"]), count)

    records = []
    for index in range(count):
        nodes = slice(node_offsets[index], node_offsets[index + 1])
        edges = slice(edge_offsets[index], edge_offsets[index + 1])
        senders, receivers = arrays["senders"][edges], arrays["receivers"][edges]
        num_nodes = nodes.stop - nodes.start
        if len(senders) and (
            min(senders.min(), receivers.min()) < 0
            or max(senders.max(), receivers.max()) >= num_nodes
        ):
            raise ValueError(f"graph {index}: expected edge endpoints in [0, {num_nodes})")
        labels = None
        if "labels" in arrays:
            offsets = arrays["label_offsets"]
            labels = arrays["labels"][offsets[index] : offsets[index + 1]]
        records.append(
            GraphRecord(
                nodes=arrays["nodes"][nodes],
                senders=senders,
                receivers=receivers,
                edges=arrays["edges"][edges] if "edges" in arrays else None,
                labels=labels,
            )
        )
    return records


def to_graphs(
    records: Sequence[GraphRecord], max_nodes: int | None = None, max_edges: int | None = None
) -> Graphs:
    """A padded batch of the records (sizes default to the largest graph's)."""
    if not records:
        raise ValueError("to_graphs: expected at least one graph, got none")
    with_edges = _all_or_none(records, "edges")
    return from_edge_lists(
        [r.senders for r in records],
        [r.receivers for r in records],
        [r.nodes for r in records],
        edge_features=[r.edges for r in records] if with_edges else None,
        max_nodes=max_nodes,
        max_edges=max_edges,
    )


def pad_node_labels(
    records: Sequence[GraphRecord], max_nodes: int | None = None, fill_value: int = -1
) -> np.ndarray:
    """Per-node labels int32[B, N] matching ``to_graphs``, ``fill_value`` on padding."""
    width = max(r.num_nodes for r in records) if max_nodes is None else int(max_nodes)
    padded = np.full((len(records), width), fill_value, np.int32)
    for index, record in enumerate(records):
        if record.num_nodes > width:
            raise ValueError(f"graph {index}: {record.num_nodes} nodes exceed max_nodes={width}")
        if record.labels is None or np.shape(record.labels) != (record.num_nodes,):
            raise ValueError(
                f"graph {index}: expected {record.num_nodes} node labels, got "
                f"{None if record.labels is None else np.shape(record.labels)}"
            )
        padded[index, : record.num_nodes] = record.labels
    return padded
