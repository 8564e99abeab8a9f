"""LRGB loaders on small files written here: VOC pickles of numpy arrays and of torch
tensors (read without torch), pickles that would run code, the ``.npz`` round trip,
padding into ``Graphs``, and malformed inputs."""

import collections
import io
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_voc_pickle_of_numpy_arrays_at_each_protocol(tmp_path, protocol):
    graphs = _voc_graphs(seed=3, sizes=((4, 0), (3, 2)))  # no edges: empty arrays
    path = tmp_path / "train.pickle"
    with open(path, "wb") as file:
        pickle.dump(graphs, file, protocol=protocol)
    _assert_records_match(load_voc_superpixels(path), graphs)


class _Reduces:
    """Pickles as ``function(*args)``, the way torch pickles tensors and storages."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _saved(torch, value, zip_format):
    """What ``torch.save`` writes for ``value``, in its zip or its legacy format."""
    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=zip_format)
    return buffer.getvalue()


def _tensor_over(torch, storage_bytes, offset=0, size=(1,), stride=(1,)):
    """Pickles as a tensor whose storage pickles as ``storage_bytes`` (as torch does)."""
    storage = _Reduces(torch.storage._load_from_bytes, storage_bytes)
    hooks = collections.OrderedDict()
    return _Reduces(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False, hooks)


def _strided_tensors(torch, graph, zip_storage=False):
    """The graph's arrays as torch tensors that are views: transposed, offset, strided."""
    x, edge_attr, edge_index, y = graph
    padded = np.concatenate([np.full((2, 3), -7), edge_index], axis=1)
    tensors = (
        torch.from_numpy(np.ascontiguousarray(x.T)).t(),
        torch.from_numpy(edge_attr),
        torch.from_numpy(padded)[:, 3:],
        torch.from_numpy(np.repeat(y, 2))[::2],
    )
    assert not tensors[0].is_contiguous() and tensors[2].storage_offset() == 3
    assert tensors[3].stride() == (2,)
    if zip_storage:  # as torch would pickle it if it saved storages in its zip format
        return tuple(
            _tensor_over(
                torch,
                _saved(torch, t._typed_storage(), zip_format=True),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
            )
            for t in tensors
        )
    return tensors


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
@pytest.mark.parametrize("zip_storage", [False, True], ids=["legacy", "zip"])
def test_voc_pickle_of_torch_tensors(tmp_path, protocol, zip_storage):
    torch = pytest.importorskip("torch")
    graphs = _voc_graphs(seed=1)
    tensors = [_strided_tensors(torch, graph, zip_storage) for graph in graphs]
    path = tmp_path / "val.pickle"
    with open(path, "wb") as file:
        pickle.dump(tensors, file, protocol=protocol)
    with open(path, "rb") as file:  # torch itself reads the file back as written
        assert torch.equal(pickle.load(file)[1][2], torch.from_numpy(graphs[1][2]))
    _assert_records_match(load_voc_superpixels(path), graphs)


def test_torch_pickle_loads_with_torch_hidden(tmp_path):
    torch = pytest.importorskip("torch")
    graphs = _voc_graphs(seed=2)
    path = _write_pickle(
        tmp_path / "test.pickle", [_strided_tensors(torch, graph) for graph in graphs]
    )
    # A fresh interpreter where `import torch` fails, converting the file to .npz.
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from lhc.graphs.lrgb import load_voc_superpixels, save_npz_graphs\n"
        f"save_npz_graphs({str(tmp_path / 'test.npz')!r}, load_voc_superpixels({str(path)!r}))\n"
        "assert sys.modules['torch'] is None"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    _assert_records_match(load_npz_graphs(tmp_path / "test.npz"), graphs)


def _runs_code(marker):
    """Pickles as a call to ``exec`` that creates the file ``marker``."""
    return _Reduces(exec, f"open({str(marker)!r}, 'w').close()")


def _refusal(path, name):
    return re.escape(f"{path}: refuses to load '{name}': not an array or a tensor")


@pytest.mark.parametrize("where", ["top level", "in a graph"])
def test_pickle_that_runs_code_is_refused(tmp_path, where):
    marker = tmp_path / "ran"
    payload = _runs_code(marker)
    if where == "in a graph":
        payload = [(np.zeros((1, 14)), np.zeros((0, 2)), np.zeros((2, 0), int), payload)]
    path = _write_pickle(tmp_path / "train.pickle", payload)
    with pytest.raises(ValueError, match=_refusal(path, "builtins.exec")):
        load_voc_superpixels(path)
    assert not marker.exists()

    with open(path, "rb") as file:  # what a plain pickle.load does with the file
        pickle.load(file)
    assert marker.exists()


@pytest.mark.parametrize("zip_format", [False, True], ids=["legacy", "zip"])
def test_storage_bytes_that_run_code_are_refused(tmp_path, zip_format):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "ran"
    storage_bytes = _saved(torch, _runs_code(marker), zip_format)
    x = torch.zeros(1, 14)
    graph = (x, torch.zeros(0, 2), torch.zeros(2, 0, dtype=torch.int64))
    path = _write_pickle(tmp_path / "train.pickle", [(*graph, _tensor_over(torch, storage_bytes))])
    # torch.save pickles with protocol 2, which names builtins by their Python 2 module.
    with pytest.raises(ValueError, match=_refusal(path, "__builtin__.exec")):
        load_voc_superpixels(path)
    assert not marker.exists()

    torch.storage._load_from_bytes(storage_bytes)  # what torch does with those bytes
    assert marker.exists()


def test_tensor_reaching_past_its_storage_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    storage_bytes = _saved(torch, torch.arange(4)._typed_storage(), zip_format=False)
    inside = _tensor_over(torch, storage_bytes, offset=1, size=(3,), stride=(1,))
    assert pickle.loads(pickle.dumps(inside)).tolist() == [1, 2, 3]
    outside = _tensor_over(torch, storage_bytes, offset=1, size=(2,), stride=(3,))
    path = _write_pickle(tmp_path / "bad.pickle", [outside])
    with pytest.raises(ValueError, match=r"size \(2,\), stride \(3,\) and offset 1 does not fit"):
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
