r"""Before and after a context extension: passkey retrieval by length and depth, held-out
loss by position, and the short-context behaviour, as JSON lines (one per test).

    python experiments/context_extension/evaluate.py --checkpoint smollm2-135m-instruct \
        --label base --text kjv.txt --out results/smollm2_16k.jsonl
    python experiments/context_extension/evaluate.py --checkpoint smollm2-135m-instruct \
        --rope yarn --label yarn_untrained --text kjv.txt --out results/smollm2_16k.jsonl
    python experiments/context_extension/evaluate.py --workdir /tmp/ctx_yarn \
        --label yarn_lora --text kjv.txt --out results/smollm2_16k.jsonl

A test already in ``--out`` (same label and test) is not run again, so an interrupted
evaluation resumes. ``report.py`` renders the tables.

* ``passkey``: ``--keys`` five-digit keys per length, at depths 10%, 50%, 90% in turn, in
  the haystack the generated filler of ``lhc.train.passkey`` (``--filler generated``, the
  passkey test's repeated sentences) or the held-out part of ``--text`` (the last 5% of
  its tokens, as the fine-tune config holds out); greedy continuation of "What is the pass key? The pass key is" (with
  ``--passkey-chat``, the haystack is the user's message in the chat template and the question
  follows it), correct when the key's digits are in the first 16 tokens.
* ``position``: mean next-token loss per 1,024-position bucket over ``--loss-windows``
  held-out windows of the longest length (each window from position 0), a row per window
  (``report.py`` averages them).
* ``short``: the mean loss of 512-token held-out windows, and greedy chat answers to
  three fixed questions (``--chat`` for a model with a chat template).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench, lm, stats
from lhc.data.text_files import TextFiles
from lhc.lm.checkpoints import default_layers
from lhc.train import load_language_model
from lhc.train.passkey import Filler

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Who wrote the play Hamlet?",
)
ROPE = {
    "none": None,
    "yarn": lambda f, o: {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": o},
    "linear": lambda f, o: {"rope_type": "linear", "factor": f},
    "ntk": lambda f, o: {"rope_type": "ntk", "factor": f},
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a model name, Hugging Face directory or GGUF")
    source.add_argument("--workdir", help="an lhc run (lhc train)")
    p.add_argument("--label", required=True, help="the model's name in the results")
    p.add_argument("--rope", choices=sorted(ROPE), default="none", help="--checkpoint only")
    p.add_argument("--max-len", type=int, default=16384, help="--checkpoint only")
    p.add_argument("--original", type=int, default=8192, help="the checkpoint's context")
    p.add_argument("--text", required=True, help="the text file (King James Bible)")
    p.add_argument("--lengths", default="8192,16000", help="passkey prompt lengths, tokens")
    p.add_argument("--keys", type=int, default=21, help="passkeys per length")
    p.add_argument(
        "--filler",
        choices=("generated", "text"),
        default="generated",
        help="passkey haystack: the repeated sentences of lhc.train.passkey, or --text",
    )
    p.add_argument("--loss-windows", type=int, default=2)
    p.add_argument("--chat", action="store_true", help="also ask the chat questions")
    p.add_argument(
        "--passkey-chat",
        action="store_true",
        help="the passkey haystack as a user message in the chat template",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="results JSONL (appended)")
    return p


def _load(args):
    """The model to evaluate, set up to decode on this machine: a run's scanned layers
    switched (``lhc.lm.default_layers``), attention by the blocked XLA path."""
    if args.checkpoint:
        rope = ROPE[args.rope]
        overrides = {"max_len": args.max_len}
        if rope is not None:
            overrides["rope_scaling"] = rope(args.max_len / args.original, args.original)
        return load_language_model(checkpoint=args.checkpoint, **overrides)
    ckpt = load_language_model(workdir=args.workdir)
    config, params = ckpt.model.config, ckpt.params
    if config.scan_layers:
        params = lm.unstack_layer_params(params)
        config = config.replace(scan_layers=False)
    layers = default_layers()
    config = config.replace(attention_impl="xla", remat_policy="none", **layers)
    if layers["scan_layers"]:
        params = lm.stack_layer_params(params, config.num_layers, config.layer_period)
    return dataclasses.replace(ckpt, model=lm.Transformer(config), params=params)


def passkey_tests(args, ckpt, held_out: np.ndarray, done: set, base: dict):
    rng = np.random.default_rng(args.seed)
    tokenizer = ckpt.tokenizer
    opening, question = [], tokenizer.encode(QUESTION)
    if args.passkey_chat:  # the haystack as the user's message, the question after it
        marker = "\x00HAYSTACK\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
        before, after = text.split(marker)
        opening = tokenizer.encode(before)
        question = tokenizer.encode(" What is the pass key? Answer with the number." + after)
    for length in (int(n) for n in args.lengths.split(",")):
        for k in range(args.keys):
            key = int(rng.integers(10_000, 100_000))
            start = int(rng.integers(0, len(held_out) - length))
            depth = DEPTHS[k % len(DEPTHS)]
            test = f"passkey/{length}/{k}"
            if test in done:
                continue
            needle = tokenizer.encode(NEEDLE.format(key=key))
            room = length - len(opening) - len(needle) - len(question)
            if args.filler == "generated":
                filler = Filler().tokens(tokenizer, rng, room)
            else:
                filler = list(held_out[start : start + room])
            at = int(round(depth * len(filler)))
            prompt = opening + filler[:at] + needle + filler[at:] + question
            began = time.perf_counter()
            out = lm.generate(ckpt.model, ckpt.params, [prompt], max_new_tokens=16)
            answer = tokenizer.decode([int(t) for t in out.tokens[0]])
            correct = str(key) in re.sub(r"\s", "", answer)
            yield {
                **base,
                "test": test,
                "kind": "passkey",
                "length": len(prompt),
                "depth": depth,
                "key": key,
                "answer": answer,
                "correct": bool(correct),
                "seconds": round(time.perf_counter() - began, 2),
            }


def position_tests(args, ckpt, text: TextFiles, done: set, base: dict):
    """One row per held-out window (``position/i``), so that an interrupted evaluation
    keeps the windows it finished (a 16K window takes minutes)."""
    count = min(args.loss_windows, text.held_out.num_windows)
    pending = [i for i in range(count) if f"position/{i}" not in done]
    if "position" in done or not pending:  # "position": all windows in one row
        return
    windows = text.held_out.windows(range(count))
    # No cache: the whole window at once, attention over key blocks (bounded memory).
    model = lm.Transformer(ckpt.model.config.replace(attention_impl="chunked"))

    @jax.jit
    def nll(params, tokens, targets):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        (loss, _), _ = model.apply({"params": params}, tokens, positions, targets=targets)
        return loss

    for i in pending:
        loss = np.asarray(
            nll(ckpt.params, windows["tokens"][i : i + 1], windows["targets"][i : i + 1])
        )
        buckets = loss.reshape(-1, 1024).mean(axis=1)
        yield {
            **base,
            "test": f"position/{i}",
            "kind": "position",
            "windows": 1,
            "bucket": 1024,
            "nll": [round(float(v), 4) for v in buckets],
        }


def short_tests(args, ckpt, short: TextFiles, done: set, base: dict):
    if "short_loss" not in done:
        windows = short.held_out.windows(range(min(16, short.held_out.num_windows)))
        positions = jnp.broadcast_to(jnp.arange(512), windows["tokens"].shape)
        apply = jax.jit(
            lambda p, t, g: ckpt.model.apply({"params": p}, t, positions, targets=g)[0][0]
        )
        loss = np.asarray(apply(ckpt.params, windows["tokens"], windows["targets"]))
        yield {**base, "test": "short_loss", "kind": "short_loss", "windows": len(loss),
               "nll": round(float(loss.mean()), 4)}  # fmt: skip
    if args.chat and "chat" not in done:
        answers = lm.generate_text(ckpt, list(CHAT_QUESTIONS), chat=True, max_new_tokens=32)
        yield {**base, "test": "chat", "kind": "chat",
               "answers": dict(zip(CHAT_QUESTIONS, answers))}  # fmt: skip


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    ckpt = _load(args)
    done = (
        {row["test"] for row in stats.read_records(args.out) if row.get("model") == args.label}
        if os.path.exists(args.out)
        else set()
    )
    longest = max(int(n) for n in args.lengths.split(","))
    bucketed = -(-longest // 1024) * 1024
    text = TextFiles(args.text, ckpt.tokenizer, bucketed, eval_fraction=0.05)
    short = TextFiles(args.text, ckpt.tokenizer, 512, eval_fraction=0.05)
    held_out = text.held_out.tokens
    base = {"model": args.label, **bench.provenance(args)}
    for tests in (
        passkey_tests(args, ckpt, held_out, done, base),
        position_tests(args, ckpt, text, done, base),
        short_tests(args, ckpt, short, done, base),
    ):
        for row in tests:
            stats.append_records(args.out, [row])
            print(json.dumps({k: row[k] for k in row if k not in ("answers",)})[:200], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
