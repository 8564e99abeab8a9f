"""Message-passing GNNs on padded ``Graphs``: GCN, GIN, GINE, GAT, GatedGCN and GraphGPS.

Every layer reads ``(graphs, h[B, N, D])`` and writes ``h'[B, N, D]``: padding nodes'
outputs are 0 and masked edges carry no messages, so a graph gives the same outputs on
its real nodes however much it is padded. The layers that update edge features
(``GatedGCNLayer``, ``GPSLayer``) return ``(h', edges')`` instead. Letters as in
``batch.py``: ``B`` graphs, ``N`` nodes, ``E`` edges, ``D`` hidden width, ``G`` edge
features, ``H`` heads, ``K`` width per head.

Every parameter carries logical axis names (``lhc.parallel.LOGICAL_AXIS_RULES``): a
layer's maps read ``embed`` and write ``mlp`` (the second map of an MLP reads ``mlp`` and
writes ``embed``), attention weights are ``heads`` and ``kv``, norms ``norm``; the input
features and the head's outputs are not split. Initialisations are flax's defaults.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.graphs.batch import Graphs, gather, in_degrees, mean_pool, scatter_sum
from lhc.nn.linear import Einsum, dense

Dtype = Any


def _mask_nodes(h: jax.Array, graphs: Graphs) -> jax.Array:
    return jnp.where(graphs.node_mask[..., None], h, 0)


def _segment_max(scores: jax.Array, index: jax.Array, mask: jax.Array, num_nodes: int):
    """Per-node maximum of masked edge scores float[B, E, H] -> float[B, N, H]; -inf
    where a node receives nothing (unlike ``scatter_max``, whose 0 there could exceed
    every score of the node and underflow its softmax)."""
    scores = jnp.where(mask[..., None], scores, -jnp.inf)
    return jax.vmap(lambda s, i: jax.ops.segment_max(s, i, num_segments=num_nodes))(scores, index)


def _logical(init, axes):
    return nn.with_logical_partitioning(init, axes)


def _layer_norm(name: str, **precision) -> nn.LayerNorm:
    return nn.LayerNorm(
        scale_init=_logical(nn.initializers.ones_init(), ("norm",)),
        bias_init=_logical(nn.initializers.zeros_init(), ("norm",)),
        **precision,
        name=name,
    )


def _require_edges(graphs: Graphs, layer: str) -> jax.Array:
    if graphs.edges is None:
        raise ValueError(f"{layer} needs edge features: got graphs.edges=None")
    return graphs.edges


class GCNLayer(nn.Module):
    """Kipf & Welling (2017): ``h'_v = sum_{u in N(v) + v} h_u W / sqrt(d_u d_v) + b``,
    with ``d`` the in-degree plus one (the self-loop)."""

    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, graphs: Graphs, h: jax.Array) -> jax.Array:
        width = h.shape[-1]
        scale = jax.lax.rsqrt(in_degrees(graphs) + 1.0)[..., None]  # [B, N, 1]
        projected = dense(
            width,
            ("embed", "mlp"),
            "linear",
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(h)
        scale = scale.astype(projected.dtype)
        sent = projected * scale
        received = scatter_sum(
            gather(sent, graphs.senders), graphs.receivers, graphs.edge_mask, graphs.num_nodes
        )
        out = (received + sent) * scale
        if self.use_bias:
            bias = self.param(
                "bias", _logical(nn.initializers.zeros, ("mlp",)), (width,), self.param_dtype
            )
            out = out + bias.astype(out.dtype)
        return _mask_nodes(out, graphs)


class _MLP(nn.Module):
    """Dense, ReLU, Dense: D -> D -> D, the update of GIN and GINE."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        precision = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        hidden = dense(h.shape[-1], ("embed", "mlp"), "hidden", **precision)(h)
        return dense(h.shape[-1], ("mlp", "embed"), "output", **precision)(nn.relu(hidden))


class GINLayer(nn.Module):
    """GIN (Xu et al. 2019): ``h'_v = MLP((1 + eps) h_v + sum_{u in N(v)} h_u)``.

    Attributes:
      eps: the initial (``train_eps``) or fixed weight of the node itself.
      train_eps: learn ``eps`` (the parameter ``eps``).
    """

    eps: float = 0.0
    train_eps: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _messages(self, graphs: Graphs, h: jax.Array) -> jax.Array:
        return gather(h, graphs.senders)

    @nn.compact
    def __call__(self, graphs: Graphs, h: jax.Array) -> jax.Array:
        eps = self.eps
        if self.train_eps:
            eps = self.param(
                "eps", _logical(nn.initializers.constant(self.eps), ()), (), self.param_dtype
            )
        received = scatter_sum(
            self._messages(graphs, h), graphs.receivers, graphs.edge_mask, graphs.num_nodes
        )
        out = _MLP(self.dtype, self.param_dtype, name="mlp")((1 + eps) * h + received)
        return _mask_nodes(out, graphs)


