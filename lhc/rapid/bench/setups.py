"""The paper's setups of ``lhc bench rapid --setup configs/rapid_llama.py:NAME`` on
imported checkpoints: the memory estimate (``memory.setup_memory``), and, when the config
names the checkpoints, tokenizer and data, target-only, RAG-only and RAPID measured on a
JSONL file of ``context``, ``question`` and ``answers``.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp

from lhc import lm
from lhc.lm.sampling import SamplingParams
from lhc.rapid.bench.common import measure_length, methods_for, table
from lhc.rapid.bench.memory import setup_memory
from lhc.rapid.config import RetrievalConfig
from lhc.rapid.decoding import build_prompts, prefill_contexts
from lhc.rapid.retrieval import word_terms


def _read_jsonl(path: str) -> list[dict]:
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            example = json.loads(line)
            missing = {"context", "question", "answers"} - set(example)
            if missing or not isinstance(example.get("answers"), list):
                raise SystemExit(
                    f"{path}:{number}: expected an object with context, question and answers "
                    f"(a list of strings); missing {sorted(missing)}"
                )
            examples.append(example)
    if not examples:
        raise SystemExit(f"{path}: no examples")
    return examples


def _load_checkpoint(path: str, preset: str, dtype: str, attention_impl: str):
    """A Hugging Face checkpoint, checked to have the preset's architecture."""
    config, params = lm.hf.load(path, jnp.dtype(dtype), attention_impl=attention_impl)
    want = lm.get_preset(preset)
    fields = ("num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
    differ = [f for f in fields if getattr(config, f) != getattr(want, f)]
    if differ:
        raise SystemExit(
            f"{path}: the checkpoint is not a {preset}: "
            + ", ".join(f"{f} {getattr(config, f)} (preset {getattr(want, f)})" for f in differ)
        )
    return lm.Transformer(config), params


def run_setup(config, repeats: int) -> dict[str, Any]:
    """The memory estimate of a ``configs/rapid_llama.py`` setup; and, when it names
    checkpoints, a tokenizer and data, the measured run on them."""
    retrieval = RetrievalConfig(**dict(config.retrieval))
    decoding = config.decoding
    result: dict[str, Any] = {"memory": setup_memory(config, retrieval)}
    if not config.target_checkpoint:
        return result
    if not (config.tokenizer and config.data):
        raise SystemExit("--setup: a target_checkpoint needs config.tokenizer and config.data")
    target, params = _load_checkpoint(
        config.target_checkpoint, config.target, config.dtype, config.attention_impl
    )
    upward = None
    if config.draft_checkpoint:
        upward = _load_checkpoint(
            config.draft_checkpoint, config.draft, config.dtype, config.attention_impl
        )
    tokenizer = lm.load_tokenizer(config.tokenizer)
    examples = _read_jsonl(config.data)
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompts = build_prompts(
        [tokenizer.encode(e["context"]) for e in examples],
        [tokenizer.encode(e["question"]) for e in examples],
        retrieval,
        terms=word_terms(tokenizer.decode),
        prefix=prefix,
        separator=tokenizer.encode("\n\n"),
    )
    sampling = SamplingParams(temperature=decoding.temperature, top_p=decoding.top_p)
    drafter, draft_params = upward if upward is not None else (target, params)
    methods = methods_for(
        target,
        params,
        drafter,
        draft_params,
        [decoding.eta],
        None,
        [],
        decoding.gamma,
        alpha=decoding.alpha,
        sampling=sampling,
        rng=jax.random.key(config.seed),
    )

    def contains(tokens, answers):
        text = tokenizer.decode([int(t) for t in tokens])
        return any(answer in text for answer in answers)

    extra = max(len(q) for q in prompts.questions) + decoding.new_tokens + decoding.gamma + 16
    cache = prefill_contexts(
        target, params, prompts, extra=extra, prefill_chunk=decoding.prefill_chunk
    )
    measured = measure_length(
        methods,
        prompts,
        [e["answers"] for e in examples],
        cache,
        new_tokens=decoding.new_tokens,
        repeats=repeats,
        correct=contains,
    )
    print(f"\n{len(examples)} examples from {config.data}")
    print(table({max(len(c) for c in prompts.contexts): measured}))
    result["measured"] = measured
    return result
