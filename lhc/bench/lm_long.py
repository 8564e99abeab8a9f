"""Long prompts on a real checkpoint: prefill time and decode speed at each prompt
length, lhc against transformers in the same run (``lhc bench lm --checkpoint C
--prompt-lens 4096,16384``).

The prompt is the first N tokens of real text (``--text FILE``; by default the King
James Bible when Debian's ``bible-kjv-text`` is installed, else generated English),
after the tokenizer's BOS when it adds one. For each length, one sequence:

* lhc: the prompt prefilled into the model's own cache (``model.init_cache``: for
  Gemma 3 a ``HybridKVCache``, rings in the local layers) in chunks of
  ``--prefill-chunk`` tokens, its first call timed apart (what compilation costs a user)
  and then the best of ``--repeats`` more; then ``--new-tokens`` greedy decode steps, each
  timed, tokens per second over all but the first (which compiles);
* transformers (same file, float32, as many threads as XLA's CPU client): the prompt
  prefilled in 2,048-token chunks into a ``DynamicCache`` with ``logits_to_keep=1``
  (one pass over 32K tokens does not fit in memory), then the same greedy steps.

The tokens of both are compared, and lhc's cache is weighed against a cache that keeps
every token in every layer. Each prefill's peak memory is how far it raises the
process's resident memory above where it started (``lhc.bench.peak_memory``: the cache,
the activations and any temporaries; the weights were already loaded): lhc's on its
last timed prefill (compiled), transformers' on its timed one. Each decode step is set
against the bytes it must read (every weight once, and the cached keys and values) and this machine's streaming-read
bandwidth, measured in the same run (a step reads every weight and every slot of the
cache, masked or not).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench
from lhc.lm.costs import prefill_flops
from lhc.lm.decoding import decode_step, prefill

BIBLE = ("bible", "-f", "Genesis1:1-Revelation22:21")


def long_text(path: str | None = None) -> str:
    """``path``'s text; else the King James Bible (Debian's ``bible-kjv-text``) when its
    ``bible`` command is installed; else generated English sentences."""
    if path:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    try:
        return subprocess.run(BIBLE, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        from lhc.data.topics import TOPICS, TopicTask

        texts, _ = TopicTask(topics=tuple(TOPICS), labels="names").sample(
            np.random.default_rng(0), 20_000
        )
        return " ".join(texts)


def _tree_bytes(tree) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


def _kv_bytes(cache) -> int:
    """Bytes of the keys and values a cache holds (its leaves with a ``cache_kv`` axis)."""
    sizes = jax.tree.map(
        lambda leaf, spec: leaf.nbytes if "cache_kv" in tuple(spec) else 0,
        cache,
        cache.logical_axes(),
    )
    return int(sum(jax.tree.leaves(sizes)))


def _full_cache_bytes(config, length: int) -> int:
    """Bytes of keys and values of ``length`` tokens in every layer."""
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * length * config.head_dim * itemsize


def _ours(ckpt, prompt: list[int], new_tokens: int, chunk: int, repeats: int) -> dict[str, Any]:
    model, params = ckpt.model, ckpt.params
    length = len(prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]

    def run():
        cache = model.init_cache(1, length + new_tokens)
        return prefill(model, params, tokens, positions, cache, chunk_size=chunk)

    start = time.perf_counter()
    with bench.compile_clock() as compiled:
        logits, cache = jax.block_until_ready(run())
    first = time.perf_counter() - start
    seconds, peak = first, None  # no peak without a compiled repeat
    for _ in range(repeats):  # after the first call, which compiled
        del logits, cache
        with bench.peak_memory() as held:  # a compiled prefill: activations and the cache
            start = time.perf_counter()
            logits, cache = jax.block_until_ready(run())
            seconds = min(seconds, time.perf_counter() - start)
        peak = held["bytes"]
    generated, steps = [int(jnp.argmax(logits[0]))], []  # logits [B, V]
    for index in range(new_tokens - 1):
        start = time.perf_counter()
        logits, cache = decode_step(
            model,
            params,
            jnp.asarray([[generated[-1]]], jnp.int32),
            jnp.asarray([[length + index]], jnp.int32),
            cache,
        )
        generated.append(int(jnp.argmax(logits[0])))
        steps.append(time.perf_counter() - start)
    decode = float(np.mean(steps[1:])) if len(steps) > 1 else float("nan")
    return {
        "lhc_prefill_s": seconds,
        "lhc_prefill_peak_bytes": peak,
        "lhc_first_prefill_s": first,
        "lhc_compile_s": compiled["seconds"],
        "lhc_decode_tokens_per_s": 1 / decode,
        "lhc_step_s": decode,
        "cache": type(cache).__name__,
        "cache_bytes": _kv_bytes(cache),
        "full_cache_bytes": _full_cache_bytes(model.config, length + new_tokens),
        "lhc_tokens": generated,
    }


def _theirs(torch, model, prompt: list[int], new_tokens: int, chunk: int = 2048) -> dict:
    import transformers

    with torch.no_grad(), bench.peak_memory() as held:
        start = time.perf_counter()
        cache = transformers.DynamicCache(config=model.config)
        for begin in range(0, len(prompt), chunk):
            out = model(
                torch.tensor([prompt[begin : begin + chunk]]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
        prefill_s = time.perf_counter() - start
    with torch.no_grad():
        generated, steps = [int(out.logits[0, -1].argmax())], []
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            out = model(
                torch.tensor([[generated[-1]]]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            generated.append(int(out.logits[0, -1].argmax()))
            steps.append(time.perf_counter() - start)
    decode = float(np.mean(steps[1:])) if len(steps) > 1 else float("nan")
    return {
        "transformers_prefill_s": prefill_s,
        "transformers_prefill_peak_bytes": held["bytes"],
        "transformers_decode_tokens_per_s": 1 / decode,
        "transformers_tokens": generated,
    }


def measure_long_prompts(
    checkpoint: str,
    prompt_lens,
    *,
    new_tokens: int = 32,
    prefill_chunk: int = 512,
    repeats: int = 1,
    text: str | None = None,
    against: bool = True,
    torch_threads: int | None = None,
    bandwidth_bytes: int = 2**30,
) -> dict[str, Any]:
    """One row per prompt length (see the module docstring).

    Raises:
        ValueError: a prompt length beyond the model's ``max_len`` or the text.
    """
    from lhc.lm.checkpoints import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    config = ckpt.config
    words = ckpt.tokenizer.encode(long_text(text))
    bos = [ckpt.tokenizer.bos_id] if getattr(ckpt.tokenizer, "add_bos_token", False) else []
    longest = max(prompt_lens) + new_tokens
    if longest > config.max_len or max(prompt_lens) > len(words) + len(bos):
        raise ValueError(
            f"--prompt-lens: {max(prompt_lens)} tokens and {new_tokens} new ones need "
            f"max_len {config.max_len} and a text of at least that many tokens "
            f"(it has {len(words)})"
        )
    torch = model = None
    if against:
        import torch
        import transformers

        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        path = os.fspath(ckpt.path)
        directory, name = os.path.split(path)
        kwargs = {"gguf_file": name} if path.endswith(".gguf") else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory if kwargs else path, dtype=torch.float32, **kwargs
        ).eval()
    read = bench.streaming_read(bandwidth_bytes)
    rows = []
    for length in prompt_lens:
        prompt = (bos + words)[:length]
        row = {"prompt_len": length, **_ours(ckpt, prompt, new_tokens, prefill_chunk, repeats)}
        row["bandwidth_gbps"] = read() / 1e9
        # The causal work of the prefill against this machine's float32 matmul rate.
        row["prefill_flops"] = prefill_flops(config, length)["total"]
        row["matmul_gflops"] = bench.matmul_rate() / 1e9
        row["fraction_of_matmul"] = (
            row["prefill_flops"] / row["lhc_prefill_s"] / (row["matmul_gflops"] * 1e9)
        )
        # A step reads every weight and every slot of the cache (masked or not).
        step_bytes = _tree_bytes(ckpt.params) + row["cache_bytes"]
        row["step_bytes"] = step_bytes
        row["fraction_of_bandwidth"] = (
            step_bytes / row["lhc_step_s"] / (row["bandwidth_gbps"] * 1e9)
        )
        if against:
            row.update(_theirs(torch, model, prompt, new_tokens))
            row["prefill_ratio"] = row["transformers_prefill_s"] / row["lhc_prefill_s"]
            row["decode_ratio"] = (
                row["lhc_decode_tokens_per_s"] / row["transformers_decode_tokens_per_s"]
            )
            row["same_tokens"] = row["lhc_tokens"] == row["transformers_tokens"]
        rows.append(row)
    return {"checkpoint": os.fspath(ckpt.path), "new_tokens": new_tokens, "rows": rows}


def long_prompt_table(result: dict[str, Any]) -> str:
    """A markdown table of ``measure_long_prompts``'s rows."""
    rows = [
        {
            **row,
            "cache_mb": row["cache_bytes"] / 1e6,
            "full_mb": row["full_cache_bytes"] / 1e6,
            **{
                f"{who}_peak_mb": row[f"{who}_prefill_peak_bytes"] / 1e6
                for who in ("lhc", "transformers")
                if row.get(f"{who}_prefill_peak_bytes") is not None
            },
        }
        for row in result["rows"]
    ]
    return bench.markdown_table(
        [
            ("prompt", "prompt_len", ","),
            ("lhc prefill s", "lhc_prefill_s", ".1f"),
            ("first call s", "lhc_first_prefill_s", ".1f"),
            ("compile s", "lhc_compile_s", ".1f"),
            ("transformers prefill s", "transformers_prefill_s", ".1f"),
            ("prefill x", "prefill_ratio", ".2fx"),
            ("lhc prefill peak MB", "lhc_peak_mb", ".0f"),
            ("transformers peak MB", "transformers_peak_mb", ".0f"),
            ("of matmul rate", "fraction_of_matmul", "%"),
            ("lhc decode tok/s", "lhc_decode_tokens_per_s", ".1f"),
            ("transformers tok/s", "transformers_decode_tokens_per_s", ".1f"),
            ("decode x", "decode_ratio", ".2fx"),
            ("of bandwidth", "fraction_of_bandwidth", "%"),
            ("same tokens", "same_tokens"),
            ("cache", "cache"),
            ("cache MB", "cache_mb", ".0f"),
            ("full cache MB", "full_mb", ".0f"),
        ],
        rows,
    )
