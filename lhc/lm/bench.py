"""Decode benchmark of the LM family: measured throughput and the memory-bandwidth floor.

Measured on the current device, per config: prefill tokens/s, decode tokens/s with the
KV cache, and the baseline measured in the same run, decoding by recomputing the full
forward pass over the whole sequence every step (what the cache saves). For a named
real config at a long context (Llama-3.1-8B at 32K by default), decoding one token must
read every weight once per step and the whole KV cache of each sequence; the bytes moved
per decoded token and the resulting time floor at a given HBM bandwidth are reported.

    lhc bench lm-decode --configs tiny,lm_100m --hbm-gbps 819 --json out.json
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

from lhc.lm.cache import init_cache
from lhc.lm.config import LMConfig, get_preset
from lhc.lm.model import Transformer, abstract_params, count_params


def decode_bytes_per_token(
    config: LMConfig, context_len: int, batch_size: int = 1
) -> dict[str, float]:
    """Bytes read from memory per decoded token, and what bounds a decode step.

    One decode step reads every parameter once (shared by the batch) and each sequence's
    keys and values for all ``context_len`` cached tokens, in every layer.

    Returns:
        ``weight_bytes``, ``kv_cache_bytes_per_sequence``, ``bytes_per_step`` and
        ``bytes_per_token`` (``bytes_per_step / batch_size``).
    """
    weight_bytes = count_params(config) * jnp.dtype(config.param_dtype).itemsize
    kv_bytes = (
        2
        * config.num_layers
        * config.num_kv_heads
        * config.head_dim
        * context_len
        * jnp.dtype(config.dtype).itemsize
    )
    per_step = weight_bytes + batch_size * kv_bytes
    return dict(
        weight_bytes=float(weight_bytes),
        kv_cache_bytes_per_sequence=float(kv_bytes),
        bytes_per_step=float(per_step),
        bytes_per_token=float(per_step / batch_size),
    )


def _random_params(config: LMConfig, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    abstract = nn.meta.unbox(abstract_params(config))
    scale = config.embed_dim**-0.5
    return jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * scale, x.dtype), abstract
    )


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill(model, params, tokens, cache_len):
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = init_cache(model.config, batch, cache_len)
    logits, cache = model.apply({"params": params}, tokens, positions, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=(0, 4))
def _decode_cached(model, params, first_token, cache, steps):
    def step(carry, _):
        token, cache = carry
        positions = cache.lengths[:, None]
        logits, cache = model.apply({"params": params}, token[:, None], positions, cache)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return (token, cache), token

    _, tokens = jax.lax.scan(step, (first_token, cache), None, length=steps)
    return tokens.T


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _decode_recompute(model, params, prompt, steps, width):
    batch, prompt_len = prompt.shape
    buffer = jnp.zeros((batch, width), jnp.int32).at[:, :prompt_len].set(prompt)
    slots = jnp.arange(width, dtype=jnp.int32)

    def step(buffer, index):
        # Full forward over the fixed-width buffer; unfilled slots are padding.
        positions = jnp.broadcast_to(jnp.where(slots < index, slots, -1), (batch, width))
        logits, _ = model.apply({"params": params}, buffer, positions)
        last = jax.lax.dynamic_index_in_dim(logits, index - 1, axis=1, keepdims=False)
        token = jnp.argmax(last, axis=-1).astype(jnp.int32)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, token, index, axis=1)
        return buffer, token

    _, tokens = jax.lax.scan(step, buffer, prompt_len + jnp.arange(steps, dtype=jnp.int32))
    return tokens.T


def _best_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    name: str, config: LMConfig, batch_size: int, prompt_len: int, decode_steps: int, repeats: int
) -> dict[str, Any]:
    """Prefill and decode throughput of ``config`` on the default device."""
    model = Transformer(config)
    params = _random_params(config)
    prompt = jnp.asarray(
        np.random.default_rng(1).integers(0, config.vocab_size, (batch_size, prompt_len)), jnp.int32
    )
    width = prompt_len + decode_steps + 1
    if width > config.max_len:
        raise ValueError(
            f"--prompt-len {prompt_len} + --decode-steps {decode_steps} exceeds {name} max_len "
            f"{config.max_len}"
        )
    prefill_s = _best_time(lambda: _prefill(model, params, prompt, width), repeats)
    first_token, cache = _prefill(model, params, prompt, width)
    cached_s = _best_time(
        lambda: _decode_cached(model, params, first_token, cache, decode_steps), repeats
    )
    recompute_s = _best_time(
        lambda: _decode_recompute(model, params, prompt, decode_steps, width), repeats
    )
    cached_tokens = _decode_cached(model, params, first_token, cache, decode_steps)
    recompute_tokens = _decode_recompute(model, params, prompt, decode_steps, width)
    decode_tokens = batch_size * decode_steps
    return dict(
        config=name,
        num_params=count_params(config),
        dtype=config.dtype,
        batch_size=batch_size,
        prompt_len=prompt_len,
        decode_steps=decode_steps,
        prefill_s=prefill_s,
        prefill_tokens_per_s=batch_size * prompt_len / prefill_s,
        decode_s=cached_s,
        decode_tokens_per_s=decode_tokens / cached_s,
        recompute_decode_s=recompute_s,
        recompute_decode_tokens_per_s=decode_tokens / recompute_s,
        decode_speedup_vs_recompute=recompute_s / cached_s,
        # Greedy tokens of both paths agree except where near-ties flip an argmax.
        cached_matches_recompute=float(
            np.mean(np.asarray(cached_tokens)[:, :-1] == np.asarray(recompute_tokens)[:, 1:])
        ),
    )


def _config(name: str) -> LMConfig:
    if name == "tiny":
        return LMConfig.tiny()
    if name == "lm_100m":
        return LMConfig.lm_100m()
    return get_preset(name)


def _format_table(result: dict[str, Any]) -> str:
    lines = [
        f"device: {result['device']}",
        f"{'config':<12} {'params':>12} {'prefill tok/s':>14} {'decode tok/s':>13} "
        f"{'recompute tok/s':>16} {'cache speedup':>14}",
    ]
    for row in result["measured"]:
        lines.append(
            f"{row['config']:<12} {row['num_params']:>12,} {row['prefill_tokens_per_s']:>14,.0f} "
            f"{row['decode_tokens_per_s']:>13,.1f} {row['recompute_decode_tokens_per_s']:>16,.1f} "
            f"{row['decode_speedup_vs_recompute']:>13.2f}x"
        )
    a = result["analytic"]
    if a is not None:
        lines += [
            "",
            f"{a['config']} at context {a['context_len']:,}, batch {a['batch_size']}, "
            f"{a['hbm_gbps']:g} GB/s:",
            f"  weights            {a['weight_bytes'] / 1e9:10.3f} GB per step",
            f"  KV cache           {a['kv_cache_bytes_per_sequence'] / 1e9:10.3f} GB per sequence",
            f"  bytes per token    {a['bytes_per_token'] / 1e9:10.3f} GB "
            f"(KV cache / weights = {a['kv_cache_bytes_per_sequence'] / a['weight_bytes']:.2f})",
            f"  time floor         {a['time_floor_s_per_token'] * 1e3:10.3f} ms per token "
            f"({a['max_tokens_per_s']:,.1f} tok/s)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints a table and returns (and optionally writes) the results."""
    parser = argparse.ArgumentParser(
        prog="lhc bench lm-decode", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--configs", default="tiny,lm_100m", help="comma-separated configs to measure ('' for none)"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs after one warm-up; the best is kept"
    )
    parser.add_argument(
        "--real-config", default="llama3.1-8b", help="preset for the bandwidth floor ('' for none)"
    )
    parser.add_argument("--context-len", type=int, default=32_768)
    parser.add_argument(
        "--hbm-gbps", type=float, default=819.0, help="memory bandwidth in GB/s (v5e: 819)"
    )
    parser.add_argument("--json", default=None, help="write the results to this path")
    args = parser.parse_args(argv)
    for flag in ("batch_size", "prompt_len", "decode_steps", "repeats", "context_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.hbm_gbps > 0:
        parser.error("--hbm-gbps must be positive")

    measured = []
    for name in [n for n in args.configs.split(",") if n]:
        measured.append(
            measure(
                name,
                _config(name),
                args.batch_size,
                args.prompt_len,
                args.decode_steps,
                args.repeats,
            )
        )
    analytic = None
    if args.real_config:
        config = _config(args.real_config)
        if args.context_len > config.max_len:
            parser.error(
                f"--context-len {args.context_len} exceeds {args.real_config} max_len {config.max_len}"
            )
        analytic = dict(
            config=args.real_config,
            context_len=args.context_len,
            batch_size=args.batch_size,
            hbm_gbps=args.hbm_gbps,
            num_params=count_params(config),
            **decode_bytes_per_token(config, args.context_len, args.batch_size),
        )
        step_floor = analytic["bytes_per_step"] / (args.hbm_gbps * 1e9)
        analytic["time_floor_s_per_step"] = step_floor
        analytic["time_floor_s_per_token"] = step_floor / args.batch_size
        analytic["max_tokens_per_s"] = args.batch_size / step_floor
    result = dict(device=str(jax.devices()[0].device_kind), measured=measured, analytic=analytic)
    print(_format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
