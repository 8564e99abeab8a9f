"""RAPID against target-only and RAG-only decoding, by context length, in one run.

Examples are passkey questions (``lhc.train.passkey``'s needle at evenly spread depths of
generated filler, the question at the end); the answer sits in one chunk. For each
context length the bench builds the full and the RAG prompts (BM25 over English words),
then runs greedy decoding of ``--new-tokens`` tokens with:

* ``target``: the target on the whole context (``lhc.lm.generate``);
* ``rag``: the drafter on the RAG prompt alone;
* ``rapid eta=E``: RAPID with the drafter (self-speculation when no ``--draft-workdir``)
  for each ``--etas`` value (``eta=0`` is plain speculative decoding with a RAG drafter);
* with ``--draft-workdir`` or ``--draft-checkpoint``, ``rag (large)`` and
  ``rapid (large) eta=E`` for upward speculation with ``--upward-etas``.

The target is ``--workdir`` (an lhc run) or ``--checkpoint`` (with its tokenizer, chat
template and stop tokens), else a random tiny decoder of byte tokens.

``--setup configs/rapid_llama.py:NAME`` prints instead the memory estimate of the
paper's setup on imported checkpoints, and runs it on a JSONL file when the config names
the checkpoints, tokenizer and data (see that config).

Accuracy: the first generated tokens spell the key. Speed: the target's cache of each
long context is prefilled once, untimed (every method that reads the context pays that
prefill alike); each method is then timed from that cache to N new tokens per sequence:
the target appends the question and decodes; RAPID appends the question to a copy of the
target's cache, prefills the drafter's RAG prompt and runs its rounds; RAG-only prefills
its RAG prompt and decodes. Tokens per second are ``B N / t`` with t the fastest of
``--repeats`` calls after a compiling one; speedup is against ``target``.

One measurement per module: ``passkey`` (the passkey sweep), ``facts`` (``--haystack``),
``setups`` (``--setup``) with ``memory`` (its memory estimate); ``common`` holds the
models, the methods, their timing and tables that they share.
"""

from __future__ import annotations

import argparse
import sys

from lhc import bench, lm
from lhc.rapid.bench.common import (
    chat_parts,
    load_model,
    measure_length,
    methods_for,
    starts_with_answer,
    table,
)
from lhc.rapid.bench.facts import fact_summary, fact_sweep, fact_table
from lhc.rapid.bench.memory import memory_table, setup_memory
from lhc.rapid.bench.passkey import passkey_questions, passkey_sweep
from lhc.rapid.bench.setups import run_setup
from lhc.rapid.config import RetrievalConfig

__all__ = [
    "chat_parts",
    "fact_summary",
    "fact_sweep",
    "fact_table",
    "main",
    "measure_length",
    "memory_table",
    "methods_for",
    "passkey_questions",
    "passkey_sweep",
    "run_setup",
    "setup_memory",
    "starts_with_answer",
    "table",
]


def _parser():
    parser = bench.parser("rapid", __doc__)
    parser.add_argument("--setup", default=None, help="configs/rapid_llama.py:NAME")
    bench.add_model_source(
        parser, workdir_help="the trained target (random if neither)", required=False
    )
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--draft-workdir", default=None, help="a larger drafter (upward)")
    draft.add_argument("--draft-checkpoint", default=None, help="a larger drafter (upward)")
    parser.add_argument("--context-lengths", type=bench.int_list, default=[2048, 8192])
    parser.add_argument("--samples", type=int, default=4, help="examples per length (a batch)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=10)
    parser.add_argument(
        "--etas", type=bench.float_list, default=[0.0, 10.0], help="RAPID's eta, self-speculation"
    )
    parser.add_argument(
        "--upward-etas",
        type=bench.float_list,
        default=[0.0, 40.0],
        help="RAPID's eta, larger drafter",
    )
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--min-budget", type=int, default=1024)
    parser.add_argument("--ratio", type=float, default=24.0)
    parser.add_argument("--threshold", type=float, default=None, help="BM25 score floor (0)")
    parser.add_argument(
        "--haystack",
        type=bench.str_list,
        default=None,
        help="text files (a book): questions about facts inserted into them, not passkeys",
    )
    parser.add_argument(
        "--facts-per-context", type=int, default=3, help="with --haystack: questions per context"
    )
    parser.add_argument(
        "--context-batch",
        type=int,
        default=0,
        help="with --haystack: contexts prefilled together (default: all --samples)",
    )
    parser.add_argument(
        "--paraphrased",
        type=float,
        default=0.0,
        help="with --haystack: the share of questions paraphrased, sharing no word with "
        "their facts (BM25 misses them)",
    )
    parser.add_argument(
        "--results", default=None, help="with --haystack: JSON lines, appended; a rerun resumes"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> dict:
    """``lhc bench rapid``: the setup (``--setup``), fact (``--haystack``) or passkey
    sweep that ``argv`` names; returns its results, also written to ``--json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    argv = [a for a in argv if not a.startswith("--config.")]
    args = _parser().parse_args(argv)
    if args.context_batch < 0:
        raise SystemExit(f"--context-batch must be >= 0, got {args.context_batch}")
    if not 0.0 <= args.paraphrased <= 1.0:  # before loading a model
        raise SystemExit(f"--paraphrased must lie in [0, 1], got {args.paraphrased}")
    if args.setup is not None:
        from lhc.train.config import load_config

        return bench.finish(run_setup(load_config(args.setup, overrides), args.repeats), args)
    if overrides:
        raise SystemExit(f"{overrides[0]}: --config.KEY=VALUE overrides go with --setup")
    max_len = max(args.context_lengths) + 1024
    loaded = load_model(args, max_len, args.seed)
    target, params = loaded.model, loaded.params
    upward = None
    if args.draft_workdir or args.draft_checkpoint:
        draft_source = argparse.Namespace(
            checkpoint=args.draft_checkpoint, workdir=args.draft_workdir, dtype=args.dtype
        )
        large = load_model(draft_source, max_len, args.seed)
        upward = (large.model, large.params)
    retrieval = RetrievalConfig(
        chunk_size=args.chunk_size,
        min_budget=args.min_budget,
        ratio=args.ratio,
        threshold=args.threshold,
    )
    methods = methods_for(
        target,
        params,
        target,
        params,
        args.etas,
        upward,
        args.upward_etas,
        args.gamma,
        stop_tokens=loaded.stop_tokens,
    )
    byte_tokens = isinstance(loaded.tokenizer, lm.ByteTokenizer)
    chat = ([], [], []) if byte_tokens else chat_parts(loaded.tokenizer)
    if args.haystack:
        if args.facts_per_context < 1:
            raise SystemExit(f"--facts-per-context must be >= 1, got {args.facts_per_context}")
        return bench.finish(fact_sweep(args, loaded, retrieval, chat), args)
    return bench.finish(passkey_sweep(args, loaded, retrieval, methods, chat), args)
