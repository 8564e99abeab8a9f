"""How much of the streaming-read bandwidth XLA reaches on the decode step's matvecs alone.

    JAX_PLATFORMS=cpu python experiments/lm_decode/matvec_floor.py [--config lm_100m]

Times, on the current device, one jitted program that multiplies a batch-1 activation
by every weight matrix of the config (attention, MLP and the output embedding, in both
kernel layouts) and sets the bytes read against a streaming read of a 1 GiB array: the
ceiling that a decode step made of these matvecs could reach here.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from lhc import lm


def weight_shapes(config):
    """``(in, out)`` of every matrix a decode step multiplies by."""
    d, h = config.embed_dim, config.head_dim
    attention = [
        (d, config.num_heads * h),
        (d, 2 * config.num_kv_heads * h),
        (config.num_heads * h, d),
    ]
    mlp = [(d, config.mlp_dim), (d, config.mlp_dim), (config.mlp_dim, d)]
    return (attention + mlp) * config.num_layers + [(d, config.vocab_size)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="lm_100m")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    config = lm.get_preset(args.config)
    data = jnp.ones((2**28,), jnp.float32)
    read = jax.jit(jnp.sum)
    programs = {"read": (read, (data,), data.nbytes)}
    for layout in ("in_out", "out_in"):
        shapes = weight_shapes(config)
        weights = [
            jnp.full((i, o) if layout == "in_out" else (o, i), 1e-3, jnp.float32) for i, o in shapes
        ]
        inputs = [jnp.ones((1, i), jnp.float32) for i, _ in shapes]

        def chain(inputs, weights, layout=layout):
            # Each product feeds the sum, so none is skipped.
            products = [
                (x @ w) if layout == "in_out" else (w @ x[0]) for x, w in zip(inputs, weights)
            ]
            return sum(p.sum() for p in products)

        programs[layout] = (jax.jit(chain), (inputs, weights), sum(w.nbytes for w in weights))
    # Interleaved, the best of each: a slow spell of a shared machine hits all alike.
    times = {name: [] for name in programs}
    for fn, fn_args, _ in programs.values():
        jax.block_until_ready(fn(*fn_args))
    for _ in range(args.repeats):
        for name, (fn, fn_args, _) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[name].append(time.perf_counter() - start)
    rate = {name: programs[name][2] / min(times[name]) for name in programs}
    print(f"{args.config}: streaming read {rate['read'] / 1e9:.2f} GB/s")
    for layout in ("in_out", "out_in"):
        seconds = min(times[layout])
        print(
            f"  {layout}: {programs[layout][2] / 1e6:.0f} MB of weights in {seconds * 1e3:.1f} ms, "
            f"{rate[layout] / 1e9:.2f} GB/s = {rate[layout] / rate['read']:.0%} of the read"
        )


if __name__ == "__main__":
    main()
