"""The range of GNNs, the training task that tracks it and the report."""

import json

import jax
import numpy as np
import pytest

from lhc.graphs import report, synthetic
from lhc.graphs.batch import from_adjacencies
from lhc.graphs.distances import shortest_path_distances
from lhc.graphs.influence import graph_influence, node_influence, range_measure
from lhc.graphs.models import GNN
from lhc.train.config import load_config
from lhc.train.trainer import train_and_evaluate


@pytest.mark.parametrize("layer", ["gcn", "gin", "gat"])
@pytest.mark.parametrize("depth", [1, 3])
def test_a_k_layer_message_passing_model_has_range_at_most_k(layer, depth):
    adjacency = synthetic.grid_graph(5, 5)
    spd = np.asarray(shortest_path_distances(adjacency))
    graphs = from_adjacencies([adjacency], [np.zeros((25, 1))])
    model = GNN(layer=layer, num_layers=depth, hidden_dim=8, out_dim=2)
    params = model.init(jax.random.key(0), graphs)["params"]
    fn = lambda x: model.apply({"params": params}, graphs.replace(nodes=x[None]))[0]  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (25, 1))
    influence = np.asarray(node_influence(fn, x, chunk_size=16))
    assert np.all(influence[spd > depth] == 0)
    assert influence[spd == depth].min() > 0  # the whole k-hop ball is reached
    assert 0 < range_measure(influence, spd, normalized=True) <= depth


def test_graph_level_influence_of_a_model_stays_within_twice_its_depth():
    # Two node inputs interact in a pooled k-layer model only through a node that both
    # reach: the Hessian is zero beyond 2k hops. (With ReLU it is zero everywhere.)
    adjacency = synthetic.path_graph(9)
    spd = np.asarray(shortest_path_distances(adjacency))
    graphs = from_adjacencies([adjacency], [np.zeros((9, 1))])
    x = jax.random.normal(jax.random.key(2), (9, 1))
    for activation in ("gelu", "relu"):
        model = GNN(
            layer="gcn",
            num_layers=1,
            hidden_dim=8,
            out_dim=1,
            graph_level=True,
            activation=activation,
        )
        params = model.init(jax.random.key(0), graphs)["params"]
        fn = lambda z, model=model, params=params: model.apply(  # noqa: E731
            {"params": params}, graphs.replace(nodes=z[None])
        )[0]
        influence = np.asarray(graph_influence(fn, x, chunk_size=4))
        if activation == "relu":
            assert np.all(influence == 0)
        else:
            assert np.all(influence[spd > 2] == 0) and influence[spd == 2].min() > 0


def _run(tmp_path, depth, extra=""):
    config = load_config(f"configs/graphs_range.py:depth={depth},runlocal=True{extra}")
    config.progress_bar = False
    config.tensorboard = False
    workdir = tmp_path / f"depth{depth}"
    summary = train_and_evaluate(config, str(workdir))
    return summary, workdir


def test_training_logs_the_model_and_task_ranges(tmp_path):
    summary, workdir = _run(tmp_path, 2)
    # The task's range, recomputed directly: power-5 on the 4x4 grid, copy, node level.
    adjacency = synthetic.grid_graph(4, 4)
    task = synthetic.SyntheticTask(synthetic.operator(adjacency, "power", 5))
    x = jax.random.normal(jax.random.key(0), (16, 1))  # the task's Jacobian is constant
    spd = shortest_path_distances(adjacency)
    expected = range_measure(node_influence(task, x), spd, normalized=True)
    assert summary["eval/task_range_spd_norm"] == pytest.approx(expected, rel=1e-5)
    assert 0 < summary["eval/range_spd_norm"] <= 2
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/range_spd_norm" in r] == [2, 4]
    _, other = _run(tmp_path, 1)
    text = report.main([str(workdir), str(other), "--plot", str(tmp_path / "range.png")])
    assert "model range" in text and (tmp_path / "range.png").stat().st_size > 0
    lines = text.splitlines()
    assert lines[2].split()[0] == "1" and lines[3].split()[0] == "2"


def test_graph_level_task_trains_and_reports_hessian_ranges(tmp_path):
    summary, _ = _run(tmp_path, 1, ",graph_level=True,interaction=l2,activation=gelu")
    assert summary["eval/range_spd_norm"] > 0
    for key in ("eval/range_spd_norm", "eval/task_range_res_raw", "eval/mse"):
        assert np.isfinite(summary[key])
