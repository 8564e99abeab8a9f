"""The GNN zoo against dense numpy formulas, and its padding, permutation and locality
properties.

References are written here with dense adjacencies ``A[u, v] = 1`` for an edge u -> v,
reading the weights from the layers' params; nothing is compared with lhc's own code.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.graphs.batch import from_adjacencies
from lhc.graphs.models import (
    GNN,
    LAYERS,
    GatedGCNLayer,
    GATLayer,
    GCNLayer,
    GINELayer,
    GINLayer,
)

NODES, WIDTH, EDGE_WIDTH = 6, 4, 3


def _random_graph(seed: int, nodes: int = NODES, directed: bool = True):
    """Adjacency (no self-loops, every node with an edge), node and edge features."""
    rng = np.random.default_rng(seed)
    adjacency = (rng.random((nodes, nodes)) < 0.4).astype(np.float32)
    if not directed:
        adjacency = np.triu(adjacency, 1)
        adjacency = adjacency + adjacency.T
    ring = np.roll(np.eye(nodes, dtype=np.float32), 1, axis=1)  # u -> u + 1
    adjacency = np.maximum(adjacency, ring if directed else np.maximum(ring, ring.T))
    np.fill_diagonal(adjacency, 0)
    features = rng.standard_normal((nodes, WIDTH)).astype(np.float32)
    edge_features = rng.standard_normal((nodes, nodes, EDGE_WIDTH)).astype(np.float32)
    return adjacency, features, edge_features


def _batch(adjacency, features, edge_features=None, *, max_nodes=8, max_edges=32):
    """One graph, padded to the sizes most tests share (eager ops then compile once)."""
    return from_adjacencies(
        [adjacency],
        [features],
        edge_features=None if edge_features is None else [edge_features],
        max_nodes=max_nodes,
        max_edges=max_edges,
    )


def _init(module, graphs, *args, seed=0):
    """Params with every leaf (biases, eps too) drawn at random, so each term counts."""
    params = nn.meta.unbox(module.init(jax.random.key(seed), graphs, *args)["params"])
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed + 100)
    leaves = [jnp.asarray(0.5 * rng.standard_normal(np.shape(x)), jnp.float32) for x in leaves]
    return jax.tree.unflatten(tree, leaves)


def _relu(x):
    return np.maximum(x, 0)


def test_gcn_matches_dense_formula():
    adjacency, features, _ = _random_graph(0)
    graphs = _batch(adjacency, features)
    layer = GCNLayer()
    params = _init(layer, graphs, graphs.nodes)
    out = np.asarray(layer.apply({"params": params}, graphs, graphs.nodes))[0]

    with_loops = adjacency + np.eye(NODES)
    inverse_sqrt = np.diag(1 / np.sqrt(with_loops.sum(0)))  # in-degree + 1
    kernel, bias = np.asarray(params["linear"]["kernel"]), np.asarray(params["bias"])
    expected = inverse_sqrt @ with_loops.T @ inverse_sqrt @ features @ kernel + bias
    np.testing.assert_allclose(out[:NODES], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[NODES:], 0)


def _mlp(params, z):
    hidden = _relu(
        z @ np.asarray(params["hidden"]["kernel"]) + np.asarray(params["hidden"]["bias"])
    )
    return hidden @ np.asarray(params["output"]["kernel"]) + np.asarray(params["output"]["bias"])


def test_gin_matches_dense_formula():
    adjacency, features, _ = _random_graph(1)
    graphs = _batch(adjacency, features)
    layer = GINLayer(train_eps=True)
    params = _init(layer, graphs, graphs.nodes)
    out = np.asarray(layer.apply({"params": params}, graphs, graphs.nodes))[0]

    eps = float(params["eps"])
    expected = _mlp(params["mlp"], (1 + eps) * features + adjacency.T @ features)
    np.testing.assert_allclose(out[:NODES], expected, rtol=1e-5, atol=1e-5)


def test_gine_matches_dense_formula():
    adjacency, features, edge_features = _random_graph(2)
    graphs = _batch(adjacency, features, edge_features)
    layer = GINELayer(eps=0.25)
    params = _init(layer, graphs, graphs.nodes)
    out = np.asarray(layer.apply({"params": params}, graphs, graphs.nodes))[0]

    edge_term = edge_features @ np.asarray(params["edge_linear"]["kernel"])
    edge_term = edge_term + np.asarray(params["edge_linear"]["bias"])  # [u, v, D]
    messages = _relu(features[:, None, :] + edge_term)
    received = np.einsum("uv,uvd->vd", adjacency, messages)
    expected = _mlp(params["mlp"], 1.25 * features + received)
    np.testing.assert_allclose(out[:NODES], expected, rtol=1e-5, atol=1e-5)


def _dense_gat_attention(params, features, adjacency, heads):
    """alpha[u, v, h]: softmax over u in N(v) + {v} of LeakyReLU(a_src z_u + a_dst z_v)."""
    z = np.einsum("nd,dhk->nhk", features, np.asarray(params["linear"]["kernel"], np.float64))
    source = np.einsum("nhk,hk->nh", z, np.asarray(params["attention_source"]))
    target = np.einsum("nhk,hk->nh", z, np.asarray(params["attention_target"]))
    scores = source[:, None, :] + target[None, :, :]
    scores = np.where(scores > 0, scores, 0.2 * scores)
    allowed = (adjacency + np.eye(len(adjacency)) > 0)[..., None]
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(0, keepdims=True))
    return weights / weights.sum(0, keepdims=True), z


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_gat_attention_is_a_masked_softmax(scale):
    heads = 2
    adjacency, features, _ = _random_graph(3)
    graphs = _batch(adjacency, features)
    layer = GATLayer(num_heads=heads)
    params = _init(layer, graphs, graphs.nodes)
    # Large scores would overflow an unshifted softmax.
    params["attention_source"] = params["attention_source"] * scale
    params["attention_target"] = params["attention_target"] * scale
    out, state = layer.apply({"params": params}, graphs, graphs.nodes, mutable=["intermediates"])
    alpha, z = _dense_gat_attention(params, features, adjacency, heads)

    senders, receivers = np.nonzero(adjacency)  # from_adjacencies' edge order
    (edge_attention,) = state["intermediates"]["edge_attention"]
    (self_attention,) = state["intermediates"]["self_attention"]
    edges = len(senders)
    np.testing.assert_allclose(edge_attention[0, :edges], alpha[senders, receivers], atol=1e-5)
    np.testing.assert_array_equal(edge_attention[0, edges:], 0)
    diagonal = alpha[np.arange(NODES), np.arange(NODES)]
    np.testing.assert_allclose(self_attention[0, :NODES], diagonal, atol=1e-5)

    expected = np.einsum("uvh,uhk->vhk", alpha, z).reshape(NODES, WIDTH)
    expected = expected + np.asarray(params["bias"])
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[0, :NODES], expected, rtol=1e-4, atol=1e-4)


def test_gatedgcn_matches_dense_formula():
    adjacency, features, edge_features = _random_graph(4)
    # Edge features of width D, so the edge residual applies.
    edge_features = np.concatenate([edge_features, edge_features[..., :1]], -1)
    graphs = _batch(adjacency, features, edge_features)
    layer = GatedGCNLayer(layer_norm=False)
    params = _init(layer, graphs, graphs.nodes)
    out, edges_out = layer.apply({"params": params}, graphs, graphs.nodes)

    def dense(name, x):
        return x @ np.asarray(params[name]["kernel"]) + np.asarray(params[name]["bias"])

    gate_scores = (
        dense("gate_sender", features)[:, None]
        + dense("gate_receiver", features)[None, :]
        + dense("gate_edge", edge_features)
    )  # [u, v, D]
    gates = adjacency[..., None] / (1 + np.exp(-gate_scores))
    eta = gates / (gates.sum(0, keepdims=True) + 1e-6)
    update = dense("update_self", features) + np.einsum(
        "uvd,ud->vd", eta, dense("update_message", features)
    )
    np.testing.assert_allclose(out[0, :NODES], features + _relu(update), rtol=1e-4, atol=1e-4)
    senders, receivers = np.nonzero(adjacency)
    expected_edges = (edge_features + _relu(gate_scores))[senders, receivers]
    np.testing.assert_allclose(edges_out[0, : len(senders)], expected_edges, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(edges_out[0, len(senders) :], 0)


def _model(layer, graph_level=False, num_layers=2, **options):
    return GNN(
        layer=layer,
        num_layers=num_layers,
        hidden_dim=8,
        out_dim=3,
        graph_level=graph_level,
        num_heads=2,
        **options,
    )


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_padding_and_batching_do_not_change_outputs(layer):
    """Node embeddings (the node-level head is a Dense on them) and the graph-level output
    of a graph are the same alone and unpadded as padded with garbage in a batch."""
    adjacency, features, edge_features = _random_graph(5, directed=False)
    edge_count = int(np.count_nonzero(adjacency))
    tight = _batch(adjacency, features, edge_features, max_nodes=NODES, max_edges=edge_count)
    # Batched with a bigger graph, and its padding holding garbage: features, edge
    # features, and edges between real nodes.
    other_adjacency, other_features, other_edges = _random_graph(6, nodes=NODES + 2)
    loose = from_adjacencies(
        [adjacency, other_adjacency],
        [features, other_features],
        edge_features=[edge_features, other_edges],
        max_nodes=NODES + 4,
        max_edges=48,
    )
    rng = np.random.default_rng(0)
    nodes, edges = np.asarray(loose.nodes).copy(), np.asarray(loose.edges).copy()
    senders = np.asarray(loose.senders).copy()
    nodes[0, NODES:] = rng.standard_normal(nodes[0, NODES:].shape)
    edges[0, edge_count:] = rng.standard_normal(edges[0, edge_count:].shape)
    senders[0, edge_count:] = rng.integers(0, NODES, senders.shape[1] - edge_count)
    loose = loose.replace(nodes=nodes, edges=edges, senders=jnp.asarray(senders))

    model = _model(layer, graph_level=True)
    params = model.init(jax.random.key(1), tight)
    reference = np.asarray(model.apply(params, tight, headless=True))[0]
    embeddings = np.asarray(model.apply(params, loose, headless=True))[0]
    np.testing.assert_allclose(embeddings[:NODES], reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(embeddings[NODES:], 0)
    np.testing.assert_allclose(
        model.apply(params, loose)[0], model.apply(params, tight)[0], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_node_level_models_are_permutation_equivariant(layer):
    # The graph and sizes of the padding test, whose ops are then compiled already.
    adjacency, features, edge_features = _random_graph(5, directed=False)
    permutation = np.random.default_rng(1).permutation(NODES)
    sizes = dict(max_nodes=NODES, max_edges=int(np.count_nonzero(adjacency)))
    graphs = _batch(adjacency, features, edge_features, **sizes)
    permuted = _batch(
        adjacency[np.ix_(permutation, permutation)],
        features[permutation],
        edge_features[np.ix_(permutation, permutation)],
        **sizes,
    )
    model = _model(layer)
    params = model.init(jax.random.key(2), graphs)
    out = np.asarray(model.apply(params, graphs))[0]
    out_permuted = np.asarray(model.apply(params, permuted))[0]
    np.testing.assert_allclose(out_permuted, out[permutation], rtol=1e-5, atol=1e-5)


def _path_graph(nodes):
    adjacency = np.zeros((nodes, nodes), np.float32)
    index = np.arange(nodes - 1)
    adjacency[index, index + 1] = adjacency[index + 1, index] = 1
    return adjacency


@pytest.mark.parametrize(
    "layer, options, is_local",
    [("gcn", {}, True), ("gin", {}, True), ("gps", {"gps_local": "gcn"}, False)],
)
def test_receptive_field(layer, options, is_local):
    """With 2 layers on a path, node 0 sees nodes 1 and 2 only, unless attention is global."""
    adjacency = _path_graph(7)
    features = np.random.default_rng(3).standard_normal((7, WIDTH)).astype(np.float32)
    graphs = _batch(adjacency, features)
    model = _model(layer, num_layers=2, **options)
    params = model.init(jax.random.key(3), graphs)
    out = np.asarray(model.apply(params, graphs))
    np.testing.assert_array_equal(out[0, 7], 0)  # the padding node
    base = out[0, 0]

    def change_at(node):
        nodes = np.asarray(graphs.nodes).copy()
        nodes[0, node] += 1.0
        out = np.asarray(model.apply(params, graphs.replace(nodes=jnp.asarray(nodes))))[0, 0]
        return np.abs(out - base).max()

    assert change_at(2) > 1e-4  # distance 2: inside the receptive field
    for far in (3, 6):
        if is_local:
            assert change_at(far) == 0
        else:
            assert change_at(far) > 1e-4


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_jit_and_finite_gradients(layer):
    adjacency, features, edge_features = _random_graph(8)
    graphs = _batch(adjacency, features, edge_features)
    model = _model(layer, graph_level=True, num_layers=1)
    params = model.init(jax.random.key(4), graphs)["params"]

    def loss_and_grad(params, graphs):
        loss = lambda p: jnp.sum(model.apply({"params": p}, graphs) ** 2)  # noqa: E731
        return jax.value_and_grad(loss)(params)

    # Unoptimised machine code compiles in half the time and computes the same.
    compiled = (
        jax.jit(loss_and_grad)
        .lower(params, graphs)
        .compile(compiler_options={"xla_backend_optimization_level": 0})
    )
    loss, grads = compiled(params, graphs)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads["node_encoder"]))


def test_headless_returns_node_embeddings_with_the_same_params():
    adjacency, features, _ = _random_graph(9)
    graphs = _batch(adjacency, features)
    model = _model("gcn", graph_level=True)
    params = nn.meta.unbox(model.init(jax.random.key(5), graphs, headless=True)["params"])
    assert "head" in params
    embeddings = np.asarray(model.apply({"params": params}, graphs, headless=True))
    assert embeddings.shape == (1, NODES + 2, 8)
    np.testing.assert_array_equal(embeddings[0, NODES:], 0)
    pooled = embeddings[0, :NODES].mean(0)
    expected = pooled @ np.asarray(params["head"]["kernel"]) + np.asarray(params["head"]["bias"])
    out = np.asarray(model.apply({"params": params}, graphs))[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_errors_name_what_is_wrong():
    adjacency, features, _ = _random_graph(10)
    graphs = _batch(adjacency, features)
    with pytest.raises(ValueError, match=r"'gnc'.*'gat'.*'gcn'"):
        _model("gnc").init(jax.random.key(0), graphs)
    for layer in ("gine", "gatedgcn"):
        with pytest.raises(ValueError, match=f"{layer} needs edge features"):
            _model(layer).init(jax.random.key(0), graphs)
    with pytest.raises(ValueError, match="needs edge features"):
        _model("gps", gps_local="gine").init(jax.random.key(0), graphs)
    with pytest.raises(ValueError, match="divisible by num_heads=3"):
        GATLayer(num_heads=3).init(jax.random.key(0), graphs, graphs.nodes)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_parameter_has_logical_axis_names(layer):
    """Each parameter is boxed with one name per axis, each known to the sharding rules."""
    from lhc.parallel.mesh import LOGICAL_AXIS_RULES

    adjacency, features, edge_features = _random_graph(6)
    boxed = _model(layer, graph_level=True).init(
        jax.random.key(0), _batch(adjacency, features, edge_features)
    )["params"]
    known = {name for name, _ in LOGICAL_AXIS_RULES}
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(leaf, nn.Partitioned) for leaf in leaves)
    for leaf in leaves:
        assert len(leaf.names) == leaf.value.ndim
        assert {name for name in leaf.names if name is not None} <= known
