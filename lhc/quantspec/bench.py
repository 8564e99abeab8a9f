"""QuantSpec: the predicted memory traffic of named configs, and measured decoding.

First, for each ``--configs`` model at each ``--contexts`` length: the bytes a plain
decoding step, a draft step (4-bit MLP only, as the official code, or every linear layer)
and a verification pass read, and the predicted speedup at ``--acceptance`` with
``--gamma`` drafts (``lhc.quantspec.traffic``; an upper bound).

Then, with ``--workdir`` (a model trained by ``lhc train``, e.g.
``configs/quantspec_passkey.py``), ``--checkpoint`` or ``--random`` (random weights of
that config's shape, ``lhc.quantspec.PASSKEY_MODEL``), for each ``--prompt-lengths``:
``--batch`` prompts of generated filler text or of ``--filler`` text files, prefilled once
per kind of cache (untimed), then greedy decoding of ``--new-tokens`` from a copy of that
cache three ways, each timed after an untimed call of the same shapes:
``lhc.lm.generate`` on a full-precision cache (the baseline), ``quantspec.generate``'s
8-bit target path and ``quantspec.speculative_generate``; the acceptance rate, tokens per
round, the speedups, and whether the speculative tokens equal the 8-bit path's. Then one
step of each path alone (full precision, 8-bit, a draft step on the 4-bit view with the
draft's weights, a verification of gamma + 1 tokens) and the full-precision step's bytes
(the traffic model in this model's dtype) against a streaming read measured in the run.

With ``--drafts`` (and a model), the acceptance of draft variants, ``--batch`` prompts
per ``--prompt-lengths`` (decoded together), each ``--gammas`` and ``--temperatures`` (0: greedy): a draft is
``kv4`` or ``kv8`` (the cache read at 4 bits, QuantSpec's draft, or at 8 bits, the
target's reading), optionally ``+<rtn|gptq>-<sym|asym>-<group>[-all]`` (INT4 weights
rounded to nearest or with GPTQ, symmetric or with a minimum per group, the MLP or every
linear layer; without it the draft has the target's weights). GPTQ calibrates on
``--calibration`` (rows x tokens) of the same prompt text, drawn with another seed.

    lhc bench quantspec --checkpoint smollm2-135m-instruct --filler book.txt \
        --prompt-lengths 1024 --drafts kv4,kv8+rtn-sym-64,kv4+gptq-sym-64 --gammas 4

With ``--kernel-contexts``, the attention over the quantized store (4-bit and 8-bit, one
decode token and a verification of 7) against bfloat16 attention over the same context,
one layer of Llama-2 shape: the Pallas kernel on a TPU or GPU, its XLA reference on a
CPU (``kernel_rows``).

    lhc bench quantspec --workdir /tmp/quantspec_passkey --prompt-lengths 512,2048,8192
"""

from __future__ import annotations

import argparse
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench, lm
from lhc.quantspec import decoding, traffic
from lhc.quantspec.gptq import calibrate
from lhc.quantspec.weights import dequantize_params, quantize_params


def traffic_rows(configs, contexts, *, gamma: int, acceptance: float, group_size: int = 128):
    rows = []
    for name in configs:
        size = traffic.NAMED[name]
        for context in contexts:
            mlp = traffic.step_bytes(size, context, group_size=group_size, weights="mlp")
            full = traffic.step_bytes(size, context, group_size=group_size, weights="all")
            speed = {
                w: traffic.predicted_speedup(
                    size,
                    context,
                    gamma=gamma,
                    acceptance=acceptance,
                    group_size=group_size,
                    weights=w,
                )
                for w in ("mlp", "all")
            }
            rows.append(
                dict(
                    config=name,
                    context=context,
                    ar_gb=mlp["ar"] / 1e9,
                    draft_mlp_gb=mlp["draft"] / 1e9,
                    draft_all_gb=full["draft"] / 1e9,
                    verify_gb=mlp["verify"] / 1e9,
                    speedup_mlp=speed["mlp"],
                    speedup_all=speed["all"],
                )
            )
    return rows


def traffic_table(rows, gamma, acceptance) -> str:
    predicted = f"predicted speedup, gamma {gamma}, a {acceptance:g}"
    columns = [
        ("config", "config"), ("context", "context"), ("AR GB", "ar_gb", ".1f"),
        ("draft GB (MLP 4-bit)", "draft_mlp_gb", ".1f"), ("draft GB (all)", "draft_all_gb", ".1f"),
        ("verify GB", "verify_gb", ".1f"), (f"{predicted} (MLP)", "speedup_mlp", ".2fx"),
        (f"{predicted} (all)", "speedup_all", ".2fx"),
    ]  # fmt: skip
    return bench.markdown_table(columns, rows)


def load_model(
    workdir: str | None,
    random_seed: int | None,
    checkpoint: str | None = None,
    dtype: str | None = None,
):
    """``(model, params, tokenizer)``: an imported checkpoint's (in ``dtype``), a trained
    run's (``lhc.bench.load_model_source``: SystemExit with one line when missing), or
    random weights of ``lhc.quantspec.PASSKEY_MODEL`` (byte tokens)."""
    if checkpoint is not None or workdir is not None:
        source = argparse.Namespace(checkpoint=checkpoint, workdir=workdir, dtype=dtype)
        loaded = bench.load_model_source(source)
        return loaded.model, loaded.params, loaded.tokenizer
    params = lm.init_params(decoding.PASSKEY_MODEL, jax.random.key(random_seed or 0))
    return lm.Transformer(decoding.PASSKEY_MODEL), params, lm.ByteTokenizer()


def filler_prompts(batch: int, length: int, seed: int = 0, tokenizer=None, filler=None):
    """``batch`` prompts of ``length`` filler tokens (``lhc.data.passkey.Filler``: the
    generated filler, or snippets of text files) in ``tokenizer``'s tokens (bytes)."""
    from lhc.data.passkey import Filler

    tokenizer = tokenizer or lm.ByteTokenizer()
    source = filler or Filler()
    rng = np.random.default_rng(seed)
    return np.stack([source.tokens(tokenizer, rng, length) for _ in range(batch)]).astype(np.int32)


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
        bench.markdown_table(columns, rows)
        + "\n\none step of each path alone (batch as above):\n"
        + bench.markdown_table(steps, rows)
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.0f} MB"


def parse_draft(spec: str) -> dict:
    """``kv4`` / ``kv8``, optionally ``+<rtn|gptq>-<sym|asym>-<group>[-all]`` (see the
    module docstring), as a dict; ValueError naming the spec otherwise."""
    kv, _, weights = spec.partition("+")
    parts = weights.split("-") if weights else []
    ok = kv in ("kv4", "kv8") and (
        not parts
        or (
            len(parts) in (3, 4)
            and parts[0] in ("rtn", "gptq")
            and parts[1] in ("sym", "asym")
            and parts[2].isdigit()
            and parts[3:] in ([], ["all"])
        )
    )
    if not ok:
        raise ValueError(
            f"draft {spec!r}: expected kv4 or kv8, optionally +<rtn|gptq>-<sym|asym>-<group>"
            f"[-all], e.g. kv4+gptq-sym-64"
        )
    draft = dict(name=spec, kv_bits=int(kv[2:]), method=None)
    if parts:
        draft.update(
            method=parts[0],
            symmetric=parts[1] == "sym",
            group=int(parts[2]),
            layers="all" if parts[3:] else "mlp",
        )
    return draft


def draft_weights(model, params, draft: dict, calibration) -> Any:
    """The draft's parameters for a ``parse_draft`` dict (``params`` themselves when it
    quantizes no weights; GPTQ on ``calibration`` tokens ``[n, T]``)."""
    if draft["method"] is None:
        return params
    settings = dict(group_size=draft["group"], layers=draft["layers"], symmetric=draft["symmetric"])
    if draft["method"] == "rtn":
        return quantize_params(params, **settings)
    return calibrate(model, params, calibration, **settings)


def _acceptance_rows_or_exit(*args, **kwargs):
    try:
        return acceptance_rows(*args, **kwargs)
    except ValueError as error:
        if str(error).startswith("draft "):
            raise SystemExit(f"--drafts: {error}") from None
        raise


def acceptance_rows(
    model,
    params,
    prompts: dict,
    drafts,
    *,
    gammas,
    temperatures,
    new_tokens: int,
    group_size: int,
    calibration=None,
    stop_tokens=(),
    log=print,
):
    """One row per draft, prompt length, gamma and temperature: the acceptance rate and
    tokens per round over the prompts' rows, and (greedy) whether every row's output
    equals plain decoding on the 8-bit path. ``prompts``: ``{length: int [B, length]}``."""
    # Every draft's weights first: a grid the model's layers cannot take fails before
    # any decoding.
    weights_of = {}
    for spec in drafts:
        try:
            weights_of[spec] = draft_weights(model, params, parse_draft(spec), calibration)
        except ValueError as error:
            raise ValueError(f"draft {spec!r}: {error}") from None
    plain = {
        n: decoding.generate(
            model,
            params,
            p,
            max_new_tokens=new_tokens,
            group_size=group_size,
            stop_tokens=stop_tokens,
        )
        for n, p in prompts.items()
    }
    rows = []
    for spec in drafts:
        draft, weights = parse_draft(spec), weights_of[spec]
        for (length, prompt), gamma, temperature in itertools.product(
            prompts.items(), gammas, temperatures
        ):
            sampling = lm.SamplingParams(temperature=temperature)
            out = decoding.speculative_generate(
                model,
                params,
                prompt,
                gamma=gamma,
                max_new_tokens=new_tokens,
                group_size=group_size,
                draft_params=weights,
                draft_kv_bits=draft["kv_bits"],
                sampling=sampling,
                rng=jax.random.key(0) if temperature > 0 else None,
                stop_tokens=stop_tokens,
            )
            lengths = np.asarray(out.lengths)
            same = None
            if temperature == 0:
                want = plain[length]
                same = np.array_equal(lengths, np.asarray(want.lengths)) and all(
                    np.array_equal(np.asarray(out.tokens)[b, :n], np.asarray(want.tokens)[b, :n])
                    for b, n in enumerate(lengths)
                )
            rows.append(
                dict(
                    draft=spec,
                    prompt=length,
                    gamma=gamma,
                    temperature=temperature,
                    acceptance=float(out.acceptance_rate),
                    tokens_per_round=float(lengths.mean()) / max(int(out.num_iterations), 1),
                    new_tokens=int(lengths.sum()),
                    same_as_8bit=same,
                )
            )
            log(
                f"{spec}: prompt {length}, gamma {gamma}, T {temperature}: acceptance {rows[-1]['acceptance']:.3f}"
            )
    return rows


def acceptance_table(rows) -> str:
    columns = [
        ("draft", "draft"), ("prompt", "prompt"), ("gamma", "gamma"),
        ("temperature", "temperature", "g"), ("acceptance", "acceptance", ".3f"),
        ("tokens / round", "tokens_per_round", ".2f"), ("new tokens", "new_tokens"),
        ("greedy output = 8-bit decoding", "same_as_8bit"),
    ]  # fmt: skip
    return bench.markdown_table(columns, rows)


def kernel_rows(contexts, *, verify_tokens: int = 7, repeats: int = 5):
    """Attention over the quantized store (4-bit draft, 8-bit target; ``T = 1`` and
    ``verify_tokens`` queries) against bfloat16 attention over the same context, one
    layer of Llama-2 shape (32 heads of 128, G = 128), batch 1. The Pallas kernel on a
    TPU or GPU; elsewhere its XLA reference (interpreting the kernel would time nothing
    real)."""
    from kernels_pallas.quant_kv_attention import quant_kv_attention

    platform = jax.devices()[0].platform
    impl = "pallas" if platform in ("tpu", "gpu") else "xla"
    kv, n, h, g = 32, 32, 128, 128
    r = np.random.default_rng(0)
    rows = []
    for context in contexts:
        s = g * (context // g)
        codes = jnp.asarray(r.integers(0, 256, (1, kv, s, h // 2)), jnp.uint8)
        k_scale = jnp.asarray(r.uniform(0, 1, (1, kv, s // g, h)), jnp.float16)
        v_scale = jnp.asarray(r.uniform(0, 1, (1, kv, s, 1)), jnp.float16)
        keys = jnp.asarray(r.normal(size=(1, s, kv, h)), jnp.bfloat16)
        positions = jnp.arange(s, dtype=jnp.int32)[None]
        for t in (1, verify_tokens):
            q = jnp.asarray(r.normal(size=(1, t, n, h)), jnp.bfloat16)
            cut = jnp.full((1, t), s, jnp.int32)
            query_positions = s + jnp.arange(t, dtype=jnp.int32)[None]
            dense = jax.jit(functools.partial(_dense_attention, scale=h**-0.5))
            row = dict(context=s, queries=t, impl=impl)
            row["bf16_ms"] = 1e3 * bench.best_time(
                functools.partial(dense, q, keys, keys, positions, query_positions), repeats
            )
            for bits in (4, 8):
                quant = jax.jit(functools.partial(quant_kv_attention, bits=bits, impl=impl))
                args = (
                    q,
                    codes,
                    codes,
                    k_scale,
                    k_scale,
                    codes,
                    codes,
                    v_scale,
                    v_scale,
                    positions,
                    cut,
                )
                row[f"int{bits}_ms"] = 1e3 * bench.best_time(
                    functools.partial(quant, *args), repeats
                )
            rows.append(row)
    return rows


def _dense_attention(q, keys, values, positions, query_positions, *, scale):
    from lhc.nn.attention_ops import attention_segments

    return attention_segments(q, [(keys, values, positions)], query_positions, scale=scale)


def kernel_table(rows) -> str:
    rows = [
        {**r, **{f"int{bits}_ratio": r["bf16_ms"] / r[f"int{bits}_ms"] for bits in (4, 8)}}
        for r in rows
    ]
    columns = [
        ("context", "context"), ("queries", "queries"), ("store read by", "impl"),
        ("bf16 ms", "bf16_ms", ".3f"), ("4-bit ms", "int4_ms", ".3f"),
        ("4-bit ratio", "int4_ratio", ".2fx"), ("8-bit ms", "int8_ms", ".3f"),
        ("8-bit ratio", "int8_ratio", ".2fx"),
    ]  # fmt: skip
    return bench.markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench.parser("quantspec", __doc__)
    parser.add_argument("--configs", type=bench.str_list, default=list(traffic.NAMED))
    parser.add_argument("--contexts", type=bench.int_list, default=[4096, 32768, 131072])
    parser.add_argument("--gamma", type=int, default=6, help="drafts per round (model rows)")
    parser.add_argument("--acceptance", type=float, default=0.9, help="for the predictions")
    bench.add_model_source(parser, workdir_help="a trained run to measure", required=False)
    parser.add_argument(
        "--filler",
        type=bench.str_list,
        default=None,
        help="comma-separated text files for the prompts (default: generated)",
    )
    parser.add_argument("--random", action="store_true", help="measure random weights")
    parser.add_argument("--prompt-lengths", type=bench.int_list, default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--measure-gamma", type=int, default=4)
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="KV group of the measured model (default: 128 or its head dim)",
    )
    parser.add_argument("--weights", choices=("mlp", "all"), default="mlp")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--kernel-contexts", type=bench.int_list, default=None, help="time the store attention"
    )
    parser.add_argument(
        "--drafts", type=bench.str_list, default=None, help="draft variants' acceptance (above)"
    )
    parser.add_argument("--gammas", type=bench.int_list, default=[4])
    parser.add_argument("--temperatures", type=bench.float_list, default=[0.0])
    parser.add_argument(
        "--calibration",
        type=bench.int_list,
        default=[16, 512],
        help="GPTQ's calibration text: rows,tokens",
    )
    args = parser.parse_args(argv)
    for spec in args.drafts or ():
        try:
            parse_draft(spec)
        except ValueError as error:
            raise SystemExit(f"--drafts: {error}") from None
    if len(args.calibration) != 2:
        raise SystemExit(f"--calibration: expected rows,tokens, got {args.calibration}")
    unknown = sorted(set(args.configs) - set(traffic.NAMED))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {sorted(traffic.NAMED)}")
    if args.random and (args.workdir is not None or args.checkpoint is not None):
        raise SystemExit("give at most one of --workdir, --random and --checkpoint")
    result: dict[str, Any] = {}
    rows = traffic_rows(args.configs, args.contexts, gamma=args.gamma, acceptance=args.acceptance)
    print(traffic_table(rows, args.gamma, args.acceptance))
    result["traffic"] = rows
    if args.random or args.workdir is not None or args.checkpoint is not None:
        from lhc.data.passkey import Filler

        model, params, tokenizer = load_model(
            args.workdir, 0 if args.random else None, args.checkpoint, args.dtype
        )
        try:
            filler = Filler(args.filler) if args.filler else None
        except ValueError as error:
            raise SystemExit(f"--filler: {error}") from None
        group = args.group_size or decoding.default_group_size(model.config)
        if args.drafts:
            prompts = {
                n: filler_prompts(args.batch, n, 0, tokenizer, filler) for n in args.prompt_lengths
            }
            rows, length = args.calibration
            calibration = filler_prompts(rows, length, 1, tokenizer, filler)
            accepted = _acceptance_rows_or_exit(
                model,
                params,
                prompts,
                args.drafts,
                gammas=args.gammas,
                temperatures=args.temperatures,
                new_tokens=args.new_tokens,
                group_size=group,
                calibration=calibration,
            )
            print(f"\n{args.new_tokens} new tokens, KV group {group}")
            print(acceptance_table(accepted))
            result["acceptance"] = accepted
        else:
            measured = measure(
                model,
                params,
                args.prompt_lengths,
                new_tokens=args.new_tokens,
                gamma=args.measure_gamma,
                group_size=group,
                batch=args.batch,
                weights=args.weights,
                tokenizer=tokenizer,
                filler=filler,
            )
            print(
                f"\ngreedy, batch {args.batch}, {args.new_tokens} new tokens, gamma "
                f"{args.measure_gamma}, G {group}"
            )
            print(measured_table(measured))
            result["measured"] = measured
    if args.kernel_contexts:
        rows = kernel_rows(args.kernel_contexts)
        print("\none layer of Llama-2 shape, batch 1; ratio = bf16 time / quantized time")
        print(kernel_table(rows))
        result["kernel"] = rows
    return bench.finish(result, args)
