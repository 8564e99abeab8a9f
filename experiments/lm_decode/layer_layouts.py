"""How XLA reads a stack of layer weights in a batch-1 matvec chain, three ways.

    JAX_PLATFORMS=cpu python experiments/lm_decode/layer_layouts.py [--layers 30]

A decode step multiplies one activation row by every layer's weights; how the layers are
laid out decides whether a weight is read once or copied first. Each program here runs
``h = h + (h @ W_l)[:, :D] * 1e-3`` over ``L`` layers of ``[D, F]`` float32 weights
(SmolLM2's MLP shape by default) and reports the weight bytes per second against a
streaming read of a 1 GiB array in the same run, and the first call (compile) time:

* ``scan``: one ``[L, D, F]`` array scanned over (a scanned model's layout);
* ``unrolled``: ``L`` separate arrays, a Python loop (an unrolled model's layout);
* ``scan_switch``: ``L`` separate arrays and a scan whose body multiplies by
  ``lax.switch(l, [h @ W_0, ..., h @ W_{L-1}])``: one compiled layer body, each
  branch a single product that reads its own buffer.
"""

import argparse
import time

import jax
import jax.numpy as jnp


def _programs(layers: int, d: int, f: int):
    stacked = jnp.full((layers, d, f), 1e-3, jnp.float32)
    separate = [jnp.full((d, f), 1e-3, jnp.float32) for _ in range(layers)]

    def scan(x, stacked):
        def body(h, w):
            return h + (h @ w)[:, :d] * 1e-3, None

        return jax.lax.scan(body, x, stacked)[0]

    def unrolled(x, separate):
        h = x
        for w in separate:
            h = h + (h @ w)[:, :d] * 1e-3
        return h

    def scan_switch(x, separate):
        branches = [lambda h, w=w: h @ w for w in separate]

        def body(h, layer):
            return h + jax.lax.switch(layer, branches, h)[:, :d] * 1e-3, None

        return jax.lax.scan(body, x, jnp.arange(layers))[0]

    return {
        "scan": (jax.jit(scan), stacked),
        "unrolled": (jax.jit(unrolled), separate),
        "scan_switch": (jax.jit(scan_switch), separate),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--embed", type=int, default=576)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    x = jnp.ones((1, args.embed), jnp.float32)
    weight_bytes = args.layers * args.embed * args.hidden * 4
    data = jnp.ones((2**28,), jnp.float32)
    read = jax.jit(jnp.sum)
    read(data).block_until_ready()
    programs = _programs(args.layers, args.embed, args.hidden)
    first = {}
    for name, (fn, weights) in programs.items():
        start = time.perf_counter()
        fn(x, weights).block_until_ready()
        first[name] = time.perf_counter() - start
    best = dict.fromkeys([*programs, "read"], float("inf"))
    for _ in range(args.repeats):  # interleaved: a slow spell hits every program alike
        for name, (fn, weights) in programs.items():
            start = time.perf_counter()
            fn(x, weights).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - start)
        start = time.perf_counter()
        read(data).block_until_ready()
        best["read"] = min(best["read"], time.perf_counter() - start)
    bandwidth = data.nbytes / best["read"]
    print(f"streaming read: {bandwidth / 1e9:.1f} GB/s")
    print("| layout | weights GB/s | of the read | first call s |")
    print("|---|---:|---:|---:|")
    for name in programs:
        rate = weight_bytes / best[name]
        print(f"| {name} | {rate / 1e9:.1f} | {rate / bandwidth:.0%} | {first[name]:.2f} |")
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")


if __name__ == "__main__":
    main()
