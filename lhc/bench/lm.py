"""Decode benchmark of the LM family: measured throughput and the memory-bandwidth floor.

Measured on the current device, per config: prefill tokens/s, decode tokens/s with the
KV cache, and the baseline measured in the same run, decoding by recomputing the full
forward pass over the whole sequence every step (what the cache saves). For a named
real config at a long context (Llama-3.1-8B at 32K by default), decoding one token must
read every weight once per step and the whole KV cache of each sequence; the bytes moved
per decoded token and the resulting time floor at a given HBM bandwidth are reported.

    lhc bench lm --configs tiny,lm_100m --hbm-gbps 819 --json out.json

``--against transformers`` compares lhc's greedy decoding with ``transformers``'
``generate`` on the same random checkpoint (``lm_100m`` by default, written once as
safetensors and read by both), at each ``--batch-sizes``, in one run: tokens/s of each,
the ratio, whether the tokens agree, and at batch 1 the fraction of this machine's memory
bandwidth that lhc's decode steps reach (the bandwidth measured in the same run by a
streaming read of a 1 GiB array). ``--prefill-len N`` measures, in a fresh process, the
peak memory of prefilling one N-token prompt with the chunked attention.

    lhc bench lm --against transformers --batch-sizes 1,8 --prefill-len 32768

``--checkpoint`` (a Hugging Face directory, a GGUF file or ``smollm2-135m-instruct``)
measures a real model instead of ``--configs``, and compares it with transformers
(which reads the same file) instead of ``--against-config``; ``--workdir`` measures the
``lhc.lm.Transformer`` of an lhc run instead of ``--configs``; ``--scan-layers 1,0,switch``
adds lhc's layer layouts to the kernel layouts (``1`` scanned: stacked weights, one
compiled block; ``0`` unrolled: an array per layer, looped; ``switch``: an array per
layer, one compiled block choosing them by ``lax.switch``, ``LMConfig.switch_layers``),
and the first call of each (lhc compiles there) is reported::

    lhc bench lm --checkpoint smollm2-135m-instruct --configs "" --real-config "" \
        --against transformers --batch-sizes 1,8 --scan-layers 1,0

``--prompt-lens`` (with ``--checkpoint``) measures long prompts instead: prefill and decode
after each length, against transformers in the same run (``lhc.bench.lm_long``)::

    lhc bench lm --checkpoint gemma3-270m --prompt-lens 4096,16384,32768 \
        --against transformers --new-tokens 32 --repeats 1
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench
from lhc.lm import gguf, hf
from lhc.lm.cache import init_cache
from lhc.lm.config import LMConfig, get_preset
from lhc.lm.costs import decode_bytes_per_token
from lhc.lm.decoding import generate, prefill
from lhc.lm.model import Transformer
from lhc.lm.params import count_params, init_params, random_params


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


def _model_facts(name: str, config: LMConfig) -> dict[str, Any]:
    return dict(config=name, num_params=count_params(config), dtype=config.dtype)


def measure(
    name: str,
    config: LMConfig,
    batch_size: int,
    prompt_len: int,
    decode_steps: int,
    repeats: int,
    params: Any = None,
) -> dict[str, Any]:
    """Prefill and decode throughput of ``config`` on the default device, with
    ``params`` (random when None)."""
    model = Transformer(config)
    params = random_params(config) if params is None else params
    prompt = jnp.asarray(
        np.random.default_rng(1).integers(0, config.vocab_size, (batch_size, prompt_len)), jnp.int32
    )
    width = prompt_len + decode_steps + 1
    if width > config.max_len:
        raise ValueError(
            f"--prompt-len {prompt_len} + --decode-steps {decode_steps} exceeds {name} max_len "
            f"{config.max_len}"
        )
    prefill_s = bench.best_time(lambda: _prefill(model, params, prompt, width), repeats)
    first_token, cache = _prefill(model, params, prompt, width)
    cached_s = bench.best_time(
        lambda: _decode_cached(model, params, first_token, cache, decode_steps), repeats
    )
    recompute_s = bench.best_time(
        lambda: _decode_recompute(model, params, prompt, decode_steps, width), repeats
    )
    cached_tokens = _decode_cached(model, params, first_token, cache, decode_steps)
    recompute_tokens = _decode_recompute(model, params, prompt, decode_steps, width)
    decode_tokens = batch_size * decode_steps
    return dict(
        **_model_facts(name, config),
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


def _agreement(ours: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    """Equal tokens overall, and the mean length of the equal prefix per row (greedy
    decodings that differ once, at a near-tie, differ after it too)."""
    equal = ours == theirs
    first_difference = np.where(equal.all(1), equal.shape[1], np.argmin(equal, axis=1))
    return dict(
        tokens_equal=float(equal.mean()),
        equal_prefix=float(first_difference.mean()),
        all_equal=bool(equal.all()),
    )


# --scan-layers values: how the layers are laid out and run.
LAYER_MODES = {"1": "scanned", "0": "unrolled", "switch": "switched"}


def _variant_name(layout: str, layers: str) -> str:
    return f"{layout}, {layers}"


def _transformers_model(path: str):
    """transformers' model of a Hugging Face directory or a GGUF file, float32."""
    import torch
    import transformers

    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _both_models(checkpoint, config, seed, variants):
    """``(config, {variant: (Transformer, params)}, transformers model)`` of one checkpoint:
    ``checkpoint``, else random weights of ``config`` saved as safetensors."""
    from lhc.lm.checkpoints import resolve_checkpoint

    models = {}
    with tempfile.TemporaryDirectory() as directory:
        if checkpoint is None:
            # The model's own initialisation (unit norms, fan-in scaled weights): logits
            # with a clear argmax, so that both decodings can agree token for token.
            hf.save(config, jax.device_get(init_params(config, jax.random.key(seed))), directory)
            path = directory
        else:
            path = resolve_checkpoint(checkpoint)
        load = gguf.load if path.endswith(".gguf") else hf.load
        for layout, layers in variants:
            config, params = load(
                path,
                jnp.float32,
                kernel_layout=layout,
                scan_layers=layers == "scanned",
                switch_layers=layers == "switched",
            )
            models[_variant_name(layout, layers)] = (Transformer(config), params)
        return config, models, _transformers_model(path)


def _rates(best, impl, batch_size: int, new_tokens: int) -> dict[str, float]:
    """End-to-end and per-step rates of ``impl`` from the best times of ``new_tokens`` and
    of one token."""
    total, first = best[(impl, new_tokens)], best[(impl, 1)]
    step = (total - first) / (new_tokens - 1)
    return dict(
        s=total,
        tokens_per_s=batch_size * new_tokens / total,
        decode_step_s=step,
        decode_tokens_per_s=batch_size / step,
    )


def compare_with_transformers(
    name: str,
    config: LMConfig | None,
    batch_sizes: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    seed: int = 0,
    bandwidth_bytes: int = 2**30,
    kernel_layouts: tuple[str, ...] = ("in_out", "out_in"),
    layers: tuple[str, ...] = ("unrolled",),
    checkpoint: str | None = None,
    torch_threads: int | None = None,
) -> dict[str, Any]:
    """Greedy decoding of lhc and of ``transformers.generate`` on the same checkpoint.

    Both read one checkpoint: ``checkpoint`` (a Hugging Face directory, a GGUF file or a
    named pretrained model), else a safetensors checkpoint of random weights of
    ``config``. lhc runs in each of ``kernel_layouts`` (``out_in`` keeps the checkpoint's
    own ``[out, in]`` weights) and ``layers`` modes (``LAYER_MODES``' values: unrolled,
    scanned, switched). All generate ``new_tokens`` after a random ``prompt_len`` prompt,
    timed end to end (prefill included) as the best of ``repeats`` interleaved runs
    after a first call, which is timed apart (lhc compiles there). The decode steps
    alone are timed too (``generate`` of ``new_tokens`` minus ``generate`` of one token,
    per step); at batch 1 lhc's step is set against the bytes it must read (every weight
    and the cached keys and values) and the measured bandwidth. torch runs with
    ``torch_threads`` threads (default: as many as XLA's CPU client uses, the cores).

    Returns:
        A dict with one row per batch size and lhc variant.
    """
    import torch
    import transformers

    torch.set_num_threads(torch_threads or os.cpu_count() or 1)
    variants = [(layout, mode) for layout in kernel_layouts for mode in layers]
    config, models, torch_model = _both_models(checkpoint, config, seed, variants)
    # The bandwidth is read between the timed runs too, so that it sees the same machine.
    read = bench.streaming_read(bandwidth_bytes)
    bandwidths = [read() for _ in range(repeats)]
    rows = []
    for batch_size in batch_sizes:
        prompt = np.random.default_rng(seed + batch_size).integers(
            0, config.vocab_size, (batch_size, prompt_len)
        )

        def ours(steps, layout, prompt=prompt):
            model, model_params = models[layout]
            return np.asarray(generate(model, model_params, prompt, max_new_tokens=steps).tokens)

        def theirs(steps, layout=None, prompt=prompt):
            with torch.no_grad():
                return torch_model.generate(
                    torch.tensor(prompt),
                    attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                    max_new_tokens=steps,
                    min_new_tokens=steps,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )[:, prompt_len:].numpy()

        # Every implementation, full length and one token, interleaved; the best of each.
        impls = {"transformers": functools.partial(theirs, layout=None)}
        impls.update({variant: functools.partial(ours, layout=variant) for variant in models})
        tokens, first_call_s = {}, {}
        for impl, run in impls.items():  # the first call: lhc compiles here
            start = time.perf_counter()
            tokens[impl] = run(new_tokens)
            first_call_s[impl] = time.perf_counter() - start
        best = bench.interleaved_best(
            {
                (impl, steps): functools.partial(run, steps)
                for impl, run in impls.items()
                for steps in (new_tokens, 1)
            },
            repeats,
            between=lambda: bandwidths.append(read()),
        )
        rates = {impl: _rates(best, impl, batch_size, new_tokens) for impl in impls}
        theirs_rates = rates["transformers"]
        bandwidth = max(bandwidths)
        for (layout, mode), variant in zip(variants, models):
            row = dict(
                batch_size=batch_size,
                kernel_layout=layout,
                layers=mode,
                lhc_first_call_s=first_call_s[variant],
                transformers_first_call_s=first_call_s["transformers"],
            )
            row.update({f"lhc_{key}": value for key, value in rates[variant].items()})
            row.update({f"transformers_{key}": value for key, value in theirs_rates.items()})
            row["speedup"] = row["transformers_s"] / row["lhc_s"]
            row["decode_speedup"] = row["transformers_decode_step_s"] / row["lhc_decode_step_s"]
            row.update(_agreement(tokens[variant], tokens["transformers"]))
            if batch_size == 1:
                context = prompt_len + new_tokens / 2
                step_bytes = decode_bytes_per_token(config, int(context), 1)["bytes_per_step"]
                row.update(
                    bytes_per_step=step_bytes,
                    bandwidth_fraction=step_bytes / row["lhc_decode_step_s"] / bandwidth,
                )
            rows.append(row)
    return dict(
        **_model_facts(name, config),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        measured_bandwidth_gbps=max(bandwidths) / 1e9,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        torch_threads=torch.get_num_threads(),
        rows=rows,
    )