class GINELayer(GINLayer):
    """GINE (Hu et al. 2020): GIN whose message is ``ReLU(h_u + W e_uv + b)``; needs
    ``graphs.edges`` (float[B, E, G], projected to D by the ``edge_linear`` Dense)."""

    def _messages(self, graphs: Graphs, h: jax.Array) -> jax.Array:
        edges = _require_edges(graphs, "GINELayer")
        edge_term = dense(
            h.shape[-1],
            ("embed", "mlp"),
            "edge_linear",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(edges)
        return nn.relu(gather(h, graphs.senders) + edge_term)


class GATLayer(nn.Module):
    """Multi-head graph attention (Velickovic et al. 2018), heads concatenated to D.

    With ``z = W h`` per head, node v attends to its in-neighbours and itself with
    ``alpha_uv = softmax_u LeakyReLU(a_src . z_u + a_dst . z_v)`` (scores and softmax in
    float32, shifted by a per-node max), and ``h'_v = concat_heads sum_u alpha_uv z_u + b``.
    The weights are sown as ``intermediates``: ``edge_attention`` float[B, E, H] (edge
    u -> v, 0 on masked edges) and ``self_attention`` float[B, N, H].
    """

    num_heads: int = 4
    negative_slope: float = 0.2
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, graphs: Graphs, h: jax.Array) -> jax.Array:
        width = h.shape[-1]
        if width % self.num_heads:
            raise ValueError(
                f"GATLayer: width {width} must be divisible by num_heads={self.num_heads}"
            )
        head_dim = width // self.num_heads
        z = Einsum(  # with nn.DenseGeneral's initialisation
            (width, self.num_heads, head_dim),
            ("embed", "heads", "kv"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="linear",
            kernel_init=nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)),
        )("BND,DHK->BNHK", h)
        init = _logical(nn.initializers.lecun_normal(in_axis=-1, out_axis=-2), ("heads", "kv"))
        shape = (self.num_heads, head_dim)
        attend_source = self.param("attention_source", init, shape, self.param_dtype)
        attend_target = self.param("attention_target", init, shape, self.param_dtype)
        source_score = jnp.einsum("BNHK,HK->BNH", z, attend_source).astype(jnp.float32)
        target_score = jnp.einsum("BNHK,HK->BNH", z, attend_target).astype(jnp.float32)
        leaky = lambda s: nn.leaky_relu(s, self.negative_slope)  # noqa: E731
        edge_scores = leaky(
            gather(source_score, graphs.senders) + gather(target_score, graphs.receivers)
        )  # [B, E, H]
        self_scores = leaky(source_score + target_score)  # [B, N, H]

        # Any shift leaves the softmax unchanged, so the max need not be differentiated;
        # the self-loop keeps it finite.
        node_max = jax.lax.stop_gradient(
            jnp.maximum(
                _segment_max(edge_scores, graphs.receivers, graphs.edge_mask, graphs.num_nodes),
                self_scores,
            )
        )
        edge_weights = jnp.where(
            graphs.edge_mask[..., None],
            jnp.exp(edge_scores - gather(node_max, graphs.receivers)),
            0,
        )
        self_weights = jnp.exp(self_scores - node_max)
        total = (
            scatter_sum(edge_weights, graphs.receivers, graphs.edge_mask, graphs.num_nodes)
            + self_weights
        )
        edge_attention = edge_weights / gather(total, graphs.receivers)
        self_attention = self_weights / total
        self.sow("intermediates", "edge_attention", edge_attention)
        self.sow("intermediates", "self_attention", self_attention)

        def concat_heads(x):  # [B, *, H, K] -> [B, *, D]
            return x.reshape(x.shape[:2] + (width,))

        sent = gather(concat_heads(z), graphs.senders).reshape(edge_scores.shape + (head_dim,))
        messages = edge_attention[..., None].astype(z.dtype) * sent  # [B, E, H, K]
        out = scatter_sum(
            concat_heads(messages), graphs.receivers, graphs.edge_mask, graphs.num_nodes
        )
        out = out + concat_heads(self_attention[..., None].astype(z.dtype) * z)
        bias = self.param(
            "bias", _logical(nn.initializers.zeros, ("mlp",)), (width,), self.param_dtype
        )
        return _mask_nodes(out + bias.astype(out.dtype), graphs)


