"""Distances, influence matrices, the range measure and the synthetic tasks of
``lhc.graphs``, against networkx, numpy formulas and the paper's published values."""

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest
import scipy.sparse
from jax.experimental import sparse as jsparse

from lhc.graphs import synthetic
from lhc.graphs.distances import connected, resistance_distances, shortest_path_distances
from lhc.graphs.influence import graph_influence, node_influence, node_ranges, range_measure


def _two_components(seed=0):
    """An ER graph on 9 nodes and a path on 5, plus an isolated node (15 nodes)."""
    rng = np.random.default_rng(seed)
    a = synthetic.erdos_renyi_graph(9, 0.4, rng)
    while not nx.is_connected(nx.from_numpy_array(a)):
        a = synthetic.erdos_renyi_graph(9, 0.4, rng)
    adjacency = np.zeros((15, 15), np.float32)
    adjacency[:9, :9] = a
    adjacency[9:14, 9:14] = synthetic.path_graph(5)
    perm = rng.permutation(15)
    return adjacency[perm][:, perm]


def test_shortest_paths_match_networkx_and_are_zero_across_components():
    adjacency = _two_components()
    graph = nx.from_numpy_array(adjacency)
    expected = np.zeros((15, 15))
    for u, lengths in nx.all_pairs_shortest_path_length(graph):
        for v, length in lengths.items():
            expected[u, v] = length
    np.testing.assert_array_equal(np.asarray(shortest_path_distances(adjacency)), expected)
    same = np.zeros((15, 15), bool)
    for component in nx.connected_components(graph):
        same[np.ix_(list(component), list(component))] = True
    np.testing.assert_array_equal(np.asarray(connected(adjacency)), same)


def test_resistance_matches_the_laplacian_pseudo_inverse_per_component():
    adjacency = _two_components(1)
    graph = nx.from_numpy_array(adjacency)
    expected = np.zeros((15, 15))
    for component in nx.connected_components(graph):
        nodes = sorted(component)
        sub = adjacency[np.ix_(nodes, nodes)].astype(np.float64)
        pinv = np.linalg.pinv(np.diag(sub.sum(1)) - sub)
        d = np.diag(pinv)
        expected[np.ix_(nodes, nodes)] = d[:, None] + d[None, :] - 2 * pinv
    got = np.asarray(resistance_distances(adjacency))
    np.testing.assert_allclose(got, expected, atol=2e-5)
    # networkx on the connected ER part, as a second reference.
    part = max(nx.connected_components(graph), key=len)
    sub = graph.subgraph(part)
    reference = nx.resistance_distance(sub)
    for u in part:
        for v in part:
            if u != v:
                assert got[u, v] == pytest.approx(reference[u][v], abs=2e-5)


def test_sparse_inputs_and_edge_cases():
    adjacency = _two_components(2)
    dense_spd = np.asarray(shortest_path_distances(adjacency))
    dense_res = np.asarray(resistance_distances(adjacency))
    for sparse in (scipy.sparse.csr_matrix(adjacency), jsparse.BCOO.fromdense(adjacency)):
        np.testing.assert_array_equal(np.asarray(shortest_path_distances(sparse)), dense_spd)
        np.testing.assert_allclose(np.asarray(resistance_distances(sparse)), dense_res, atol=1e-6)
    # One direction of each edge is enough; self-loops are ignored.
    upper = np.triu(adjacency) + np.eye(15)
    np.testing.assert_array_equal(np.asarray(shortest_path_distances(upper)), dense_spd)
    # The empty graph and a graph without edges.
    assert shortest_path_distances(np.zeros((0, 0))).shape == (0, 0)
    assert resistance_distances(np.zeros((0, 0))).shape == (0, 0)
    np.testing.assert_array_equal(np.asarray(resistance_distances(np.zeros((3, 3)))), 0)
    with pytest.raises(ValueError, match=r"adjacency: expected a square"):
        shortest_path_distances(np.zeros((3, 4)))


def test_range_measure_against_a_direct_formula():
    rng = np.random.default_rng(0)
    influence = rng.random((6, 6))
    influence[2] = 0  # a node without influence: its normalised range is 0
    distances = rng.integers(0, 4, (6, 6)).astype(float)
    raw = (influence * distances).sum(1)
    norm = np.divide(raw, influence.sum(1), out=np.zeros(6), where=influence.sum(1) > 0)
    assert range_measure(influence, distances, normalized=False) == pytest.approx(raw.mean(), 1e-6)
    assert range_measure(influence, distances, normalized=True) == pytest.approx(norm.mean(), 1e-6)
    mask = np.array([1, 1, 1, 1, 0, 0], bool)
    sub = influence[:4, :4] * distances[:4, :4]
    assert range_measure(influence, distances, normalized=False, node_mask=mask) == pytest.approx(
        sub.sum(1).mean(), 1e-6
    )
    assert range_measure(np.zeros((0, 0)), np.zeros((0, 0)), normalized=True) == 0.0
    with pytest.raises(ValueError, match="influence and distances"):
        node_ranges(influence, distances[:5, :5], normalized=True)


