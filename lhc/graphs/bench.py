"""``lhc bench range``: chunked influence against the full Jacobian or Hessian.

For each grid of ``side x side`` nodes, a GCN with skips and GELUs (``--layers``
layers, width ``--width``, random weights, 1 input and ``--out`` output channels; GELU
because a ReLU network's Hessian is zero almost everywhere) and its node-level
influence (``|Jacobian|`` summed over channels), computed two ways in the same run:
``full`` (``jax.jacrev``, the whole ``[N, D, N, C]`` Jacobian at once) and ``chunked``
(blocks of ``--chunk-size`` VJPs under ``lax.map``). With ``--hessian-sides`` the same
for the graph-level influence (``jax.hessian`` of the mean-pooled output against blocks
of Hessian-vector products). Time: the fastest of ``--repeats`` jitted calls after a
compiling one. Memory: XLA's buffer assignment for the compiled call (temporaries plus
output, from ``compiled.memory_analysis()``), the peak the call needs beyond its inputs.
The table says whether both ways agree (``max |difference| / max |full|``).

    lhc bench range --sides 8,16,24,32 --hessian-sides 8,12,16
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from lhc.bench import best_time
from lhc.graphs.batch import from_adjacencies
from lhc.graphs.influence import graph_influence, node_influence
from lhc.graphs.models import GNN
from lhc.graphs.synthetic import grid_graph


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _model_fn(side: int, layers: int, width: int, out: int, graph_level: bool, seed: int = 0):
    adjacency = grid_graph(side, side)
    n = side * side
    graphs = from_adjacencies([adjacency], [np.zeros((n, 1), np.float32)])
    model = GNN(layer="gcn", num_layers=layers, hidden_dim=width, out_dim=out,
                residual=True, graph_level=graph_level, activation="gelu")  # fmt: skip
    params = model.init(jax.random.key(seed), graphs)["params"]

    def fn(x):
        return model.apply({"params": params}, graphs.replace(nodes=x[None]))[0]

    x = jax.random.normal(jax.random.key(seed + 1), (n, 1))
    return fn, x


def _measure(influence, fn, x, chunk_size, repeats) -> dict:
    out = {}
    results = {}
    for name, chunk in (("full", None), ("chunked", chunk_size)):
        call = jax.jit(lambda z, chunk=chunk: influence(fn, z, chunk_size=chunk))
        compiled = call.lower(x).compile()
        memory = compiled.memory_analysis()
        peak = None if memory is None else memory.temp_size_in_bytes + memory.output_size_in_bytes
        out[f"{name}_s"] = best_time(lambda call=call: call(x), repeats)
        out[f"{name}_bytes"] = peak
        results[name] = np.asarray(call(x))
    scale = max(float(np.abs(results["full"]).max()), 1e-30)
    out["relative_difference"] = float(np.abs(results["full"] - results["chunked"]).max() / scale)
    return out


def measure(sides, hessian_sides, *, layers, width, out, chunk_size, repeats) -> list[dict]:
    rows = []
    for kind, kind_sides in (("jacobian", sides), ("hessian", hessian_sides)):
        for side in kind_sides:
            graph_level = kind == "hessian"
            fn, x = _model_fn(side, layers, width, out, graph_level)
            influence = graph_influence if graph_level else node_influence
            row = dict(kind=kind, nodes=side * side, side=side)
            row.update(_measure(influence, fn, x, chunk_size, repeats))
            rows.append(row)
    return rows


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def table(rows, args) -> str:
    lines = [
        f"GCN with skips and GELUs, {args.layers} layers, width {args.width}, {args.out} output channels, "
        f"random weights; chunk size {args.chunk_size}; {jax.devices()[0].platform}",
        f"{'influence':>9} {'nodes':>6} {'full s':>8} {'chunked s':>10} {'time ratio':>10} "
        f"{'full MiB':>9} {'chunked MiB':>12} {'memory ratio':>12} {'rel. diff':>9}",
    ]
    for r in rows:
        memory_ratio = (
            "n/a"
            if not r["full_bytes"] or not r["chunked_bytes"]
            else f"{r['full_bytes'] / r['chunked_bytes']:.1f}x"
        )
        lines.append(
            f"{r['kind']:>9} {r['nodes']:>6} {r['full_s']:>8.3f} {r['chunked_s']:>10.3f} "
            f"{r['full_s'] / r['chunked_s']:>9.2f}x {_mib(r['full_bytes']):>9} "
            f"{_mib(r['chunked_bytes']):>12} {memory_ratio:>12} {r['relative_difference']:>9.1e}"
        )
    lines.append("time ratio = full / chunked (above 1: chunked faster); memory ratio the same")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="lhc bench range", description=__doc__.splitlines()[0])
    p.add_argument("--sides", type=_ints, default=(8, 16, 24, 32), help="grid sides (Jacobian)")
    p.add_argument("--hessian-sides", type=_ints, default=(8, 12, 16), help="grid sides (Hessian)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", type=int, default=4, help="output channels")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = measure(args.sides, args.hessian_sides, layers=args.layers, width=args.width,
                   out=args.out, chunk_size=args.chunk_size, repeats=args.repeats)  # fmt: skip
    print(table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, args=vars(args)), f, indent=1)
    return rows
