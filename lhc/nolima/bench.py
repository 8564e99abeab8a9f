"""NoLiMa: a sweep (accuracy, base score, effective length) or throughput.

Sweep on a model trained on the generated world (``configs/nolima_world.py``)::

    lhc bench nolima --workdir /tmp/nolima/decoder --world \
        --lengths 250,500,1000,2000,4000 --results /tmp/nolima/decoder.jsonl --plots DIR

Sweep of the official set on an imported checkpoint (a TPU or GPU host)::

    lhc bench nolima --checkpoint ~/Llama-3.1-8B-Instruct --needle-set needle_set.json \
        --haystack rand_book_1.txt,rand_book_2.txt --lengths 250,500,1000,2000,4000,8000,16000,32000 \
        --depths 26 --max-new-tokens 192 --results llama8b.jsonl

The harness's throughput: tests/s and peak memory per length (a tiny random decoder
unless ``--workdir``; each length in a fresh process whose peak resident memory is
reported)::

    lhc bench nolima --throughput --lengths 8192,32768 --tests 8

Results are JSON lines: a sweep interrupted and started again with the same arguments
runs only the tests that are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np

from lhc import bench, lm
from lhc.data.haystack import Haystack, clean_lines, filter_lines, shuffled_haystack
from lhc.nolima import world as world_lib
from lhc.nolima.evaluate import PromptFormat, evaluate
from lhc.nolima.needles import (
    NeedleCase,
    lhc_needle_set,
    load_needle_set,
    needle_cases,
    one_order_per_fact,
    sample_cases,
)
from lhc.nolima.report import known_pairs
from lhc.nolima.scores import LITERAL, interval_table, plot, summary, table

# The knowledge check: each latent pair at 250 tokens, at these depths of a held-out
# haystack; a pair answered at most once of three is reported as not known.
PROBE_DEPTHS = (0.0, 0.5, 1.0)
PROBE_SHUFFLE = 1000


def _depths(text: str) -> list[float]:
    """``--depths``: a count (evenly spaced in [0, 1], as the paper's 26) or a list."""
    if text.strip().isdigit():
        return np.linspace(0.0, 1.0, int(text)).round(4).tolist()
    return bench.float_list(text)


def _model(args, max_len: int):
    """``(model, params, tokenizer, format, stop_tokens, world_config)``."""
    if args.checkpoint:
        ckpt = bench.load_model_source(args, max_len=max_len, attention_impl=args.attention_impl)
        tokenizer = lm.load_tokenizer(args.tokenizer) if args.tokenizer else ckpt.tokenizer
        chat = None if args.no_chat else tokenizer.chat_template
        fmt = PromptFormat(chat_template=chat, special_tokens=tokenizer.special_tokens_map)
        return ckpt.model, ckpt.params, tokenizer, fmt, ckpt.stop_tokens, None
    tokenizer = lm.ByteTokenizer()
    fmt = world_lib.FORMAT
    if args.workdir:
        exp, params, _ = bench.restore_run(args.workdir)
        return exp.task.model, params, tokenizer, fmt, (tokenizer.eos_id,), exp.config.get("world")
    config = lm.LMConfig.tiny(vocab_size=tokenizer.vocab_size, max_len=max_len)
    params = lm.init_params(config, jax.random.key(args.seed))
    return lm.Transformer(config), params, tokenizer, fmt, (tokenizer.eos_id,), None


def _world(world_config) -> world_lib.World:
    w = world_config or {"regions": 4, "cities": 3, "landmarks": 3, "seed": 0}
    return world_lib.World.generate(
        regions=int(w["regions"]),
        cities=int(w["cities"]),
        landmarks=int(w["landmarks"]),
        seed=int(w["seed"]),
    )


def _setup(args, tokenizer, world_config, longest: int):
    """``(cases, haystacks, held_out)``: the pairs, ``--haystacks`` haystacks per source
    and one more, held out (shuffle ``PROBE_SHUFFLE``, whatever ``--haystacks``), for the
    knowledge check (``--probe``)."""
    lines_needed = longest // 20 + 200  # generated lines hold about 45 tokens
    if args.world or not (args.needle_set or args.haystack):
        world = _world(world_config)
        regions = len(world.regions)
        test_regions = tuple(range(regions // 2))
        experiments = world.needle_set(test_regions)
        haystacks = [
            Haystack(
                world.haystack_lines(
                    lines_needed,
                    decoy_regions=tuple(range(regions // 2, regions)),
                    decoy_rate=args.decoy_rate,
                    seed=args.seed + h,
                ),
                tokenizer,
                f"world{h}" if h < args.haystacks else "world-probe",
            )
            for h in (*range(args.haystacks), PROBE_SHUFFLE)
        ]
        held_out = [haystacks.pop()]
    else:
        experiments = load_needle_set(args.needle_set) if args.needle_set else lhc_needle_set()
        if not args.haystack:
            raise SystemExit("--needle-set needs --haystack text files")
        if args.haystacks > 1 and not args.shuffle:
            raise SystemExit(f"--haystacks {args.haystacks} of a text file needs --shuffle")
        keywords = [a for e in experiments for t in e.tests.values() for a in t.input_args]
        haystacks, held_out = [], []
        shuffles = (*range(args.haystacks), PROBE_SHUFFLE) if args.shuffle else (0,)
        for h in shuffles:
            for index, path in enumerate(args.haystack):
                suffix = "#probe" if h == PROBE_SHUFFLE else f"#{h}" if h else ""
                name = os.path.basename(path) + suffix
                if args.shuffle:
                    seed = 42 + index + len(args.haystack) * h
                    lines = shuffled_haystack([path], num_lines=args.shuffle, seed=seed)
                else:
                    with open(path, encoding="utf-8") as handle:
                        lines = clean_lines(handle.read())
                if args.filter:
                    lines, dropped = filter_lines(lines, keywords)
                    print(f"{name}: {dropped} lines naming a keyword dropped")
                haystack = Haystack(lines, tokenizer, name)
                (held_out if h == PROBE_SHUFFLE else haystacks).append(haystack)
    cases = needle_cases(experiments, args.question_types)
    if args.orders == "alternate":
        cases = one_order_per_fact(cases)
    return sample_cases(cases, args.pairs, args.seed), haystacks, held_out


def known_facts(cases: list[NeedleCase], known: dict[str, bool]) -> list[NeedleCase]:
    """The cases of the facts (needle and its order) whose latent association the model
    knows: each known latent pair with the literal question about the same needle (the
    paired comparison stays whole); the facts with no known latent pair are dropped."""
    fact = lambda c: (c.experiment_id, c.test_id)  # noqa: E731
    kept = {fact(c) for c in cases if known.get(c.pair)}
    chosen = [
        c for c in cases if fact(c) in kept and (c.question_type in LITERAL or known.get(c.pair))
    ]
    dropped = sorted(p for p, k in known.items() if not k)
    print(
        f"--known-only: {len(chosen)} of {len(cases)} pairs ({len(kept)} facts with a known "
        f"latent pair); not known: {', '.join(dropped) or 'none'}",
        flush=True,
    )
    return chosen


def sweep(args) -> dict[str, Any]:
    lengths, depths = args.lengths, args.depths
    model, params, tokenizer, fmt, stops, world_config = _model(args, max(lengths) + 1024)
    cases, haystacks, held_out = _setup(args, tokenizer, world_config, max(lengths))
    tags = {"model": args.label or args.checkpoint or args.workdir or "random", "set": "sweep"}
    tags.update(bench.provenance(args))
    run = lambda cases, haystacks, **kwargs: evaluate(  # noqa: E731
        model,
        params,
        tokenizer,
        cases,
        haystacks,
        variant=args.variant,
        fmt=fmt,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        stop_tokens=stops,
        prefill_chunk=args.prefill_chunk,
        results_path=args.results,
        log=lambda m: print(m, flush=True),
        **kwargs,
    )
    start = time.perf_counter()
    if args.probe:
        if not held_out:
            raise SystemExit("--probe needs a held-out haystack: --shuffle or --world")
        latent = [c for c in cases if c.question_type not in LITERAL]
        print(f"knowledge check: {len(latent)} latent pairs at 250 tokens in {held_out[0].name}")
        probe = run(
            latent, held_out, lengths=[250], depths=PROBE_DEPTHS, tags={**tags, "set": "probe"}
        )
        if args.known_only:
            cases = known_facts(cases, known_pairs(probe))  # rows tagged set: probe
    elif args.known_only:
        raise SystemExit("--known-only needs --probe (the knowledge check decides what is known)")
    print(
        f"{len(cases)} question-needle pairs x {len(haystacks)} haystacks x {len(depths)} "
        f"depths x {len(lengths)} lengths ({args.variant})",
        flush=True,
    )
    records = run(cases, haystacks, lengths=lengths, depths=depths, tags=tags)
    result = summary(records)
    result["seconds"] = time.perf_counter() - start
    print(table(result))
    print("\naccuracy over tests [95% Wilson interval] (tests)\n" + interval_table(result))
    if args.plots:
        print("plots:", ", ".join(plot(records, args.plots, args.title)))
    return result


def _one_length(args) -> dict[str, Any]:
    """Tests/s at one length (after one batch that compiles), and this process's peak RSS."""
    (length,) = args.lengths
    model, params, tokenizer, fmt, stops, world_config = _model(args, length + 1024)
    cases, haystacks, _ = _setup(args, tokenizer, world_config, length)
    cases = (cases * args.tests)[: args.tests]
    run = lambda c: evaluate(
        model,
        params,
        tokenizer,
        c,
        haystacks[:1],
        lengths=[length],
        depths=[0.5],
        fmt=fmt,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        stop_tokens=stops,
        prefill_chunk=args.prefill_chunk,
    )
    start = time.perf_counter()
    run(cases[: args.batch_size])
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    records = run(cases)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "length": length,
        "tests": len(records),
        "seconds": seconds,
        "tests_per_s": len(records) / seconds,
        "first_batch_s": compile_s,
        "peak_rss_gb": peak / 2**30,
        "prompt_tokens": records[0]["prompt_tokens"],
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
    }


def _without_lengths(argv: list[str]) -> list[str]:
    """``argv`` without its ``--lengths`` flag (``--lengths=X`` or ``--lengths X``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--lengths":
            skip = True
        elif not arg.startswith("--lengths="):
            out.append(arg)
    return out


def throughput(args, argv: list[str]) -> list[dict[str, Any]]:
    rows = []
    for length in args.lengths:
        command = [
            sys.executable,
            "-m",
            "lhc.nolima.bench",
            *_without_lengths(argv),
            "--one-length",
            f"--lengths={length}",
        ]
        proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not found:
            raise SystemExit(f"length {length} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(found[-1][len("RESULT ") :]))
        r = rows[-1]
        print(
            f"length {length:>7}: {r['tests']} tests in {r['seconds']:.1f} s = "
            f"{r['tests_per_s']:.3f} tests/s (batch {r['batch_size']}, first batch "
            f"{r['first_batch_s']:.1f} s), peak RSS {r['peak_rss_gb']:.2f} GiB",
            flush=True,
        )
    return rows


def _parser() -> argparse.ArgumentParser:
    p = bench.parser("nolima", __doc__)
    bench.add_model_source(p, workdir_help="a model trained in lhc (byte tokens)", required=False)
    p.add_argument("--tokenizer", default=None, help="its tokenizer (default: --checkpoint)")
    p.add_argument("--attention-impl", default="xla", help="for --checkpoint")
    p.add_argument("--no-chat", action="store_true", help="plain prompts despite a chat template")
    p.add_argument("--world", action="store_true", help="the generated world's needles/haystack")
    p.add_argument("--needle-set", default=None, help="a needle-set JSON (default: lhc's)")
    p.add_argument(
        "--haystack", type=bench.str_list, default=None, help="comma-separated text files"
    )
    p.add_argument("--shuffle", type=int, default=0, help="shuffled haystacks of N lines")
    p.add_argument("--filter", action="store_true", help="drop lines naming a keyword")
    p.add_argument(
        "--question-types",
        type=bench.str_list,
        default=None,
        help="e.g. onehop,twohop (default: all)",
    )
    p.add_argument("--variant", default="plain", choices=("plain", "mc", "distractor"))
    p.add_argument(
        "--pairs", type=int, default=0, help="N pairs drawn at random with --seed (default: all)"
    )
    p.add_argument(
        "--haystacks",
        type=int,
        default=1,
        help="haystacks: generated (--world), or shuffles of each file (--shuffle)",
    )
    p.add_argument(
        "--orders",
        choices=("both", "alternate"),
        default="both",
        help="needle orders: both, or one per fact alternating (half the tests)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="first the knowledge check: latent pairs at 250 tokens on a held-out haystack",
    )
    p.add_argument(
        "--known-only",
        action="store_true",
        help="after --probe, sweep only the facts with a known latent pair (and their "
        "literal questions)",
    )
    p.add_argument("--label", default=None, help="the model's name in the results")
    p.add_argument("--decoy-rate", type=float, default=0.2, help="--world haystacks")
    p.add_argument("--lengths", type=bench.int_list, default="250,500,1000,2000,4000")
    p.add_argument("--depths", type=_depths, default="5", help="a count (evenly spaced) or a list")
    p.add_argument(
        "--batch-size", type=int, default=1, help="tests per generate call (and per write)"
    )
    p.add_argument("--max-new-tokens", type=int, default=192, help="stops early at a stop token")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--results", default=None, help="JSON lines (resumable)")
    p.add_argument("--plots", default=None, help="a directory for heat maps and curves")
    p.add_argument("--title", default="NoLiMa")
    p.add_argument("--throughput", action="store_true")
    p.add_argument("--tests", type=int, default=8, help="tests per length (--throughput)")
    p.add_argument("--one-length", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.one_length:  # a child of throughput: its row, for the parent to read
        result = _one_length(args)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    result = dict(rows=throughput(args, argv)) if args.throughput else sweep(args)
    return bench.finish(result, args)


if __name__ == "__main__":
    main()