def _nonlinear_node_fn(adjacency, seed=0):
    """A two-hop nonlinear function of node features: [N, 2] -> [N, 3]."""
    a = jnp.asarray(adjacency) + jnp.eye(adjacency.shape[0])
    w1, w2 = jax.random.normal(jax.random.key(seed), (2, 2, 3))
    return lambda x: jnp.tanh(a @ jnp.tanh(a @ x @ w1) @ w2.T @ w1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_influence_equals_the_full_derivatives(chunk_size):
    adjacency = synthetic.grid_graph(3, 3)
    x = jax.random.normal(jax.random.key(1), (9, 2))
    fn = _nonlinear_node_fn(adjacency)
    full = node_influence(fn, x)
    np.testing.assert_allclose(node_influence(fn, x, chunk_size=chunk_size), full, rtol=1e-5)
    # A direct reference: the Jacobian by finite differences in float64 would be slow;
    # jax.jacfwd is an independent (forward-mode) route.
    forward = np.abs(np.asarray(jax.jacfwd(fn)(x))).sum((1, 3))
    np.testing.assert_allclose(full, forward, rtol=1e-5, atol=1e-7)

    pooled = lambda z: jnp.stack([fn(z).mean(), (fn(z) ** 2).sum()])  # noqa: E731
    hessian = graph_influence(pooled, x)
    reference = np.abs(np.asarray(jax.jacfwd(jax.jacfwd(pooled))(x))).sum((0, 2, 4))
    np.testing.assert_allclose(hessian, reference, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        graph_influence(pooled, x, chunk_size=chunk_size), hessian, rtol=1e-4, atol=1e-6
    )


def test_influence_rejects_bad_input():
    fn = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match=r"x: expected node features \[N, C\]"):
        node_influence(fn, jnp.zeros(4))
    with pytest.raises(ValueError, match="chunk_size"):
        node_influence(fn, jnp.zeros((4, 1)), chunk_size=0)
    with pytest.raises(ValueError, match=r"fn: expected node outputs \[4, D\]"):
        node_influence(lambda x: x.sum(), jnp.zeros((4, 1)))
    with pytest.raises(ValueError, match=r"fn: expected graph outputs"):
        graph_influence(fn, jnp.zeros((4, 1)))


def test_hop_task_on_a_grid_has_normalised_spd_range_exactly_k():
    adjacency = synthetic.grid_graph(16, 16)
    spd = shortest_path_distances(adjacency)
    x = jax.random.normal(jax.random.key(0), (256, 1))
    for k in (1, 2, 5):
        task = synthetic.SyntheticTask(synthetic.operator(adjacency, "hop", k))
        influence = synthetic.task_influence(task, x, chunk_size=128)
        assert range_measure(influence, spd, normalized=True) == pytest.approx(k, abs=1e-5)


def test_power_task_ranges_on_the_grid_match_the_published_values():
    # data/plotting of the official code: spd-normalised range of power-k on the 16x16
    # grid for k = 1..8, and resistance-normalised 0.42 (k = 1) to 0.78 (k = 8).
    published = (0.79, 1.24, 1.57, 1.84, 2.06, 2.26, 2.44, 2.61)
    adjacency = synthetic.grid_graph(16, 16)
    spd, res = shortest_path_distances(adjacency), resistance_distances(adjacency)
    x = jax.random.normal(jax.random.key(0), (256, 1))
    for k, value in enumerate(published, start=1):
        task = synthetic.SyntheticTask(synthetic.operator(adjacency, "power", k))
        influence = synthetic.task_influence(task, x, chunk_size=256)
        assert range_measure(influence, spd, normalized=True) == pytest.approx(value, abs=0.006)
        if k in (1, 8):
            expected = {1: 0.42, 8: 0.78}[k]
            assert range_measure(influence, res, normalized=True) == pytest.approx(
                expected, abs=0.006
            )


def test_graph_level_l2_hessian_against_its_closed_form():
    # y = mean_v sum_u M_uv (x_u - x_v)^2 with scalar x: d2y / dx_a dx_b = -2 (M_ab + M_ba) / N
    # for a != b, and 2 (sum_u M_ua + sum_v M_av - 2 M_aa) / N on the diagonal.
    adjacency = _two_components(3)
    m = np.asarray(synthetic.operator(adjacency, "nbhd", 2), np.float64)
    task = synthetic.SyntheticTask(jnp.asarray(m), "l2", graph_level=True)
    x = jax.random.normal(jax.random.key(2), (15, 1))
    expected = 2 * np.abs(m + m.T) / 15
    np.fill_diagonal(expected, 2 * np.abs(m.sum(0) + m.sum(1) - 2 * np.diag(m)) / 15)
    np.testing.assert_allclose(synthetic.task_influence(task, x, chunk_size=4), expected, atol=1e-6)
    # nbhd stays within components: no influence across them.
    same = np.asarray(connected(adjacency))
    assert np.all(expected[~same] == 0)


def test_operators_and_interactions_reject_bad_names():
    adjacency = synthetic.grid_graph(2, 2)
    with pytest.raises(ValueError, match="kind: expected one of"):
        synthetic.operator(adjacency, "powers", 2)
    with pytest.raises(ValueError, match="interaction 'cosine'"):
        synthetic.SyntheticTask(synthetic.operator(adjacency, "power", 1), "cosine")(
            jnp.ones((4, 1))
        )
    with pytest.raises(ValueError, match="interaction: expected one of"):
        synthetic.interaction("dot", jnp.ones((4, 2)))
    cosine = synthetic.SyntheticTask(synthetic.operator(adjacency, "power", 1), "cosine")
    assert cosine(jax.random.normal(jax.random.key(0), (4, 3))).shape == (4, 1)


def test_graph_generators():
    rng = np.random.default_rng(0)
    grid = synthetic.grid_graph(3, 4)
    assert grid.sum() == 2 * (3 * 3 + 2 * 4) and np.array_equal(grid, grid.T)
    ba = synthetic.barabasi_albert_graph(30, 3, rng)
    assert np.array_equal(ba, ba.T) and ba.sum() / 2 == 6 + 3 * 26
    sbm = synthetic.sbm_graph([10, 10], 1.0, 0.0, rng)
    assert sbm[:10, 10:].sum() == 0 and sbm[:10, :10].sum() == 90