_PREFILL_WORKER = """
import json, resource, sys, time
from lhc.bench import lm
print("RESULT " + json.dumps(lm._prefill_worker(*json.loads(sys.argv[1]))))
"""


def _prefill_worker(name: str, prompt_len: int, chunk_size: int, impl: str) -> dict[str, Any]:
    import resource

    config = _config(name).replace(max_len=max(prompt_len, 1), attention_impl=impl)
    params = random_params(config)
    model = Transformer(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, prompt_len)))
    positions = jnp.arange(prompt_len, dtype=jnp.int32)[None]
    cache = init_cache(config, 1, prompt_len)
    compiled = prefill.lower(model, params, tokens, positions, cache, chunk_size=chunk_size)
    analysis = compiled.compile().memory_analysis()
    start = time.perf_counter()
    logits, cache = prefill(model, params, tokens, positions, cache, chunk_size=chunk_size)
    jax.block_until_ready((logits, cache))
    seconds = time.perf_counter() - start
    return dict(
        config=name,
        prompt_len=prompt_len,
        chunk_size=chunk_size,
        attention_impl=impl,
        seconds=seconds,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        compiled_temp_bytes=int(analysis.temp_size_in_bytes),
        cache_bytes=int(sum(x.nbytes for x in jax.tree.leaves(cache))),
        finite=bool(np.isfinite(np.asarray(logits)).all()),
    )


