"""PENCIL generation speed: cache rewind against recomputing the reduced context.

For each context length ``C``, one model generates ``--new-tokens`` tokens after a
prompt of ``C - new_tokens`` tokens, twice, in the same run:

* ``rewind``: ``lhc.pencil.generate`` (the KV cache is kept through every reduction;
  only answers are fed again);
* ``recompute``: ``lhc.pencil.generate_recompute``, the official code's way: every token
  re-runs the whole reduced context (no cache; here batched and jitted per bucketed
  width, which is kinder to it than the official one-sequence PyTorch loop).

The model is the paper's SAT model (6 layers, width 384, 10.6M parameters; ``--size
tiny``: the configs' tiny model, 4 layers of width 128) with random weights, sampling at
temperature 1 over the SAT vocabulary, so ``[CALL]``/``[SEP]``/``[RETURN]`` come up and
reductions happen along the way; both runs draw the same tokens (the table says whether
they did). Tokens per second count generated tokens in the fastest of ``--repeats`` runs
(default 1), after a warm-up run that compiles every shape.

    lhc bench pencil --contexts 512,1024,2048 --new-tokens 64
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from lhc import bench
from lhc.lm.config import LMConfig
from lhc.lm.model import Transformer
from lhc.lm.params import random_params
from lhc.lm.sampling import SamplingParams
from lhc.pencil.experiment import model_fields
from lhc.pencil.generation import generate, generate_recompute
from lhc.pencil.problems import make_problem, tokenizer_for

# layers, heads, width: the paper's SAT model and the configs' tiny one
SIZES = {"paper": (6, 6, 384), "tiny": (4, 4, 128)}


def bench_model(size: str, max_len: int) -> tuple[LMConfig, Any]:
    """The PENCIL model of ``size`` on the SAT (n = 10) vocabulary and its tokenizer."""
    layers, heads, width = SIZES[size]
    tokenizer = tokenizer_for(make_problem("sat", num_vars=10))
    config = LMConfig(**model_fields(tokenizer.vocab_size, layers, width, heads, max_len))
    return config, tokenizer


def measure(
    contexts,
    new_tokens: int,
    batch_size: int = 1,
    size: str = "paper",
    seed: int = 0,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """One row per context: seconds (the fastest of ``repeats`` runs after a warm-up
    run) and tokens per second of both ways."""
    config, tokenizer = bench_model(size, max(contexts))
    model, params = Transformer(config), random_params(config, seed)
    rng = np.random.default_rng(seed)
    # Prompt tokens: the task's words, no special tokens.
    words = [i for i in range(1, tokenizer.vocab_size) if i < tokenizer.bos_id]
    rows = []
    for context in contexts:
        if context <= new_tokens:
            raise ValueError(f"context {context} must exceed --new-tokens {new_tokens}")
        prompts = [rng.choice(words, size=context - new_tokens).tolist() for _ in range(batch_size)]
        kwargs = dict(
            max_new_tokens=new_tokens,
            context_limit=context,
            sampling=SamplingParams(temperature=1.0),
            rng=jax.random.key(seed),
            stop_tokens=[],
        )
        row: dict[str, Any] = {"context": context, "new_tokens": new_tokens, "batch": batch_size}
        outputs = {}
        for name, fn in (("rewind", generate), ("recompute", generate_recompute)):
            run = functools.partial(fn, model, params, prompts, tokenizer, **kwargs)
            seconds, out = bench.timed(run, repeats)
            outputs[name] = out
            row[f"{name}_s"] = seconds
            row[f"{name}_tokens_per_s"] = float(np.sum(out.lengths)) / seconds
        row["reductions"] = int(np.sum(outputs["rewind"].reductions))
        row["same_tokens"] = bool(
            np.array_equal(outputs["rewind"].tokens, outputs["recompute"].tokens)
        )
        row["speedup"] = row["rewind_tokens_per_s"] / row["recompute_tokens_per_s"]
        rows.append(row)
    return rows


def table(rows) -> str:
    shown = [{**row, "shape": f"{row['new_tokens']} x {row['batch']}"} for row in rows]
    return bench.markdown_table(
        [("context", "context"), ("new tokens x batch", "shape"),
         ("rewind tok/s", "rewind_tokens_per_s", ".1f"),
         ("recompute tok/s", "recompute_tokens_per_s", ".2f"), ("speedup", "speedup", ".1fx"),
         ("reductions", "reductions"), ("same tokens", "same_tokens")],
        shown,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the table and the goal; returns the ``rows``."""
    parser = bench.parser("pencil", __doc__)
    parser.add_argument(
        "--contexts", type=bench.int_list, default=[512, 1024, 2048], help="context lengths"
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--batch", type=int, default=1, help="sequences generated together")
    parser.add_argument("--size", choices=sorted(SIZES), default="paper")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs; the fastest counts")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
    args = parser.parse_args(argv)
    for name in ("new_tokens", "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rows = measure(
        args.contexts, args.new_tokens, args.batch, args.size, args.seed, repeats=args.repeats
    )
    print(table(rows))
    for row in rows:
        if row["context"] == 2048:
            print(f"rewind / recompute at 2048: {row['speedup']:.1f}x (goal >= 10x)")
    return bench.finish({"rows": rows}, args)
