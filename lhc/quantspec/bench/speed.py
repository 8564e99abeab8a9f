"""Measured decoding: greedy decoding from a prefilled cache at full precision, on the
8-bit target path and speculatively, one step of each path alone, and the full-precision
step's bytes against a streaming read measured in the run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench, lm
from lhc.quantspec import decoding, traffic
from lhc.quantspec.bench.loading import filler_prompts
from lhc.quantspec.weights import dequantize_params, quantize_params
from lhc.stats import markdown_table


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _forward(model, params, tokens, positions, cache):
    """One call of ``model`` on ``tokens [B, T]`` appended to ``cache`` (donated)."""
    logits, cache = model.apply({"params": params}, tokens, positions, cache)
    return logits, cache


def _prefilled(model, params, tokens, capacity: int, chunk: int):
    extra = capacity - tokens.shape[1]
    cache = lm.decoding.prefilled_cache(model, params, tokens, extra=extra, prefill_chunk=chunk)
    return jax.block_until_ready(cache)


def _step_seconds(model, params, cache, start: int, tokens: int, repeats: int, view=None) -> float:
    """The fastest of ``repeats`` calls appending ``tokens`` tokens at ``start`` to a
    copy of ``cache`` (read through ``view``), after one untimed call."""
    batch = cache.lengths.shape[0]
    ids = jnp.ones((batch, tokens), jnp.int32)
    positions = jnp.broadcast_to(start + jnp.arange(tokens), (batch, tokens))
    call = lambda c: _forward(model, params, ids, positions, c)  # noqa: E731
    return bench.timed(call, repeats, prepare=_copier(cache if view is None else view(cache)))[0]


def _copier(cache):
    """``prepare`` of ``lhc.bench.timed``: a fresh copy of a cache that calls donate."""
    return lambda: (jax.tree.map(jnp.copy, cache),)


def measure(
    model,
    params,
    prompt_lengths,
    *,
    new_tokens,
    gamma,
    group_size,
    batch,
    weights,
    tokenizer=None,
    filler=None,
    repeats: int = 2,
):
    """Per prompt length: decoding ``new_tokens`` from a prefilled cache three ways
    (full precision, the 8-bit target path, speculative), each prompt prefilled once
    per kind of cache (untimed) and every timed call made on a copy of it; one step of
    each path alone (a full-precision step, an 8-bit step, a draft step on the 4-bit
    view with the draft's weights, a verification of gamma + 1 tokens), and the bytes the
    traffic model says each must read (this model's dtype) over the time it took."""
    weight_group = decoding.default_weight_group_size(model.config, weights)
    draft = quantize_params(
        params,
        group_size=weight_group,
        layers=weights,
        symmetric=decoding.DEFAULT_WEIGHT_SYMMETRIC,
    )
    draft_weights = dequantize_params(draft)  # what a draft step reads, per round
    group_size = group_size or decoding.default_group_size(model.config)
    qmodel = decoding.quantspec_model(model, group_size=group_size)
    size = traffic.size_of_config(model.config)
    itemsize = jnp.dtype(model.config.dtype).itemsize
    read = bench.streaming_read(2**28)
    rows = []
    for length in prompt_lengths:
        prompts = filler_prompts(batch, length, tokenizer=tokenizer, filler=filler)
        head, last = prompts[:, :-1], prompts[:, -1:]
        capacity = length + new_tokens + 2 * gamma + 2
        caches = {
            "fp": _prefilled(model, params, head, capacity, 512),
            "quant": _prefilled(qmodel, params, head, capacity, group_size),
        }

        def plain(cache, last=last):
            return lm.generate(
                model,
                params,
                last,
                max_new_tokens=new_tokens,
                cache=cache,
                prefill_chunk=group_size,
            )

        def eight_bit(cache, last=last):
            return decoding.generate(
                model, params, last, max_new_tokens=new_tokens, cache=cache, group_size=group_size
            )

        def speculative(cache, last=last):
            return decoding.speculative_generate(
                model,
                params,
                last,
                gamma=gamma,
                group_size=group_size,
                draft_params=draft,
                max_new_tokens=new_tokens,
                target_cache=cache,
            )

        runs = {"fp": ("fp", plain), "int8": ("quant", eight_bit), "spec": ("quant", speculative)}
        seconds, outs = {}, {}
        for name, (kind, run) in runs.items():
            seconds[name], outs[name] = bench.timed(run, repeats, prepare=_copier(caches[kind]))
        start = length - 1
        steps = {
            "fp_step_s": _step_seconds(model, params, caches["fp"], start, 1, repeats),
            "int8_step_s": _step_seconds(qmodel, params, caches["quant"], start, 1, repeats),
            "draft_step_s": _step_seconds(
                qmodel, draft_weights, caches["quant"], start, 1, repeats, view=lambda c: c.draft()
            ),
            "verify_s": _step_seconds(qmodel, params, caches["quant"], start, gamma + 1, repeats),
        }
        caches.clear()
        bandwidth = max(read() for _ in range(3))
        plain, spec = outs["int8"], outs["spec"]
        n = np.asarray(plain.lengths)
        same = all(
            np.array_equal(np.asarray(spec.tokens)[b, : n[b]], np.asarray(plain.tokens)[b, : n[b]])
            for b in range(batch)
        )
        # The traffic model's bytes at 16 bits, scaled to this model's weights and cache.
        ideal = traffic.step_bytes(size, length, group_size=group_size, weights=weights)
        fp_bytes = ideal["ar"] * itemsize / 2
        generated = float(batch * new_tokens)
        rows.append(
            dict(
                prompt=length,
                batch=batch,
                new_tokens=new_tokens,
                gamma=gamma,
                fp_tok_s=generated / seconds["fp"],
                int8_tok_s=generated / seconds["int8"],
                spec_tok_s=generated / seconds["spec"],
                acceptance=float(spec.acceptance_rate),
                tokens_per_round=float(np.asarray(spec.lengths).mean())
                / max(int(spec.num_iterations), 1),
                speedup_vs_fp=seconds["fp"] / seconds["spec"],
                speedup_vs_int8=seconds["int8"] / seconds["spec"],
                same_tokens=same,
                **steps,
                fp_step_bytes=fp_bytes,
                fp_bandwidth_fraction=fp_bytes / steps["fp_step_s"] / bandwidth,
                bandwidth_gbps=bandwidth / 1e9,
            )
        )
    return rows


def measured_table(rows) -> str:
    columns = [
        ("prompt", "prompt"), ("full-precision tok/s", "fp_tok_s", ".1f"),
        ("8-bit tok/s", "int8_tok_s", ".1f"), ("speculative tok/s", "spec_tok_s", ".1f"),
        ("acceptance", "acceptance", ".3f"), ("tokens / round", "tokens_per_round", ".2f"),
        ("speedup vs full", "speedup_vs_fp", ".2fx"),
        ("speedup vs 8-bit", "speedup_vs_int8", ".2fx"),
        ("same tokens as 8-bit", "same_tokens"),
    ]  # fmt: skip
    steps = [
        ("prompt", "prompt"), ("full step ms", "fp_step_s", _ms), ("8-bit step ms", "int8_step_s", _ms),
        ("draft step ms", "draft_step_s", _ms), ("verify ms", "verify_s", _ms),
        ("full step bytes (model)", "fp_step_bytes", _mb),
        ("of the streaming read", "fp_bandwidth_fraction", "%"),
    ]  # fmt: skip
    return (
        markdown_table(columns, rows)
        + "\n\none step of each path alone (batch as above):\n"
        + markdown_table(steps, rows)
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.0f} MB"
