"""LRGB loaders on small files written here: VOC pickles of numpy arrays and of torch
tensors, the ``.npz`` round trip, padding into ``Graphs``, and malformed inputs."""

import pickle
import re

import numpy as np
import pytest

from lhc.graphs.lrgb import (
    GraphRecord,
    load_npz_graphs,
    load_voc_superpixels,
    pad_node_labels,
    save_npz_graphs,
    to_graphs,
)


def _voc_graphs(seed=0, sizes=((5, 8), (3, 4), (7, 12))):
    """VOC-like graphs ``(x [n, 14], edge_attr [e, 2], edge_index [2, e], y [n])``."""
    rng = np.random.default_rng(seed)
    graphs = []
    for nodes, edges in sizes:
        graphs.append(
            (
                rng.standard_normal((nodes, 14)).astype(np.float32),
                rng.standard_normal((edges, 2)).astype(np.float32),
                rng.integers(0, nodes, (2, edges)).astype(np.int64),
                rng.integers(0, 21, nodes).astype(np.int64),
            )
        )
    return graphs


def _write_pickle(path, graphs):
    with open(path, "wb") as file:
        pickle.dump(graphs, file)
    return path


def _assert_records_match(records, graphs):
    assert len(records) == len(graphs)
    for record, (x, edge_attr, edge_index, y) in zip(records, graphs, strict=True):
        np.testing.assert_array_equal(record.nodes, np.asarray(x))
        np.testing.assert_array_equal(record.edges, np.asarray(edge_attr))
        np.testing.assert_array_equal(record.senders, np.asarray(edge_index)[0])
        np.testing.assert_array_equal(record.receivers, np.asarray(edge_index)[1])
        np.testing.assert_array_equal(record.labels, np.asarray(y))
        assert record.nodes.dtype == np.float32 and record.senders.dtype == np.int32


def test_voc_pickle_of_numpy_arrays_round_trips_through_npz(tmp_path):
    graphs = _voc_graphs()
    records = load_voc_superpixels(_write_pickle(tmp_path / "train.pickle", graphs))
    _assert_records_match(records, graphs)

    save_npz_graphs(tmp_path / "train.npz", records)
    with np.load(tmp_path / "train.npz") as data:
        assert data["node_offsets"].tolist() == [0, 5, 8, 15]
        assert data["edge_offsets"].tolist() == [0, 8, 12, 24]
        assert data["nodes"].shape == (15, 14) and data["edges"].shape == (24, 2)
    _assert_records_match(load_npz_graphs(tmp_path / "train.npz"), graphs)


def test_voc_pickle_of_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    graphs = _voc_graphs(seed=1)
    tensors = [tuple(torch.from_numpy(part) for part in graph) for graph in graphs]
    records = load_voc_superpixels(_write_pickle(tmp_path / "val.pickle", tensors))
    _assert_records_match(records, graphs)


def test_torch_pickle_without_torch_says_torch_is_needed(tmp_path, monkeypatch):
    path = _write_pickle(tmp_path / "test.pickle", _voc_graphs())
    real_find_class = pickle.Unpickler.find_class

    class NoTorchUnpickler(pickle.Unpickler):
        """What unpickling a torch tensor does where torch is not installed."""

        def find_class(self, module, name):
            if module == "numpy" or module.startswith("numpy."):
                raise ModuleNotFoundError("No module named 'torch'", name="torch")
            return real_find_class(self, module, name)

    monkeypatch.setattr(pickle, "load", lambda file: NoTorchUnpickler(file).load())
    with pytest.raises(ModuleNotFoundError, match="torch is needed to read it"):
        load_voc_superpixels(path)


def test_to_graphs_pads_records():
    graphs = _voc_graphs()
    records = [GraphRecord(*r) for r in _records_from(graphs)]
    batch = to_graphs(records, max_nodes=8, max_edges=16)
    assert batch.nodes.shape == (3, 8, 14) and batch.edges.shape == (3, 16, 2)
    assert np.asarray(batch.node_mask).sum(1).tolist() == [5, 3, 7]
    assert np.asarray(batch.edge_mask).sum(1).tolist() == [8, 4, 12]
    x, edge_attr, edge_index, _ = graphs[2]
    np.testing.assert_array_equal(np.asarray(batch.nodes)[2, :7], x)
    np.testing.assert_array_equal(np.asarray(batch.edges)[2, :12], edge_attr)
    np.testing.assert_array_equal(np.asarray(batch.senders)[2, :12], edge_index[0])
    np.testing.assert_array_equal(np.asarray(batch.receivers)[2, :12], edge_index[1])

    labels = pad_node_labels(records, max_nodes=8)
    assert labels.shape == (3, 8)
    np.testing.assert_array_equal(labels[1, :3], graphs[1][3])
    assert (labels[1, 3:] == -1).all()


