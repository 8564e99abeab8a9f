"""The harness: tests from needle cases x haystacks x lengths x depths, prompts in the
evaluated model's tokens, batched greedy generation, "contains" scoring, results as
JSON lines that a restarted sweep resumes from.

    cases = lhc.nolima.needle_cases(lhc.nolima.lhc_needle_set(), ("onehop", "twohop"))
    haystack = lhc.nolima.Haystack(lines, tokenizer)
    records = lhc.nolima.evaluate(model, params, tokenizer, cases, [haystack],
                                  lengths=(1000, 8000), depths=(0.0, 0.5, 1.0),
                                  results_path="results.jsonl")
    print(lhc.nolima.table(lhc.nolima.summary(records)))

Variants (the paper's ablations): ``"plain"``; ``"mc"`` (the question lists four
names, the answer and three other names of the set, in random order; the paper took
the three from the haystack); ``"distractor"`` (the case's distractor sentence, which
names the question's keyword, placed at a depth in [0.2, 0.8] at least 0.2 away from
the needle's). The literal-match ablation is a question type: ``"direct"`` in lhc's set
(the question names the needle's keyword), the ``ONLYDirect`` file for the official one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc.data.haystack import Haystack
from lhc.lm.tokenizers import render_chat_template
from lhc.nolima.needles import NeedleCase
from lhc.nolima.scores import contains
from lhc.stats import append_records
from lhc.stats import read_records as read_results

DEFAULT_TASK_TEMPLATE = (
    "Here is an excerpt from a book:\n\n{haystack}\n\n"
    "Answer the question below from the excerpt: what it states, or what follows from it "
    "with confidence. Keep the answer short.\n\n"
    "Question: {question} Reply with the answer alone."
)
VARIANTS = ("plain", "mc", "distractor")
_SENTINEL = "\x00HAYSTACK\x00"


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a context and a question become the model's tokens.

    Attributes:
        task_template: the user message, with ``{haystack}`` and ``{question}`` (a
            needle set's own ``task_template`` wins).
        chat_template: a Jinja chat template (``tokenizer.chat_template``), rendered with a
            system and a user message and the generation prompt; None for plain text.
        system_prompt: whether the case's system prompt goes into the chat.
        add_bos: prepend the tokenizer's bos for plain text (a chat template writes its own).
        special_tokens: names the chat template may use (``bos_token``, ``eos_token``):
            ``tokenizer.special_tokens_map``.
    """

    task_template: str = DEFAULT_TASK_TEMPLATE
    chat_template: str | None = None
    system_prompt: bool = True
    add_bos: bool = True
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)


def prompt_tokens(
    tokenizer, fmt: PromptFormat, case: NeedleCase, context: Sequence[int], question: str
) -> list[int]:
    """The prompt's tokens: the rendered text around the context, encoded, with the
    context's own tokens in the middle (so the needle's token depth is exact)."""
    template = case.task_template or fmt.task_template
    user = template.replace("{question}", question).replace("{haystack}", _SENTINEL)
    if fmt.chat_template is not None:
        messages = [{"role": "user", "content": user}]
        if fmt.system_prompt and case.system_prompt:
            messages.insert(0, {"role": "system", "content": case.system_prompt})
        text = render_chat_template(fmt.chat_template, messages, **fmt.special_tokens)
        bos = []
    else:
        text = user
        bos = [tokenizer.bos_id] if fmt.add_bos and tokenizer.bos_id is not None else []
    if text.count(_SENTINEL) != 1:
        raise ValueError("the task template must hold {haystack} exactly once")
    before, after = text.split(_SENTINEL)
    return [*bos, *tokenizer.encode(before), *context, *tokenizer.encode(after)]


@dataclasses.dataclass(frozen=True)
class Test:
    """One test: a case in one haystack at one length and depth."""

    case: NeedleCase
    haystack: int
    length: int
    depth: float
    variant: str

    @property
    def placement(self) -> tuple:
        """What the tests of one needle sentence share: the character's name, the needle's
        place and the whole context (only the question differs)."""
        return (self.case.experiment_id, self.case.test_id, self.haystack, self.length, self.depth)

    def key(self, haystacks: Sequence[Haystack]) -> str:
        """The test's id in a results file (the haystack by name, so that tests of other
        haystacks, e.g. the held-out one of a knowledge check, can share the file)."""
        name = haystacks[self.haystack].name
        return f"{self.variant}/{self.length}/{name}/{self.case.pair}/{self.depth:g}"


