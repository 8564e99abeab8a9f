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

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench
from lhc.recurrent.config import GLAConfig, Mamba2Config
from lhc.recurrent.gla_lm import GLALM
from lhc.recurrent.mamba2 import Mamba2LM
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
                seconds, (_, out) = bench.timed(step, repeats, prepare=lambda a=args: a)
                outputs[name] = np.asarray(out)
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
        "mamba2": Mamba2LM(
            Mamba2Config(
                vocab_size=512, num_layers=layers, embed_dim=width, head_dim=head, state_dim=state
            )
        ),
        "gla": GLALM(
            GLAConfig(
                vocab_size=512,
                num_layers=layers,
                embed_dim=width,
                num_heads=4,
                key_dim=head,
                value_dim=2 * head,
                mlp_dim=2 * width,
            )
        ),
    }


@functools.partial(jax.jit, static_argnums=(0, 4))
def _decode(model, params, token, cache, steps):
    def step(_, carry):
        token, cache = carry
        position = cache.next_positions()[:, None]
        logits, cache = model.apply({"params": params}, token, position, cache)
        return jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, step, (token, cache))


def measure_decode(positions, steps: int = 32, repeats: int = 3, size: str = "small"):
    """Decode rows; the positions of a model are timed in turns
    (``bench.interleaved_best``), so a drift of the machine's speed during the run does
    not fall on one position."""
    rows = []
    for name, model in decode_models(size).items():
        one = jnp.zeros((1, 1), jnp.int32)
        params = nn.meta.unbox(model.init(jax.random.key(0), one, one)["params"])
        caches, runs = {}, {}
        for position in positions:
            cache = model.init_cache(1)
            r = np.random.default_rng(position)
            caches[position] = cache.replace(
                states={
                    k: jnp.asarray(r.normal(size=v.shape), v.dtype) for k, v in cache.states.items()
                },
                lengths=jnp.full((1,), position, jnp.int32),
                top=jnp.full((1,), position - 1, jnp.int32),
                top_before=jnp.full((1,), position - 1, jnp.int32),
            )
            runs[position] = functools.partial(_decode, model, params, one, caches[position], steps)
        best = bench.interleaved_best(runs, repeats)
        for position, cache in caches.items():
            rows.append(
                {
                    "model": name,
                    "position": position,
                    "ms_per_token": 1e3 * best[position] / steps,
                    "cache_bytes": sum(x.nbytes for x in jax.tree.leaves(cache)),
                }
            )
    return rows


def decode_table(rows) -> str:
    return bench.markdown_table(
        [
            ("model", "model"),
            ("position", "position"),
            ("ms / token", "ms_per_token", ".3f"),
            ("cache (KiB)", "cache_bytes", lambda b: f"{b / 1024:.0f}"),
        ],
        rows,
    )


def table(rows) -> str:
    shown = [{**r, "shape": f"{r['length']} x {r['batch']}"} for r in rows]
    return bench.markdown_table(
        [("recurrence", "recurrence"), ("length x batch", "shape"),
         ("chunked tok/s", "chunked_tokens_per_s", ".0f"),
         ("scan tok/s", "scan_tokens_per_s", ".0f"), ("speedup", "speedup", ".1fx"),
         ("same outputs", "same_outputs")],
        shown,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the tables and the goals; returns ``rows`` (training
    passes) and ``decode`` (decode steps, with ``--positions``)."""
    parser = bench.parser("recurrent", __doc__)
    parser.add_argument(
        "--lengths", type=bench.int_list, default=[1024, 4096], help="sequence lengths"
    )
    parser.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the fastest counts")
    parser.add_argument(
        "--positions",
        type=bench.int_list,
        default=[],
        help="decode positions (default: no decode rows)",
    )
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per loop")
    parser.add_argument("--size", choices=("small", "tiny"), default="small", help="decode models")
    args = parser.parse_args(argv)
    rows = measure(args.lengths, args.chunk_size, args.repeats)
    print(table(rows))
    for row in rows:
        if row["length"] == 4096:
            print(
                f"{row['recurrence']}: chunked / scan training at T = 4096: {row['speedup']:.1f}x (goal >= 5x)"
            )
    decode = []
    if args.positions:
        decode = measure_decode(args.positions, args.steps, args.repeats, args.size)
        print(f"\n{decode_table(decode)}")
        for name in sorted({r["model"] for r in decode}):
            times = [r["ms_per_token"] for r in decode if r["model"] == name]
            ratio = max(times) / min(times)
            print(f"{name}: slowest / fastest step over the positions: {ratio:.2f}x (goal <= 1.2x)")
    return bench.finish({"rows": rows, "decode": decode}, args)