def _records_from(graphs):
    for x, edge_attr, edge_index, y in graphs:
        yield x, edge_index[0].astype(np.int32), edge_index[1].astype(np.int32), edge_attr, y


# (graph, element of its tuple replaced, replacement, the error): None drops y.
_MALFORMED = {
    "three elements": (1, None, None, "graph 1: expected a tuple .* of 4 elements, got 3"),
    "edge_index rows": (
        2, 2, np.zeros((3, 12), np.int64),
        r"graph 2: expected edge_index of shape \[2, e\], got \(3, 12\)",
    ),
    "edge_attr rows": (
        1, 1, np.zeros((5, 2), np.float32),
        r"graph 1: expected edge_attr of shape \[4, G\].*got \(5, 2\)",
    ),
    "labels": (0, 3, np.zeros(4, np.int64), r"graph 0: expected y of shape \[5\].*got \(4,\)"),
    "index too big": (
        1, 2, np.array([[0, 1, 2, 3]] * 2),
        r"graph 1: expected edge_index in \[0, 3\), got values in \[0, 3\]",
    ),
    "negative index": (
        2, 2, -np.ones((2, 12), np.int64), r"graph 2: expected edge_index in \[0, 7\)"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_voc_graphs_name_the_graph(tmp_path, case):
    index, part, value, message = _MALFORMED[case]
    graphs = _voc_graphs()
    graph = list(graphs[index])
    if part is None:
        graph.pop()
    else:
        graph[part] = value
    graphs[index] = tuple(graph)
    with pytest.raises(ValueError, match=message):
        load_voc_superpixels(_write_pickle(tmp_path / "bad.pickle", graphs))


def test_npz_missing_key_is_named(tmp_path):
    records = load_voc_superpixels(_write_pickle(tmp_path / "train.pickle", _voc_graphs()))
    save_npz_graphs(tmp_path / "good.npz", records)
    with np.load(tmp_path / "good.npz") as data:
        arrays = {key: data[key] for key in data.files}
    for key in ("receivers", "edge_offsets", "label_offsets"):
        partial = {k: v for k, v in arrays.items() if k != key}
        np.savez(tmp_path / "bad.npz", **partial)
        with pytest.raises(ValueError, match=re.escape(f"missing key '{key}'")):
            load_npz_graphs(tmp_path / "bad.npz")

    arrays["senders"] = arrays["senders"].copy()
    arrays["senders"][8] = 3  # the first edge of graph 1, which has 3 nodes
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"graph 1: expected edge endpoints in \[0, 3\)"):
        load_npz_graphs(tmp_path / "bad.npz")
    arrays["node_offsets"] = np.array([0, 5, 8, 16])
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"node_offsets: expected 4 offsets from 0 to 15"):
        load_npz_graphs(tmp_path / "bad.npz")


def test_npz_without_edges_or_labels_round_trips(tmp_path):
    records = [
        GraphRecord(np.ones((3, 2), np.float32), np.array([0, 1]), np.array([1, 2])),
        GraphRecord(np.zeros((2, 2), np.float32), np.zeros(0, int), np.zeros(0, int)),
    ]
    save_npz_graphs(tmp_path / "plain.npz", records)
    loaded = load_npz_graphs(tmp_path / "plain.npz")
    assert [r.edges for r in loaded] == [None, None] and [r.labels for r in loaded] == [None, None]
    np.testing.assert_array_equal(loaded[0].receivers, [1, 2])
    assert loaded[1].num_edges == 0 and loaded[1].num_nodes == 2
    assert to_graphs(loaded).edges is None

    mixed = [
        records[0],
        GraphRecord(
            records[1].nodes, records[1].senders, records[1].senders, edges=np.zeros((0, 1))
        ),
    ]
    with pytest.raises(ValueError, match="edges: expected every graph or none"):
        save_npz_graphs(tmp_path / "mixed.npz", mixed)