def make_tests(
    cases: Sequence[NeedleCase],
    num_haystacks: int,
    lengths: Sequence[int],
    depths: Sequence[float],
    variant: str = "plain",
) -> list[Test]:
    """Every (length, haystack, case, depth), lengths outermost."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    for name, values in (("lengths", lengths), ("depths", depths)):
        if not values:
            raise ValueError(f"{name} must not be empty")
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    if variant == "distractor" and any(c.distractor is None for c in cases):
        missing = sorted({c.experiment_id for c in cases if c.distractor is None})
        raise ValueError(
            f"variant 'distractor': experiments {missing} have no distractor "
            "for their question type"
        )
    return [
        Test(c, h, int(n), float(d), variant)
        for n in lengths
        for h in range(num_haystacks)
        for c in cases
        for d in depths
    ]


def build(test: Test, haystack: Haystack, tokenizer, fmt: PromptFormat) -> dict[str, Any]:
    """The test's prompt tokens and what scoring needs (name, answers, needle offset).

    The character's name is drawn per placement (needle, haystack, length, depth), so
    tests of one length and depth do not all share one name, while the question types
    of one needle read the same context: the literal and latent questions about it are
    paired."""
    case = test.case
    # One generator per placement, so a resumed sweep draws the same names.
    rng = np.random.default_rng(
        [
            case.seed,
            zlib.crc32(case.test_id.encode()),
            zlib.crc32(haystack.name.encode()),
            test.length,
            round(test.depth * 1e6),
            VARIANTS.index(test.variant),
        ]
    )
    names = haystack.absent(case.character_set)
    if len(names) < (4 if test.variant == "mc" else 1):
        raise ValueError(
            f"experiment {case.experiment_id}: too few names of its character_set "
            f"are absent from haystack {haystack.name!r}"
        )
    name = str(names[rng.integers(len(names))])
    question = case.question
    if test.variant == "mc":
        others = [n for n in names if n != name]
        options = [name, *rng.choice(others, 3, replace=False).tolist()]
        rng.shuffle(options)
        question = f"{question} Options: {', '.join(options)}."
    distractor_depth = None
    distractor = None
    if test.variant == "distractor":
        allowed = [d for d in np.linspace(0.2, 0.8, 61) if abs(d - test.depth) >= 0.2]
        distractor_depth = float(allowed[rng.integers(len(allowed))])
        distractor = case.distractor
    placement = haystack.place(
        case.needle.replace("{CHAR}", name),
        length=test.length,
        depth=test.depth,
        distractor=distractor,
        distractor_depth=distractor_depth,
    )
    answers = (
        [a.replace("{CHAR}", name) for a in case.gold_answers] if case.gold_answers else [name]
    )
    return {
        "tokens": prompt_tokens(tokenizer, fmt, case, placement.tokens, question),
        "name": name,
        "answers": answers,
        "needle_start": placement.needle_start,
        "distractor_depth": distractor_depth,
    }


# ``generate_fn(prompts, shared) -> responses``: token lists in, each response's tokens
# out. ``shared``: prefix lengths, outermost first, each shared by every prompt of the
# call (an int for one level): the first is often shared with the next calls' prompts
# too (the haystack up to the needle), the next with fewer (a needle's context).
GenerateFn = Callable[[list[list[int]], "int | Sequence[int]"], list[list[int]]]


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the longest token prefix every prompt shares, short of the shortest
    prompt (each keeps at least one token of its own)."""
    shortest = min(len(p) for p in prompts)
    first = prompts[0]
    for index in range(shortest - 1):
        if any(p[index] != first[index] for p in prompts[1:]):
            return index
    return max(shortest - 1, 0)


def model_generate(
    model,
    params,
    *,
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    prefill_chunk: int = 512,
) -> GenerateFn:
    """A batched greedy generation function of an ``lhc.lm`` protocol model (responses
    without their stop token).

    Shared prefixes are prefilled once and kept, one cache per level: the outermost (cut
    to a compiled length of ``lm.bucket_length``, so that it needs no padding) from
    scratch, each inner one from a copy of the level above. A call whose prefixes are
    held starts from a copy of the innermost and prefills only its own tokens. In a
    needle test the haystack up to the needle is the same for every needle at one length
    and depth (outer level), the context up to the question for every question about
    one needle (inner level)."""
    from lhc import lm

    held: list[tuple[tuple[int, ...], int, Any]] = []  # (prefix, capacity, cache) by level

    def prefix_cache(levels: list[list[int]], needed: int):
        cache = None
        for level, prefix in enumerate(levels):
            key = tuple(prefix)
            if level < len(held) and held[level][0] == key and held[level][1] >= needed:
                cache = held[level][2]
                continue
            del held[level:]
            capacity = min(lm.bucket_length(needed + needed // 8), model.config.max_len)
            if cache is None:
                out = lm.generate(
                    model,
                    params,
                    [prefix],
                    max_new_tokens=1,
                    cache_len=capacity,
                    prefill_chunk=prefill_chunk,
                )
            else:
                out = lm.generate(
                    model,
                    params,
                    [prefix[len(levels[level - 1]) :]],
                    max_new_tokens=1,
                    cache=jax.tree.map(jnp.copy, cache),  # donated
                    prefill_chunk=prefill_chunk,
                )
            cache = out.cache
            held.append((key, capacity, cache))
        return cache

    def run(prompts: list[list[int]], shared: int | Sequence[int] = 0) -> list[list[int]]:
        ends = [shared] if isinstance(shared, int) else list(shared)
        outer = ends[0] if ends else 0
        while outer and lm.bucket_length(outer) != outer:
            outer -= 1
        ends = [outer, *(e for e in ends[1:] if e > outer)] if outer else []
        ends = [e for i, e in enumerate(ends) if i == 0 or e > ends[i - 1]]
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            stop_tokens=tuple(stop_tokens),
            pad_id=pad_id,
            prefill_chunk=prefill_chunk,
        )
        if ends:
            levels = [list(prompts[0][:end]) for end in ends]
            rest = [p[ends[-1] :] for p in prompts]
            # Slots: each level's tokens, padded to a compiled length, then the rest's.
            steps = [b - a for a, b in zip([0, *ends], ends)]
            needed = ends[0] + sum(lm.bucket_length(n) for n in steps[1:])
            needed += lm.bucket_length(max(map(len, rest))) + max_new_tokens
            cache = prefix_cache(levels, needed)
            cache = lm.repeat_rows(jax.tree.map(jnp.copy, cache), len(prompts))  # donated
            out = lm.generate(model, params, rest, cache=cache, **kwargs)
        else:
            out = lm.generate(model, params, prompts, **kwargs)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        responses = []
        for row, n in zip(tokens, lengths):
            row = row[:n].tolist()
            if row and row[-1] in stop_tokens:
                row = row[:-1]
            responses.append(row)
        return responses

    return run


def evaluate(
    model,
    params,
    tokenizer,
    cases: Sequence[NeedleCase],
    haystacks: Sequence[Haystack],
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    variant: str = "plain",
    fmt: PromptFormat = PromptFormat(),
    batch_size: int = 1,
    max_new_tokens: int = 192,
    stop_tokens: Sequence[int] | None = None,
    prefill_chunk: int = 512,
    results_path: str | os.PathLike | None = None,
    generate_fn: GenerateFn | None = None,
    tags: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Runs every test not yet in ``results_path`` and returns all records.

    Args:
        model, params: an ``lhc.lm`` protocol model (unused when ``generate_fn`` is given).
        tokenizer: the model's tokenizer (``encode``/``decode``, ``bos_id``/``eos_id``).
        cases: from ``needle_cases``.
        haystacks: tokenized with ``tokenizer``.
        lengths, depths: context lengths in tokens, needle depths in [0, 1].
        variant: ``"plain"``, ``"mc"`` or ``"distractor"``.
        batch_size: prompts per ``generate`` call (one length, haystack and depth at a
            time); records are written after each call, so an interruption loses at
            most one batch (one test at the default).
        max_new_tokens: response budget (the paper: 192); generation stops early once
            every response of a call has its stop token.
        stop_tokens: default: the tokenizer's eos.
        results_path: JSON lines, appended after each batch; tests already there are
            skipped, so an interrupted sweep restarted with the same arguments resumes.
        generate_fn: ``(token lists, shared prefix lengths) -> response token lists``
            (default: greedy ``lm.generate`` through ``model_generate``, which prefills
            each shared prefix once).
        tags: fields written into every new record (the model, its file's SHA-256,
            the lhc commit, which part of an experiment).

    Returns:
        One record per test: key, pair, question type, variant, length, haystack, depth,
        name, answers, response, correct, prompt_tokens, needle_start, and the wall
        seconds of the ``generate_fn`` call that answered it with the ``batch`` of tests
        it answered (the first call of a placement also prefills its context after the
        shared haystack prefix; later ones only their question).
    """
    tests = make_tests(cases, len(haystacks), lengths, depths, variant)
    keys = {t: t.key(haystacks) for t in tests}
    done = {r["key"]: r for r in read_results(results_path)} if results_path else {}
    pending = [t for t in tests if keys[t] not in done]
    if stop_tokens is None:
        stop_tokens = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    if generate_fn is None:
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        generate_fn = model_generate(
            model,
            params,
            max_new_tokens=max_new_tokens,
            stop_tokens=stop_tokens,
            pad_id=pad_id,
            prefill_chunk=prefill_chunk,
        )
    if log and len(pending) < len(tests):
        log(f"{len(tests) - len(pending)} of {len(tests)} tests already in {results_path}")
    if results_path:
        os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    new = {}
    # Tests of one length, haystack and depth share the haystack up to the needle; the
    # question types of one needle share the context up to the question. They run one
    # after another (one prefix each), in batches of at most batch_size.
    groups: dict[tuple, dict[tuple, list[Test]]] = {}
    for t in pending:
        group = groups.setdefault((t.length, t.haystack, t.depth), {})
        group.setdefault(t.placement, []).append(t)
    finished = 0
    for group in groups.values():
        built = {
            t: build(t, haystacks[t.haystack], tokenizer, fmt) for p in group.values() for t in p
        }
        outer = common_prefix([b["tokens"] for b in built.values()])
        for placement in group.values():
            inner = common_prefix([built[t]["tokens"] for t in placement])
            shared = (outer, inner) if len(placement) > 1 else (outer,)
            for start in range(0, len(placement), batch_size):
                batch = placement[start : start + batch_size]
                start_time = time.perf_counter()
                responses = generate_fn([built[t]["tokens"] for t in batch], shared)
                seconds = time.perf_counter() - start_time
                finished += len(batch)
                _write(
                    batch,
                    [built[t] for t in batch],
                    responses,
                    seconds,
                    tokenizer,
                    haystacks,
                    keys,
                    tags,
                    new,
                    results_path,
                )
                if log:
                    log(f"{finished}/{len(pending)} tests (length {batch[0].length})")
    return [done[keys[t]] if keys[t] in done else new[keys[t]] for t in tests]


def _write(
    batch, built, responses, seconds, tokenizer, haystacks, keys, tags, new, results_path
) -> None:
    """The batch's records into ``new``, appended to ``results_path`` (flushed to disk)."""
    lines = []
    for test, b, response in zip(batch, built, responses):
        text = tokenizer.decode(response)
        new[keys[test]] = record = {
            **(tags or {}),
            "key": keys[test],
            "pair": test.case.pair,
            "experiment": test.case.experiment_id,
            "test": test.case.test_id,
            "question_type": test.case.question_type,
            "variant": test.variant,
            "length": test.length,
            "haystack": haystacks[test.haystack].name,
            "depth": test.depth,
            "name": b["name"],
            "answers": b["answers"],
            "response": text,
            "correct": contains(text, b["answers"]),
            "prompt_tokens": len(b["tokens"]),
            "needle_start": b["needle_start"],
            "distractor_depth": b["distractor_depth"],
            "seconds": seconds,
            "batch": len(batch),
        }
        lines.append(json.dumps(record))
    if results_path:
        append_records(results_path, lines)