def measure_prefill_memory(name: str, prompt_len: int, chunk_size: int, impl: str) -> dict:
    """Peak resident memory of prefilling one prompt, measured in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", _PREFILL_WORKER, json.dumps([name, prompt_len, chunk_size, impl])],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"prefill measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def comparison_table(result: dict[str, Any]) -> str:
    """The markdown table of ``compare_with_transformers``'s result, under a line naming
    the model, the versions and the measured bandwidth."""
    rows = [
        {**row, "variant": _variant_name(row["kernel_layout"], row["layers"])}
        for row in result["rows"]
    ]
    columns = [
        ("batch", "batch_size"), ("lhc kernels, layers", "variant"),
        ("lhc", "lhc_tokens_per_s", ".1f"), ("transformers", "transformers_tokens_per_s", ".1f"),
        ("ratio", "speedup", ".2fx"), ("lhc decode", "lhc_decode_tokens_per_s", ".1f"),
        ("tr. decode", "transformers_decode_tokens_per_s", ".1f"),
        ("ratio", "decode_speedup", ".2fx"), ("tokens equal", "tokens_equal", ".3f"),
        ("bandwidth", "bandwidth_fraction", "%"), ("lhc 1st call s", "lhc_first_call_s", ".1f"),
    ]  # fmt: skip
    return "\n".join(
        [
            f"{result['config']} ({result['num_params']:,} params, {result['dtype']}), prompt "
            f"{result['prompt_len']}, {result['new_tokens']} new tokens, greedy; torch "
            f"{result['torch_version']} ({result['torch_threads']} threads), transformers "
            f"{result['transformers_version']}; measured bandwidth "
            f"{result['measured_bandwidth_gbps']:.2f} GB/s",
            "tok/s end to end (prefill included) and of the decode steps alone; the first call "
            "(lhc compiles there) timed apart:",
            bench.markdown_table(columns, rows),
        ]
    )


def _config(name: str) -> LMConfig:
    if name == "tiny":
        return LMConfig.tiny()
    if name == "lm_100m":
        return LMConfig.lm_100m()
    return get_preset(name)


def _format_table(result: dict[str, Any]) -> str:
    columns = [
        ("config", "config"), ("params", "num_params", ","),
        ("prefill tok/s", "prefill_tokens_per_s", ",.0f"),
        ("decode tok/s", "decode_tokens_per_s", ",.1f"),
        ("recompute tok/s", "recompute_decode_tokens_per_s", ",.1f"),
        ("cache speedup", "decode_speedup_vs_recompute", ".2fx"),
    ]  # fmt: skip
    lines = [bench.markdown_table(columns, result["measured"])]
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


def _bandwidth_floor(args, parser) -> dict[str, Any]:
    """The bytes each decoding step reads for ``--real-config`` and the time floor they
    set at ``--hbm-gbps``."""
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
    return analytic


def _parser():
    parser = bench.parser("lm", __doc__)
    parser.add_argument(
        "--configs",
        type=lambda text: bench.str_list(text) if text else [],
        default=["tiny", "lm_100m"],
        help="comma-separated configs to measure ('' for none)",
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
    parser.add_argument(
        "--against",
        default=None,
        choices=["transformers"],
        help="compare greedy decoding with transformers.generate on the same checkpoint",
    )
    parser.add_argument("--against-config", default="lm_100m")
    parser.add_argument("--batch-sizes", type=bench.int_list, default=[1, 8], help="for --against")
    parser.add_argument(
        "--kernel-layouts",
        type=bench.str_list,
        default=["in_out", "out_in"],
        help="lhc kernel layouts, for --against",
    )
    parser.add_argument(
        "--scan-layers",
        type=bench.str_list,
        default=["0"],
        help="lhc layers scanned (1), unrolled (0) or switched (switch), for --against",
    )
    bench.add_model_source(
        parser,
        workdir_help="an lhc run of an lhc.lm.Transformer, measured instead of --configs",
        required=False,
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads for --against (default: the cores, as XLA's CPU client uses)",
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="for --against")
    parser.add_argument(
        "--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth read"
    )
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=0,
        help="measure the peak memory of prefilling a prompt this long (0: skip)",
    )
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefill-impl", default="chunked")
    parser.add_argument(
        "--prompt-lens",
        type=bench.int_list,
        default=None,
        help="with --checkpoint: prefill and decode after prompts of these lengths "
        "(lhc.bench.lm_long; against transformers with --against transformers)",
    )
    parser.add_argument("--text", default=None, help="for --prompt-lens: a text file")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the tables and returns (and optionally writes) the results."""
    parser = _parser()
    args = parser.parse_args(argv)
    for flag in ("batch_size", "prompt_len", "decode_steps", "repeats", "context_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.hbm_gbps > 0:
        parser.error("--hbm-gbps must be positive")
    if not set(args.scan_layers) <= set(LAYER_MODES):
        parser.error(
            f"--scan-layers must be among {', '.join(LAYER_MODES)}; got {','.join(args.scan_layers)}"
        )

    if args.prompt_lens:
        if not args.checkpoint:
            parser.error("--prompt-lens needs --checkpoint")
        from lhc.bench.lm_long import long_prompt_table, measure_long_prompts

        try:
            long = measure_long_prompts(
                args.checkpoint,
                args.prompt_lens,
                new_tokens=args.new_tokens,
                prefill_chunk=args.prefill_chunk,
                repeats=args.repeats,
                text=args.text,
                against=args.against == "transformers",
                torch_threads=args.torch_threads,
                bandwidth_bytes=args.bandwidth_mib * 2**20,
            )
        except (FileNotFoundError, ValueError) as error:
            parser.error(str(error))
        print(long_prompt_table(long))
        return bench.finish({"long_prompts": long}, args)

    measured = []
    source = args.checkpoint or args.workdir
    for name in [] if source else args.configs:
        try:
            config = _config(name)
        except ValueError as error:
            parser.error(f"--configs: {error} (a checkpoint goes in --checkpoint)")
        measured.append(
            measure(name, config, args.batch_size, args.prompt_len, args.decode_steps, args.repeats)
        )
    if source:
        loaded = bench.load_model_source(args)
        if not isinstance(loaded.model, Transformer):
            parser.error(f"--workdir: a {type(loaded.model).__name__}, not an lhc.lm.Transformer")
        measured.append(
            measure(
                source,
                loaded.model.config,
                args.batch_size,
                args.prompt_len,
                args.decode_steps,
                args.repeats,
                params=loaded.params,
            )
        )
    analytic = _bandwidth_floor(args, parser) if args.real_config else None
    result = dict(device=str(jax.devices()[0].device_kind), measured=measured, analytic=analytic)
    print(_format_table(result))
    if args.against == "transformers":
        if args.new_tokens < 2:
            parser.error("--new-tokens must be >= 2")
        comparison = compare_with_transformers(
            args.checkpoint or args.against_config,
            None if args.checkpoint else _config(args.against_config),
            tuple(args.batch_sizes),
            args.prompt_len,
            args.new_tokens,
            args.repeats,
            bandwidth_bytes=args.bandwidth_mib * 2**20,
            kernel_layouts=tuple(args.kernel_layouts),
            layers=tuple(LAYER_MODES[value] for value in args.scan_layers),
            checkpoint=args.checkpoint,
            torch_threads=args.torch_threads,
        )
        result["against_transformers"] = comparison
        print()
        print(comparison_table(comparison))
    if args.prefill_len:
        memory = measure_prefill_memory(
            args.against_config, args.prefill_len, args.prefill_chunk, args.prefill_impl
        )
        result["prefill_memory"] = memory
        print()
        print(
            f"prefill of {memory['prompt_len']:,} tokens ({memory['config']}, chunks of "
            f"{memory['chunk_size']}, attention {memory['attention_impl']}): peak RSS "
            f"{memory['peak_rss_bytes'] / 2**30:.2f} GiB (cache {memory['cache_bytes'] / 2**30:.2f}"
            f" GiB, compiled temporaries {memory['compiled_temp_bytes'] / 2**30:.2f} GiB), "
            f"{memory['seconds']:.1f} s"
        )
    return bench.finish(result, args)


if __name__ == "__main__":
    main()