class GatedGCNLayer(nn.Module):
    """Residual gated graph convnet (Bresson & Laurent 2017), as in LRGB and GraphGPS.

    ``ê_uv = A h_u + B h_v + C e_uv``, ``eta_uv = sigmoid(ê_uv) / (sum_w sigmoid(ê_wv)
    + 1e-6)``, ``h'_v = U h_v + sum_u eta_uv * V h_u``; then ``h <- h + ReLU(LN(h'))`` and
    ``e <- e + ReLU(LN(ê))``. LayerNorm (``layer_norm``) stands in for the reference's
    BatchNorm, so a node's output does not depend on the rest of the batch. The edge
    residual applies when ``G == D``; masked edges' outputs are 0. The Denses are named
    ``gate_sender`` (A), ``gate_receiver`` (B), ``gate_edge`` (C), ``update_self`` (U),
    ``update_message`` (V).

    Returns:
      ``(h'[B, N, D], edges'[B, E, D])``: put the edges back with
      ``graphs.replace(edges=edges')`` for the next layer.
    """

    updates_edges: ClassVar[bool] = True
    residual: bool = True
    layer_norm: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, graphs: Graphs, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        edges = _require_edges(graphs, "GatedGCNLayer")
        width = h.shape[-1]
        precision = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        projection = lambda name: dense(width, ("embed", "mlp"), name, **precision)  # noqa: E731
        gate_scores = (
            gather(projection("gate_sender")(h), graphs.senders)
            + gather(projection("gate_receiver")(h), graphs.receivers)
            + projection("gate_edge")(edges)
        )  # [B, E, D]
        gates = nn.sigmoid(gate_scores)
        gate_total = scatter_sum(gates, graphs.receivers, graphs.edge_mask, graphs.num_nodes)
        gated = scatter_sum(
            gates * gather(projection("update_message")(h), graphs.senders),
            graphs.receivers,
            graphs.edge_mask,
            graphs.num_nodes,
        )
        h_update = projection("update_self")(h) + gated / (gate_total + 1e-6)
        edge_update = gate_scores
        if self.layer_norm:
            norm = lambda name: _layer_norm(name, **precision)  # noqa: E731
            h_update, edge_update = norm("node_norm")(h_update), norm("edge_norm")(edge_update)
        h_update, edge_update = nn.relu(h_update), nn.relu(edge_update)
        if self.residual:
            h_update = h + h_update
            if edges.shape[-1] == width:
                edge_update = edges + edge_update
        edge_update = jnp.where(graphs.edge_mask[..., None], edge_update, 0)
        return _mask_nodes(h_update, graphs), edge_update


class GPSLayer(nn.Module):
    """A GraphGPS layer (Rampasek et al. 2022): local message passing plus global
    attention, summed, then an MLP.

    ``h_local = LN(h + local(h))`` (GatedGCN adds its own residual, as in GraphGPS),
    ``h_global = LN(h + MHA(h))`` over each graph's real nodes (padding nodes are masked
    as keys), ``h <- h_local + h_global``, ``h' = LN(h + MLP(h))`` with a ReLU MLP of
    width ``mlp_ratio * D``.

    Attributes:
      local: "gatedgcn", "gine" (both need edge features) or "gcn".

    Returns:
      ``(h'[B, N, D], edges')``: edges updated by a GatedGCN, else ``graphs.edges``.
    """

    updates_edges: ClassVar[bool] = True
    local: str = "gatedgcn"
    num_heads: int = 4
    mlp_ratio: int = 2
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, graphs: Graphs, h: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        local_layers = {"gatedgcn": GatedGCNLayer, "gine": GINELayer, "gcn": GCNLayer}
        if self.local not in local_layers:
            raise ValueError(
                f"GPSLayer: unknown local layer {self.local!r}, expected one of "
                f"{sorted(local_layers)}"
            )
        precision = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        norm = lambda name: _layer_norm(name, **precision)  # noqa: E731
        width = h.shape[-1]

        local_layer = local_layers[self.local](**precision, name="local")
        edges = graphs.edges
        if self.local == "gatedgcn":
            h_local, edges = local_layer(graphs, h)
        else:
            h_local = h + local_layer(graphs, h)
        h_local = norm("local_norm")(h_local)

        key_mask = graphs.node_mask[:, None, None, :]  # [B, 1, 1, N]: heads, queries, keys
        attended = nn.MultiHeadDotProductAttention(
            self.num_heads,
            **precision,
            qkv_features=width,
            out_features=width,
            force_fp32_for_softmax=True,
            deterministic=True,
            kernel_init=_logical(nn.initializers.lecun_normal(), ("embed", "heads", "kv")),
            bias_init=_logical(nn.initializers.zeros_init(), ("heads", "kv")),
            out_kernel_init=_logical(nn.initializers.lecun_normal(), ("heads", "kv", "embed")),
            out_bias_init=_logical(nn.initializers.zeros_init(), ("embed",)),
            name="attention",
        )(h, mask=key_mask)
        h_global = norm("attention_norm")(h + attended)

        h = h_local + h_global
        hidden = dense(self.mlp_ratio * width, ("embed", "mlp"), "mlp_hidden", **precision)(h)
        out = dense(width, ("mlp", "embed"), "mlp_output", **precision)(nn.relu(hidden))
        h = norm("mlp_norm")(h + out)
        return _mask_nodes(h, graphs), edges


