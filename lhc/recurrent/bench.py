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

Then, with ``--positions``, the decode step of a Mamba-2 LM and a GLA LM (4 layers,
width 256, random weights): the time per generated token and the cache's bytes at each
position, one sequence, greedy, ``--steps`` tokens in one jitted loop (the fastest of
``--repeats``). A recurrent cache is brought to a position by setting its counters and
filling its states with random values: what a step costs does not depend on how the
state was reached, and a real prefill to 1M tokens would take hours on a CPU.

    lhc bench recurrent --lengths 1024,4096 --positions 1024,32768,1048576
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.bench import best_time
from lhc.recurrent.gla_lm import GLALM, GLAConfig
from lhc.recurrent.mamba2 import Mamba2Config, Mamba2LM
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


def decode_models(size: str = "small") -> dict[str, Any]:
    """The two recurrent LMs of the decode rows: 4 layers of width 256 (``small``), or 1
    layer of width 32 (``tiny``, for tests)."""
    layers, width, head, state = (4, 256, 64, 128) if size == "small" else (1, 32, 8, 8)
    return {
        "mamba2": Mamba2LM(Mamba2Config(vocab_size=512, num_layers=layers, embed_dim=width,
                                        head_dim=head, state_dim=state)),
        "gla": GLALM(GLAConfig(vocab_size=512, num_layers=layers, embed_dim=width, num_heads=4,
                               key_dim=head, value_dim=2 * head, mlp_dim=2 * width)),
    }  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 4))
def _decode(model, params, token, cache, steps):
    def step(_, carry):
        token, cache = carry
        position = cache.next_positions()[:, None]
        logits, cache = model.apply({"params": params}, token, position, cache)
        return jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, step, (token, cache))


def measure_decode(positions, steps: int = 32, repeats: int = 3, size: str = "small"):
    """Decode rows; the positions of a model are timed in turns (``repeats`` rounds over
    all of them, the fastest of each counts), so a drift of the machine's speed during
    the run does not fall on one position."""
    rows = []
    for name, model in decode_models(size).items():
        one = jnp.zeros((1, 1), jnp.int32)
        params = nn.meta.unbox(model.init(jax.random.key(0), one, one)["params"])
        runs = []
        for position in positions:
            cache = model.init_cache(1)
            r = np.random.default_rng(position)
            cache = cache.replace(
                states={k: jnp.asarray(r.normal(size=v.shape), v.dtype) for k, v in cache.states.items()},
                lengths=jnp.full((1,), position, jnp.int32),
                top=jnp.full((1,), position - 1, jnp.int32),
                top_before=jnp.full((1,), position - 1, jnp.int32),
            )  # fmt: skip
            run = functools.partial(_decode, model, params, one, cache, steps)
            jax.block_until_ready(run())  # compiles
            runs.append((position, cache, run))
        best = {position: float("inf") for position in positions}
        for _ in range(repeats):
            for position, _, run in runs:
                start = time.perf_counter()
                jax.block_until_ready(run())
                best[position] = min(best[position], time.perf_counter() - start)
        for position, cache, _ in runs:
            row = {
                "model": name,
                "position": position,
                "ms_per_token": 1e3 * best[position] / steps,
            }
            row["cache_bytes"] = sum(x.nbytes for x in jax.tree.leaves(cache))
            rows.append(row)
    return rows


def decode_table(rows) -> str:
    lines = ["| model | position | ms / token | cache (KiB) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['position']} | {r['ms_per_token']:.3f} | {r['cache_bytes'] / 1024:.0f} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--positions", default="", help="comma-separated decode positions")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per loop")
    parser.add_argument("--size", choices=("small", "tiny"), default="small", help="decode models")
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
    try:
        positions = [int(v) for v in args.positions.split(",")] if args.positions else []
    except ValueError:
        raise SystemExit(
            f"--positions must be comma-separated ints, got {args.positions!r}"
        ) from None
    if positions and min(positions) < 1:
        raise SystemExit(f"--positions must be positive, got {args.positions!r}")
    start = time.perf_counter()
    rows = measure(lengths, args.chunk_size, args.repeats)
    print(table(rows))
    for row in rows:
        if row["length"] == 4096:
            print(
                f"{row['recurrence']}: chunked / scan training at T = 4096: {row['speedup']:.1f}x (goal >= 5x)"
            )
    if positions:
        decode = measure_decode(positions, args.steps, args.repeats, args.size)
        print(decode_table(decode))
        for name in sorted({r["model"] for r in decode}):
            times = [r["ms_per_token"] for r in decode if r["model"] == name]
            ratio = max(times) / min(times)
            print(f"{name}: slowest / fastest step over the positions: {ratio:.2f}x (goal <= 1.2x)")
        rows = rows + decode
    print(f"device: {jax.devices()[0].device_kind}; {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows
