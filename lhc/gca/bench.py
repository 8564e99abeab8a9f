"""Decode cost of GCA against dense attention as the context grows.

For each context length, one sequence is brought to that length and then decodes
``--steps`` tokens greedily in one jitted loop; the time per token is the fastest of
``--repeats`` loops. Three models of the same width and depth, measured in the same run:

* GCA, its chunk memory in device memory;
* GCA with ``offload_memory`` (the chunk memory in host memory; on a CPU that is the
  same memory, so this row's time is the offload path's overhead, not a transfer);
* the dense ``lhc.lm.Transformer`` (full causal attention over the KV cache).

GCA reaches the context by a real chunked prefill of random tokens (its cost is linear
in the context). The dense cache is filled with random keys and values at that length
instead: a decode step reads every cached key and value whatever their values, and a
dense prefill to 256K would take hours on a CPU. Memory is that of a cache sized for
the context (and the tokens decoded), split by where it lives (``device`` / ``host``), from the arrays themselves; with
``--topology`` (for example ``v5e:2x2``; needs libtpu) the decode step is also compiled
for one chip of that TPU and its per-chip device and host bytes (arguments, outputs, temporaries) are
reported, as the TPU compiler plans them.

    lhc bench gca --contexts 1024,4096,16384,65536,262144 --topology v5e:2x2
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench
from lhc.gca.config import GCAConfig
from lhc.gca.model import GCA, init_params
from lhc.lm.cache import init_cache
from lhc.lm.config import LMConfig
from lhc.lm.decoding import prefill
from lhc.lm.model import Transformer
from lhc.lm.params import random_params

DEFAULT_CONTEXTS = (1024, 4096, 16_384, 65_536, 262_144)


def bench_configs(max_len: int) -> tuple[GCAConfig, LMConfig]:
    """GCA with the paper's geometry at width 256 (64-position chunks, top-8, window 513,
    2 lower layers, a 1-layer encoder, 2 upper layers) and the dense 4-layer model of the
    same width, heads and MLP."""
    gca = GCAConfig.paper_128m(
        vocab_size=512,
        embed_dim=256,
        num_heads=4,
        num_kv_heads=4,
        mlp_dim=768,
        lower_layers=2,
        encoder_layers=1,
        upper_layers=(2,),
        landmark_id=None,
        max_len=max_len,
    )
    dense = LMConfig(
        vocab_size=gca.vocab_size,
        num_layers=gca.lower_layers + sum(gca.upper_layers),
        embed_dim=gca.embed_dim,
        num_heads=gca.num_heads,
        num_kv_heads=gca.num_kv_heads,
        head_dim=gca.head_dim,
        mlp_dim=gca.mlp_dim,
        max_len=max_len,
    )
    return gca, dense


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnames="cache")
def _decode(model, params, token, cache, steps):
    """``steps`` greedy tokens after ``token`` [B]: ``(last token, cache)``."""

    def step(carry, _):
        return _step(model, params, *carry), None

    (token, cache), _ = jax.lax.scan(step, (token, cache), None, length=steps)
    return token, cache


def _step(model, params, token, cache):
    """One greedy token: ``(next token [B], cache)``."""
    positions = cache.next_positions()[:, None]
    logits, cache = model.apply({"params": params}, token[:, None], positions, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def cache_bytes(cache) -> dict[str, int]:
    """Bytes of the cache's arrays by memory kind (``device`` / ``host``)."""
    totals = {"device": 0, "host": 0}
    for leaf in jax.tree.leaves(cache):
        kind = "host" if leaf.sharding.memory_kind == "pinned_host" else "device"
        totals[kind] += leaf.nbytes
    return totals


def gca_state(config: GCAConfig, params, context: int, cache_len: int, seed: int = 0):
    """A one-sequence GCA cache after a chunked prefill of ``context`` random tokens."""
    model = GCA(config)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.landmark_id, (1, context)).astype(np.int32)
    positions = np.arange(context, dtype=np.int32)[None]
    cache = model.init_cache(1, cache_len)
    chunk = min(4096, context)
    logits, cache = prefill(
        model, params, jnp.asarray(tokens), jnp.asarray(positions), cache, chunk_size=chunk
    )
    return model, jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def dense_state(config: LMConfig, context: int, cache_len: int, seed: int = 0):
    """A one-sequence dense KV cache holding ``context`` tokens of random keys and values."""
    rng = np.random.default_rng(seed)
    cache = init_cache(config, 1, cache_len)
    fill = lambda store: jnp.asarray(
        rng.standard_normal(store.shape, np.float32).astype(store.dtype)
    )
    keys = jax.tree.map(fill, cache.keys)
    values = jax.tree.map(fill, cache.values)
    slots = np.arange(cache.capacity, dtype=np.int32)[None]
    cache = cache.replace(
        keys=keys,
        values=values,
        positions=jnp.asarray(np.where(slots < context, slots, -1)),
        lengths=jnp.full((1,), context, jnp.int32),
    )
    return Transformer(config), jnp.zeros((1,), jnp.int32), cache


@functools.cache
def _tpu_topology(name: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def tpu_step_memory(model, params, token, cache, topology: str) -> dict[str, int]:
    """Per-chip device and host bytes of one decode step compiled for ``topology``."""
    # A one-chip mesh: a NamedSharding carries the memory kind into the traced types.
    mesh = jax.sharding.Mesh(_tpu_topology(topology).devices[:1], ("chip",))

    def abstract(x):
        kind = "pinned_host" if x.sharding.memory_kind == "pinned_host" else "device"
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    args = jax.tree.map(abstract, (params, token, cache))
    # Under the mesh, Pallas kernels (gca_impl="pallas") lower for the TPU, not interpreted.
    with jax.set_mesh(mesh):
        lowered = jax.jit(functools.partial(_step, model), donate_argnums=2).lower(*args)
        compiled = lowered.compile()
    stats = compiled.memory_analysis()
    return {
        "device": stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes,
        "host": stats.host_argument_size_in_bytes
        + stats.host_output_size_in_bytes
        + stats.host_temp_size_in_bytes
        - stats.host_alias_size_in_bytes,
    }


def measure(
    contexts,
    steps: int,
    repeats: int,
    topology: str | None = None,
    dense_max: int = 262_144,
    configs: tuple[GCAConfig, LMConfig] | None = None,
) -> list[dict[str, Any]]:
    """One row per context: seconds per token and memory of GCA (offload off and on) and
    of dense attention (up to ``dense_max``); ``configs`` default to ``bench_configs``."""
    extra = steps * (repeats + 1) + 1  # the decoded tokens, warm-up loop included
    if configs is None:
        configs = bench_configs(max(contexts) + extra)
    gca_config, dense_config = configs
    gca_params = init_params(gca_config, jax.random.key(0))
    dense_params = random_params(dense_config)

    def states(context: int, cache_len: int):
        """``(name, params, model, token, cache)`` of each model, one at a time."""
        for name, offload in (("gca", False), ("gca_offload", True)):
            config = gca_config.replace(offload_memory=offload)
            yield name, gca_params, *gca_state(config, gca_params, context, cache_len)
        if context <= dense_max:
            yield "dense", dense_params, *dense_state(dense_config, context, cache_len)

    rows = []
    for context in contexts:
        row: dict[str, Any] = {"context": context}
        cache_len = context + extra  # each cache sized for its context
        for name, params, model, token, cache in states(context, cache_len):
            row[f"{name}_cache_bytes"] = cache_bytes(cache)
            if topology:
                row[f"{name}_tpu_step_bytes"] = tpu_step_memory(
                    model, params, token, cache, topology
                )
            # Each loop continues from the last one's token and (donated) cache.
            state = {"token": token, "cache": cache}

            def run(state=state, model=model, params=params):
                state["token"], state["cache"] = _decode(
                    model, params, state["token"], state["cache"], steps
                )
                return state["token"]

            row[f"{name}_s_per_token"] = bench.best_time(run, repeats) / steps
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table, with the ratios of the goals."""
    base = rows[0]["gca_s_per_token"]
    memory_key = "tpu_step_bytes" if "gca_tpu_step_bytes" in rows[0] else "cache_bytes"
    mib = lambda row, name, kind: row[f"{name}_{memory_key}"][kind] / 2**20
    shown = []
    for row in rows:
        gca, dense = row["gca_s_per_token"], row.get("dense_s_per_token")
        shown.append(
            dict(
                context=row["context"],
                gca_ms=1e3 * gca,
                vs_first=gca / base,
                offload_ms=1e3 * row["gca_offload_s_per_token"],
                dense_ms=None if dense is None else 1e3 * dense,
                dense_vs_gca=None if dense is None else dense / gca,
                gca_mib=mib(row, "gca", "device"),
                offload_mib=mib(row, "gca_offload", "device"),
                offload_host_mib=mib(row, "gca_offload", "host"),
                dense_mib=mib(row, "dense", "device") if f"dense_{memory_key}" in row else None,
            )
        )
    columns = [
        ("context", "context"), ("GCA ms/token", "gca_ms", ".2f"),
        ("vs first", "vs_first", ".2fx"),
        ("GCA offload ms/token", "offload_ms", ".2f"), ("dense ms/token", "dense_ms", ".2f"),
        ("dense / GCA", "dense_vs_gca", ".1fx"), ("GCA device MiB", "gca_mib", ".1f"),
        ("GCA offload device MiB", "offload_mib", ".1f"),
        ("GCA offload host MiB", "offload_host_mib", ".1f"),
        ("dense device MiB", "dense_mib", ".1f"),
    ]  # fmt: skip
    what = (
        "one decode step compiled for the TPU (per chip)"
        if memory_key == "tpu_step_bytes"
        else "the cache's arrays"
    )
    return f"{bench.markdown_table(columns, shown)}\n\nMemory columns: {what}."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the rows, the table and the goals; returns ``{"rows": rows}``."""
    parser = bench.parser("gca", __doc__)
    parser.add_argument(
        "--contexts",
        type=bench.int_list,
        default=list(DEFAULT_CONTEXTS),
        help="comma-separated context lengths; the first is the reference of 'vs first'",
    )
    parser.add_argument("--steps", type=int, default=16, help="decoded tokens per timed loop")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops (the best counts)")
    parser.add_argument(
        "--dense-max", type=int, default=262_144, help="longest context measured for dense"
    )
    parser.add_argument(
        "--topology", default=None, help="also compile each step for this TPU topology"
    )
    args = parser.parse_args(argv)
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    start = time.perf_counter()
    rows = measure(args.contexts, args.steps, args.repeats, args.topology, args.dense_max)
    print(table(rows))
    first, last = rows[0], rows[-1]
    print(
        f"GCA per token at {last['context']} / at {first['context']}: "
        f"{last['gca_s_per_token'] / first['gca_s_per_token']:.2f}x (goal <= 1.5x)"
    )
    for row in rows:
        if row["context"] == 65_536 and "dense_s_per_token" in row:
            print(
                f"dense / GCA per token at 65536: "
                f"{row['dense_s_per_token'] / row['gca_s_per_token']:.1f}x (goal >= 10x)"
            )
    print(f"{time.perf_counter() - start:.0f} s in all")
    return bench.finish({"rows": rows}, args)