LAYERS: dict[str, type[nn.Module]] = {
    "gcn": GCNLayer,
    "gin": GINLayer,
    "gine": GINELayer,
    "gat": GATLayer,
    "gatedgcn": GatedGCNLayer,
    "gps": GPSLayer,
}
_NEEDS_EDGES = ("gine", "gatedgcn")
# The nonlinearity after GCN, GIN, GINE and GAT layers. A ReLU network is piecewise
# linear, so its Hessian (the graph-level influence) is zero almost everywhere: graph-level
# range needs a smooth one.
ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu, "silu": nn.silu, "tanh": jnp.tanh}


class GNN(nn.Module):
    """Node encoder, ``num_layers`` layers of one kind, and a Dense head.

    Node features go through a Dense to ``hidden_dim`` (edge features too, when the
    layers read them). GCN, GIN, GINE and GAT layers are followed by ``activation`` and,
    with ``residual``, a skip (``h <- h + act(layer(h))``); GatedGCN layers have their own
    residual (switched by ``residual`` too) and GPS layers always do.

    Attributes:
      layer: a key of ``LAYERS``.
      num_layers: message-passing layers.
      hidden_dim: D.
      out_dim: the head's outputs.
      residual: skip connections around the layers.
      graph_level: mean-pool the real nodes before the head.
      num_heads: heads of GAT and of GPS attention.
      gps_local: the local layer of GPS ("gatedgcn", "gine", "gcn"); None: GatedGCN
        when the graphs carry edge features (as GraphGPS on LRGB), else GCN.
      activation: a key of ``ACTIVATIONS``, after GCN, GIN, GINE and GAT layers
        (GatedGCN and GPS keep their ReLUs).
    """

    layer: str
    num_layers: int
    hidden_dim: int
    out_dim: int
    residual: bool = True
    graph_level: bool = False
    num_heads: int = 4
    gps_local: str | None = None
    activation: str = "relu"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, graphs: Graphs, *, headless: bool = False) -> jax.Array:
        """Outputs of the model.

        Args:
          graphs: a batch; ``graphs.edges`` float[B, E, G] is needed by gine and
            gatedgcn (and gps with such a local layer).
          headless: return the final node embeddings float[B, N, D] (0 on padding
            nodes), before pooling and head, e.g. for a final-layer Jacobian.

        Returns:
          float32[B, out_dim] when ``graph_level``, else float32[B, N, out_dim] (0 on
          padding nodes).
        """
        if self.layer not in LAYERS:
            raise ValueError(f"GNN: unknown layer {self.layer!r}, expected one of {sorted(LAYERS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"GNN: unknown activation {self.activation!r}, expected one of {sorted(ACTIVATIONS)}"
            )
        local = self.gps_local
        if self.layer == "gps" and local is None:
            local = "gcn" if graphs.edges is None else "gatedgcn"
        reads_edges = self.layer in _NEEDS_EDGES or (self.layer == "gps" and local != "gcn")
        if reads_edges and graphs.edges is None:
            name = self.layer if self.layer != "gps" else f"gps with gps_local={local!r}"
            raise ValueError(f"GNN: layer {name} needs edge features, got graphs.edges=None")

        precision = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = dense(self.hidden_dim, (None, "embed"), "node_encoder", **precision)(graphs.nodes)
        h = _mask_nodes(h, graphs)
        if reads_edges:
            encoder = dense(self.hidden_dim, (None, "embed"), "edge_encoder", **precision)
            edges = encoder(graphs.edges)
            graphs = graphs.replace(edges=jnp.where(graphs.edge_mask[..., None], edges, 0))

        options = {
            "gat": dict(num_heads=self.num_heads),
            "gatedgcn": dict(residual=self.residual),
            "gps": dict(num_heads=self.num_heads, local=local),
        }.get(self.layer, {})
        layer_class = LAYERS[self.layer]
        for index in range(self.num_layers):
            layer = layer_class(**options, **precision, name=f"layer_{index}")
            if getattr(layer_class, "updates_edges", False):
                h, edges = layer(graphs, h)
                graphs = graphs.replace(edges=edges)
            else:
                update = ACTIVATIONS[self.activation](layer(graphs, h))
                h = h + update if self.residual else update

        if headless and not self.is_initializing():
            return h
        # The head is made at init even when headless, so one set of params serves both.
        pooled = mean_pool(h, graphs.node_mask) if self.graph_level else h
        out = dense(self.out_dim, ("embed", None), "head", **precision)(pooled)
        out = out.astype(jnp.float32)
        if headless:
            return h
        return out if self.graph_level else _mask_nodes(out, graphs)
