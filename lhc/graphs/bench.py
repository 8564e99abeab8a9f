"""Chunked GNN influence against the full Jacobian or Hessian: time and memory.

For each grid of ``side x side`` nodes, a GCN with skips and GELUs (``--layers``
layers, width ``--width``, random weights, 1 input and ``--out-channels`` output
channels; GELU because a ReLU network's Hessian is zero almost everywhere) and its
node-level influence (``|Jacobian|`` summed over channels), computed two ways in the
same run: ``full`` (``jax.jacrev``, the whole ``[N, D, N, C]`` Jacobian at once) and
``chunked`` (blocks of ``--chunk-size`` VJPs under ``lax.map``). With ``--hessian-sides``
the same for the graph-level influence (``jax.hessian`` of the mean-pooled output
against blocks of Hessian-vector products). Time: the fastest of ``--repeats`` calls of
the compiled function after an untimed one. Memory: XLA's buffer assignment for the
compiled call (temporaries plus output, from ``compiled.memory_analysis()``), the peak
the call needs beyond its inputs. The table says whether both ways agree
(``max |difference| / max |full|``).

    lhc bench graphs --sides 8,16,24,32 --hessian-sides 8,12,16
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lhc import bench
from lhc.graphs.batch import from_adjacencies
from lhc.graphs.influence import graph_influence, node_influence
from lhc.graphs.models import GNN
from lhc.graphs.synthetic import grid_graph


def _model_fn(
    side: int, layers: int, width: int, out_channels: int, graph_level: bool, seed: int = 0
):
    adjacency = grid_graph(side, side)
    n = side * side
    graphs = from_adjacencies([adjacency], [np.zeros((n, 1), np.float32)])
    model = GNN(
        layer="gcn",
        num_layers=layers,
        hidden_dim=width,
        out_dim=out_channels,
        residual=True,
        graph_level=graph_level,
        activation="gelu",
    )
    params = model.init(jax.random.key(seed), graphs)["params"]

    def fn(x):
        return model.apply({"params": params}, graphs.replace(nodes=x[None]))[0]

    x = jax.random.normal(jax.random.key(seed + 1), (n, 1))
    return fn, x


def _measure(influence, fn, x, chunk_size, repeats) -> dict:
    out = {}
    results = {}
    for name, chunk in (("full", None), ("chunked", chunk_size)):
        compiled = (
            jax.jit(lambda z, chunk=chunk: influence(fn, z, chunk_size=chunk)).lower(x).compile()
        )
        memory = compiled.memory_analysis()
        peak = None if memory is None else memory.temp_size_in_bytes + memory.output_size_in_bytes
        out[f"{name}_s"], result = bench.timed(compiled, repeats, prepare=lambda: (x,))
        out[f"{name}_bytes"] = peak
        results[name] = np.asarray(result)
    scale = max(float(np.abs(results["full"]).max()), 1e-30)
    out["relative_difference"] = float(np.abs(results["full"] - results["chunked"]).max() / scale)
    return out


def measure(
    sides, hessian_sides, *, layers, width, out_channels, chunk_size, repeats
) -> list[dict]:
    rows = []
    for kind, kind_sides in (("jacobian", sides), ("hessian", hessian_sides)):
        for side in kind_sides:
            graph_level = kind == "hessian"
            fn, x = _model_fn(side, layers, width, out_channels, graph_level)
            influence = graph_influence if graph_level else node_influence
            row = dict(kind=kind, nodes=side * side, side=side)
            row.update(_measure(influence, fn, x, chunk_size, repeats))
            rows.append(row)
    return rows


def table(rows, args) -> str:
    mib = lambda value: None if value is None else value / 2**20  # noqa: E731
    shown = [
        {
            **r,
            "time_ratio": r["full_s"] / r["chunked_s"],
            "full_mib": mib(r["full_bytes"]),
            "chunked_mib": mib(r["chunked_bytes"]),
            "memory_ratio": r["full_bytes"] / r["chunked_bytes"]
            if r["full_bytes"] and r["chunked_bytes"]
            else None,
        }
        for r in rows
    ]
    columns = [
        ("influence", "kind"), ("nodes", "nodes"), ("full s", "full_s", ".3f"),
        ("chunked s", "chunked_s", ".3f"), ("time ratio", "time_ratio", ".2fx"),
        ("full MiB", "full_mib", ".1f"), ("chunked MiB", "chunked_mib", ".1f"),
        ("memory ratio", "memory_ratio", ".1fx"), ("rel. diff", "relative_difference", ".1e"),
    ]  # fmt: skip
    return "\n\n".join(
        [
            f"GCN with skips and GELUs, {args.layers} layers, width {args.width}, "
            f"{args.out_channels} output channels, random weights; chunk size {args.chunk_size}",
            bench.markdown_table(columns, shown),
            "time ratio = full / chunked (above 1: chunked faster); memory ratio the same; "
            "no memory figure where XLA gives none",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the table; returns the ``rows`` and the ``settings``."""
    p = bench.parser("graphs", __doc__)
    p.add_argument(
        "--sides", type=bench.int_list, default=[8, 16, 24, 32], help="grid sides (Jacobian)"
    )
    p.add_argument(
        "--hessian-sides", type=bench.int_list, default=[8, 12, 16], help="grid sides (Hessian)"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out-channels", type=int, default=4, help="output channels")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    settings = dict(
        layers=args.layers,
        width=args.width,
        out_channels=args.out_channels,
        chunk_size=args.chunk_size,
        repeats=args.repeats,
    )
    rows = measure(args.sides, args.hessian_sides, **settings)
    print(table(rows, args))
    return bench.finish({"rows": rows, "settings": settings}, args)
