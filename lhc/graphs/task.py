"""A GNN regressing a synthetic graph task, as a task of ``lhc train``, with the model's
range tracked at every evaluation.

One graph topology (``config.data.graph``), fresh features ``x ~ N(0, 1)`` per example;
the label is the synthetic task of ``lhc.graphs.synthetic``. ``evaluate`` reports the
held-out mean squared error and the four range variants (shortest-path or resistance
distance, normalised or not) of the model, averaged over ``eval_graphs`` feature draws,
beside the same variants for the task itself, so a run's ``metrics.jsonl`` holds the
model's range during training.

Config keys: ``data`` (``graph``: ``grid`` with ``rows``, ``cols``, or ``path`` with
``rows`` nodes; ``operator``, ``k``, ``interaction``, ``graph_level``, ``channels``,
``eval_graphs``, ``chunk_size``), ``model`` (``GNN`` fields), ``batch_size``, ``seed``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lhc.data.iterators import row_rngs
from lhc.graphs import synthetic
from lhc.graphs.batch import from_adjacencies
from lhc.graphs.distances import resistance_distances, shortest_path_distances
from lhc.graphs.influence import graph_influence, node_influence, range_measure
from lhc.graphs.models import GNN
from lhc.train.tasks import Task

_EVAL_SEED_OFFSET = 1_000_003  # held-out feature draws
VARIANTS = (("spd", True), ("spd", False), ("res", True), ("res", False))


def variant_name(distance: str, normalized: bool) -> str:
    return f"{distance}_{'norm' if normalized else 'raw'}"


def make_graph(data) -> np.ndarray:
    if data.graph == "grid":
        return synthetic.grid_graph(int(data.rows), int(data.cols))
    if data.graph == "path":
        return synthetic.path_graph(int(data.rows))
    raise ValueError(f"config.data.graph: expected 'grid' or 'path', got {data.graph!r}")


def ranges(influence, distances: dict) -> dict[str, float]:
    """The four range variants of one influence matrix."""
    return {
        variant_name(name, norm): range_measure(influence, distances[name], normalized=norm)
        for name, norm in VARIANTS
    }


class RangeTask(Task):
    def make_model(self):
        data = self.config.data
        self.adjacency = make_graph(data)
        self.num_nodes = self.adjacency.shape[0]
        # The padded topology, built once; every batch shares it with its own features.
        self._template = from_adjacencies([self.adjacency], [np.zeros((self.num_nodes, 1))])
        self.channels = int(data.channels)
        self.task_fn = synthetic.SyntheticTask(
            synthetic.operator(self.adjacency, data.operator, int(data.k)),
            data.interaction,
            bool(data.graph_level),
        )
        self.distances = {
            "spd": shortest_path_distances(self.adjacency),
            "res": resistance_distances(self.adjacency),
        }
        label = jax.eval_shape(self.task_fn, jnp.zeros((self.num_nodes, self.channels)))
        self.label_shape = label.shape
        fields = dict(self.config.model)
        return GNN(out_dim=label.shape[-1], graph_level=bool(data.graph_level), **fields)

    def _graphs(self, x: jax.Array):
        """The fixed topology with node features ``x[B, N, C]``."""
        template = self._template
        batch = x.shape[0]
        tile = lambda a: jnp.broadcast_to(a, (batch,) + a.shape[1:])  # noqa: E731
        return template.replace(
            nodes=x,
            senders=tile(template.senders),
            receivers=tile(template.receivers),
            node_mask=tile(template.node_mask),
            edge_mask=tile(template.edge_mask),
        )

    def _make_batch(self, seed, index, rows):
        x = np.stack(
            [
                rng.standard_normal((self.num_nodes, self.channels))
                for rng in row_rngs(seed, index, rows)
            ]
        ).astype(np.float32)
        y = np.asarray(jax.vmap(self.task_fn)(jnp.asarray(x)), np.float32)
        return {"x": x, "y": y}

    def batch_spec(self, batch_size):
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.num_nodes, self.channels), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size,) + self.label_shape, jnp.float32),
        }

    def init_params(self, rng):
        x = jnp.zeros((1, self.num_nodes, self.channels), jnp.float32)
        return self.model.init(rng, self._graphs(x))["params"]

    def train_iterator(self, process_index, process_count):
        return self.indexed_iterator(self._make_batch, process_index, process_count)

    def predict(self, params, x: jax.Array) -> jax.Array:
        """float[B, N, C] -> the model's labels, shaped like the task's."""
        return self.model.apply({"params": params}, self._graphs(x))

    def loss(self, params, batch, rng):
        del rng
        error = jnp.mean((self.predict(params, batch["x"]) - batch["y"]) ** 2)
        return error, {"mse": error}

    @functools.cached_property
    def _eval_data(self):
        count = int(self.config.data.eval_graphs)
        batch = self._make_batch(int(self.config.seed) + _EVAL_SEED_OFFSET, 0, range(count))
        influence = graph_influence if self.task_fn.graph_level else node_influence
        chunk = self.config.data.get("chunk_size", None)
        task = [influence(self.task_fn, jnp.asarray(x), chunk_size=chunk) for x in batch["x"]]
        task_ranges = [ranges(i, self.distances) for i in task]
        means = {key: float(np.mean([r[key] for r in task_ranges])) for key in task_ranges[0]}
        return batch, means

    def model_influence(self, params, x: jax.Array, chunk_size: int | None = None):
        """The model's influence matrix on one graph with features ``x[N, C]``."""
        fn = lambda z: self.predict(params, z[None])[0]  # noqa: E731
        influence = graph_influence if self.task_fn.graph_level else node_influence
        return influence(fn, x, chunk_size=chunk_size)

    def evaluate(self, params):
        batch, task_ranges = self._eval_data
        x = jnp.asarray(batch["x"])
        mse = float(jnp.mean((self.predict(params, x) - batch["y"]) ** 2))
        chunk = self.config.data.get("chunk_size", None)
        model = [ranges(self.model_influence(params, xi, chunk), self.distances) for xi in x]
        metrics = {"eval/mse": mse}
        for key in model[0]:
            metrics[f"eval/range_{key}"] = float(np.mean([r[key] for r in model]))
            metrics[f"eval/task_range_{key}"] = task_ranges[key]
        return metrics
