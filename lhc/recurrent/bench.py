"""Training throughput of the chunked recurrences against a sequential scan.

For each length T and each recurrence (SSD, GLA), one training pass (the forward pass
and the gradients of every input, the initial state included) is timed two ways in the
same run, jitted, after a warm-up call that compiles it:

* ``chunked``: ``lhc.recurrent.ssd`` / ``gla`` with ``--chunk-size``;
* ``scan``: ``lax.scan`` of ``ssd_step`` / ``gla_step`` over the T tokens.

Tokens per second count ``batch x T``; the table says whether both ways gave the same
outputs. Shapes: batch 2, 4 heads of Mamba-2's size for SSD (64 channels, state 128,
one group), 4 GLA heads with keys of 64 and values of 128 (GLA's values are twice its
keys).

    lhc bench recurrent --lengths 1024,4096
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc.lm.bench import best_time
from lhc.recurrent.scan import gla, gla_step, ssd, ssd_step

BATCH = 2


def _inputs(kind: str, length: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    r = np.random.default_rng(seed)
    normal = lambda *shape: r.normal(size=shape).astype(np.float32)  # noqa: E731
    b, t = BATCH, length
    if kind == "ssd":
        heads, p, n = 4, 64, 128
        dt = np.exp(r.normal(-2, 0.5, size=(b, t, heads))).astype(np.float32)
        a = -np.exp(r.normal(size=heads)).astype(np.float32)
        return (
            normal(b, t, heads, p),
            dt,
            a,
            normal(b, t, 1, n),
            normal(b, t, 1, n),
            normal(b, heads, p, n),
        )
    heads, dk, dv = 4, 64, 128
    gates = -np.exp(r.normal(-3, 1, size=(b, t, heads, dk))).astype(np.float32)
    return (
        normal(b, t, heads, dk),
        normal(b, t, heads, dk),
        normal(b, t, heads, dv),
        gates,
        normal(b, heads, dk, dv),
    )


def _sequential(kind: str):
    """The recurrence as a ``lax.scan`` of its one-token step."""

    def run(*args):
        if kind == "ssd":
            x, dt, a, b, c, state = args
            xs, step = (x, dt, b, c), lambda x, dt, b, c, s: ssd_step(x, dt, a, b, c, s)
        else:
            *xs, state = args
            step = gla_step

        def body(s, inputs):
            out, s = step(*inputs, s)
            return s, out

        final, outs = jax.lax.scan(body, state, tuple(jnp.moveaxis(v, 1, 0) for v in xs))
        return jnp.moveaxis(outs, 0, 1), final

    return run


def _chunked(kind: str, chunk_size: int):
    if kind == "ssd":
        return lambda x, dt, a, b, c, s: ssd(x, dt, a, b, c, chunk_size=chunk_size, initial_state=s)
    return lambda q, k, v, g, s: gla(q, k, v, g, chunk_size=chunk_size, initial_state=s)


def _training_pass(fn, num_args: int):
    """Jitted: the gradients of every input of ``sum(outputs) + sum(final state)``, and
    the outputs."""

    def loss(*args):
        out, final = fn(*args)
        return jnp.sum(out) + jnp.sum(final), out

    return jax.jit(jax.grad(loss, argnums=tuple(range(num_args)), has_aux=True))


def measure(
    lengths, chunk_size: int = 64, repeats: int = 3, kinds=("ssd", "gla")
) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        for length in lengths:
            args = _inputs(kind, length)
            row: dict[str, Any] = {"recurrence": kind, "length": length, "batch": BATCH}
            outputs = {}
            for name, fn in (("chunked", _chunked(kind, chunk_size)), ("scan", _sequential(kind))):
                step = _training_pass(fn, len(args))
                _, out = jax.block_until_ready(step(*args))  # compiles
                outputs[name] = np.asarray(out)
                seconds = best_time(lambda s=step, a=args: jax.block_until_ready(s(*a)), repeats)
                row[f"{name}_s"] = seconds
                row[f"{name}_tokens_per_s"] = BATCH * length / seconds
            row["speedup"] = row["chunked_tokens_per_s"] / row["scan_tokens_per_s"]
            row["same_outputs"] = bool(
                np.allclose(outputs["chunked"], outputs["scan"], rtol=1e-3, atol=1e-3)
            )
            rows.append(row)
    return rows


def table(rows) -> str:
    lines = [
        "| recurrence | length x batch | chunked tok/s | scan tok/s | speedup | same outputs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recurrence']} | {r['length']} x {r['batch']} | {r['chunked_tokens_per_s']:.0f} "
            f"| {r['scan_tokens_per_s']:.0f} | {r['speedup']:.1f}x | {r['same_outputs']} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lhc bench recurrent", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096", help="comma-separated sequence lengths")
    parser.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the fastest counts")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark; prints the table and the goal; returns the rows."""
    args = _parser().parse_args(argv)
    try:
        lengths = [int(v) for v in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths must be comma-separated ints, got {args.lengths!r}") from None
    if min(lengths) < 1:
        raise SystemExit(f"--lengths must be positive, got {args.lengths!r}")
    start = time.perf_counter()
    rows = measure(lengths, args.chunk_size, args.repeats)
    print(table(rows))
    for row in rows:
        if row["length"] == 4096:
            print(
                f"{row['recurrence']}: chunked / scan training at T = 4096: {row['speedup']:.1f}x (goal >= 5x)"
            )
    print(f"device: {jax.devices()[0].device_kind}; {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows
