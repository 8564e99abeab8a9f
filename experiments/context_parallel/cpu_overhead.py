"""What splitting the sequence costs on 8 host devices of one CPU: the loss and gradients
of a small Transformer at 8,192 tokens on one device against the sequence split 8 ways
(ring and all-gather attention), each timed after compiling, in one process.

    python experiments/context_parallel/cpu_overhead.py [--length 8192] [--repeats 3]

Appends one JSON line per setting to experiments/context_parallel/results/cpu_overhead.jsonl.
Host "devices" share the machine's cores and pass blocks by memory copies, so the figure
says what the split adds in work and copies on a CPU, not what a TPU's links would cost.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lhc import lm  # noqa: E402
from lhc.lm.costs import ring_attention_costs  # noqa: E402
from lhc.parallel import make_mesh, sequence_parallel_rules, zigzag_order  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "cpu_overhead.jsonl"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
            cwd=pathlib.Path(__file__).parent, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.length % 16:
        raise SystemExit(
            f"--length must be a multiple of 16 (8 devices x 2 chunks), got {args.length}"
        )

    shape = dict(vocab_size=512, num_layers=2, embed_dim=256, num_heads=4, num_kv_heads=2,
                 head_dim=64, mlp_dim=512, max_len=args.length, scan_layers=True)  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (1, args.length))
    targets = rng.integers(0, 512, (1, args.length))
    positions = np.arange(args.length)[None]
    rules = sequence_parallel_rules()
    params = lm.Transformer(lm.LMConfig(**shape)).init(
        jax.random.key(0), jnp.asarray(tokens[:, :16]), jnp.asarray(positions[:, :16])
    )["params"]
    params = nn.meta.unbox(params)

    rows = []
    for name, mesh_shape, impl in (
        ("one device", (1, 1, 1, 1), "chunked"),
        ("sequence 8, ring", (1, 1, 1, 8), "ring"),
        ("sequence 8, all-gather", (1, 1, 1, 8), "allgather"),
    ):
        config = lm.LMConfig(**shape, attention_impl=impl)
        model = lm.Transformer(config)
        devices = jax.devices()[: int(np.prod(mesh_shape))]
        mesh = make_mesh(mesh_shape, devices=devices)
        order = zigzag_order(args.length, mesh_shape[3])

        def loss(params, t, p, y, model=model):
            logits, _ = model.apply({"params": params}, t, p)
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()

        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            sharded = jax.device_put(params, lm.param_shardings(config, mesh, rules))
            step = jax.jit(jax.value_and_grad(loss))
            batch = [jnp.asarray(x[:, order]) for x in (tokens, positions, targets)]
            start = time.perf_counter()
            compiled = step.lower(sharded, *batch).compile()
            compile_s = time.perf_counter() - start
            jax.block_until_ready(compiled(sharded, *batch))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                value, _ = jax.block_until_ready(compiled(sharded, *batch))
                times.append(time.perf_counter() - start)
        sequence = mesh_shape[3]
        row = dict(
            setting=name, devices=len(devices), attention=impl, length=args.length,
            layers=shape["num_layers"], embed_dim=shape["embed_dim"],
            heads=shape["num_heads"], kv_heads=shape["num_kv_heads"],
            step_seconds=round(float(np.median(times)), 3),
            step_seconds_all=[round(t, 3) for t in times], compile_seconds=round(compile_s, 1),
            loss=float(value),
            ring_bytes_sent_per_device=(
                ring_attention_costs(config, args.length, sequence)["bytes_sent"]
                if impl == "ring" else 0
            ),
            cpu_count=os.cpu_count(), jax=jax.__version__, lhc_commit=_commit(),
            date=time.strftime("%Y-%m-%d"),
        )  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)

    base = rows[0]["step_seconds"]
    for row in rows:
        row["over_one_device"] = round(row["step_seconds"] / base, 2)
        # The same loss whatever the split: the settings compute one function.
        if abs(row["loss"] - rows[0]["loss"]) > 1e-4 * abs(rows[0]["loss"]):
            raise SystemExit(f"{row['setting']}: loss {row['loss']} != {rows[0]['loss']}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        print(f"{row['setting']:<24} {row['step_seconds']:7.2f} s  x{row['over_one_device']}")


if __name__ == "__main__":
    sys.exit(main())
