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

One measurement per file: ``memory_traffic.py`` (the traffic model's rows), ``speed.py`` (the
measured decoding and steps), ``acceptance.py`` (the drafts) and ``kernels.py`` (the
store attention); ``loading.py`` loads the model and makes the prompts.
"""

from __future__ import annotations

import os
from typing import Any

from lhc import bench, stats
from lhc.quantspec import decoding
from lhc.quantspec.bench.acceptance import (
    acceptance_rows,
    acceptance_table,
    draft_weights,
    parse_draft,
)
from lhc.quantspec.bench.kernels import kernel_rows, kernel_table
from lhc.quantspec.bench.loading import filler_prompts, load_model
from lhc.quantspec.bench.memory_traffic import traffic_rows, traffic_table
from lhc.quantspec.bench.speed import measure, measured_table
from lhc.quantspec.traffic import NAMED

__all__ = [
    "acceptance_rows",
    "acceptance_table",
    "draft_weights",
    "filler_prompts",
    "kernel_rows",
    "kernel_table",
    "load_model",
    "main",
    "measure",
    "measured_table",
    "parse_draft",
    "traffic_rows",
    "traffic_table",
]


def _acceptance_rows_or_exit(*args, **kwargs):
    try:
        return acceptance_rows(*args, **kwargs)
    except ValueError as error:
        if str(error).startswith("draft "):
            raise SystemExit(f"--drafts: {error}") from None
        raise


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench.parser("quantspec", __doc__)
    parser.add_argument("--configs", type=bench.str_list, default=list(NAMED))
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
        "--results",
        default=None,
        help="with --drafts: JSON lines, one per draft, length, gamma and temperature with "
        "each prompt's accepted and drafted tokens, appended; a rerun with the same "
        "settings skips the lengths already there",
    )
    parser.add_argument(
        "--sampled-check",
        type=int,
        default=0,
        help="with --drafts and a temperature > 0: that many speculative samples of the "
        "first two tokens after each length's first 512 prompt tokens, tested against the "
        "target's exact distribution (Pearson's chi-square)",
    )
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
    unknown = sorted(set(args.configs) - set(NAMED))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {sorted(NAMED)}")
    if args.random and (args.workdir is not None or args.checkpoint is not None):
        raise SystemExit("give at most one of --workdir, --random and --checkpoint")
    result: dict[str, Any] = {}
    rows = traffic_rows(args.configs, args.contexts, gamma=args.gamma, acceptance=args.acceptance)
    print(traffic_table(rows, args.gamma, args.acceptance))
    result["traffic"] = rows
    if args.random or args.workdir is not None or args.checkpoint is not None:
        from lhc.train.passkey import Filler

        model, params, tokenizer = load_model(
            args.workdir, 0 if args.random else None, args.checkpoint, args.dtype
        )
        try:
            filler = Filler(args.filler) if args.filler else None
        except ValueError as error:
            raise SystemExit(f"--filler: {error}") from None
        group = args.group_size or decoding.default_group_size(model.config)
        if args.drafts:
            rows, length = args.calibration
            calibration = filler_prompts(rows, length, 1, tokenizer, filler)
            setting = dict(
                batch=args.batch, new_tokens=args.new_tokens, group_size=group,
                drafts=list(args.drafts), gammas=list(args.gammas),
                temperatures=list(args.temperatures), calibration=list(args.calibration),
                filler=[os.path.basename(f) for f in args.filler or ()],
                **({"sampled": args.sampled_check} if args.sampled_check else {}),
            )  # fmt: skip
            tags, accepted = {}, []
            if args.results:
                tags = {"model": args.checkpoint or args.workdir, **bench.provenance(args)}
                for record in stats.read_records(args.results):
                    if record.get("model") == tags["model"] and record["setting"] == setting:
                        accepted.append(record)
            done = {row["prompt"] for row in accepted}
            for n in args.prompt_lengths:  # one length at a time: a rerun resumes
                if n in done:
                    continue
                made = _acceptance_rows_or_exit(
                    model,
                    params,
                    {n: filler_prompts(args.batch, n, 0, tokenizer, filler)},
                    args.drafts,
                    gammas=args.gammas,
                    temperatures=args.temperatures,
                    new_tokens=args.new_tokens,
                    group_size=group,
                    calibration=calibration,
                    sampled=args.sampled_check,
                )
                accepted += made
                if tags:
                    stats.append_records(
                        args.results, [dict(tags, setting=setting, **r) for r in made]
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
