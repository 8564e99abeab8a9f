"""Needle sets in NoLiMa's JSON format, and lexical overlap by ROUGE-1 precision.

A needle set is a JSON list of experiments. One experiment::

    {
      "id": "0401",                       # the first four characters are digits
      "system_prompt": "You are a helpful assistant",
      "task_template": "...{haystack}...{question}...",   # optional
      "needle": "Actually, {CHAR} lives next to {1}.",
      "questions": {"onehop": "Which character has been to {2}?", ...},
      "character_set": ["Yuki", "Stuart", ...],
      "tests": {"T01_C01": {"input_args": ["...", "...", "..."],
                            "gold_answers": ["..."]}},       # gold_answers optional
      "distractors": {"onehop": "...{2}..."}                # optional
    }

Slot ``{i}`` takes ``input_args[i - 1]``; ``{CHAR}`` takes a name drawn from
``character_set`` for each placement, and that name is the answer unless the test lists
``gold_answers``. Every (experiment, test, question type) is one question-needle pair.

The official set (Modarressi et al.) is published on a dataset hub under the Adobe
Research License (non-commercial research only); lhc does not ship or download it: pass
its path to ``load_needle_set``. ``lhc_needle_set()`` is a set written for lhc in the
same format (``lhc/nolima/lhc_needle_set.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SLOT = re.compile(r"\{(\d+)\}")
WORD = re.compile(r"[a-z0-9]+")
LHC_NEEDLE_SET = os.path.join(os.path.dirname(__file__), "lhc_needle_set.json")


@dataclasses.dataclass(frozen=True)
class NeedleTest:
    input_args: tuple[str, ...]
    gold_answers: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class NeedleSet:
    """One entry of a needle set (see the module docstring): a needle with its
    questions, character names and tests."""

    id: str
    system_prompt: str
    needle: str
    questions: Mapping[str, str]
    character_set: tuple[str, ...]
    tests: Mapping[str, NeedleTest]
    task_template: str | None = None
    distractors: Mapping[str, str] | None = None

    @property
    def seed(self) -> int:
        """42 + the id's leading number, as in the official harness."""
        return 42 + int(self.id[:4])


@dataclasses.dataclass(frozen=True)
class NeedleCase:
    """A question-needle pair with its slots filled; ``{CHAR}`` left for placement."""

    experiment_id: str
    test_id: str
    question_type: str
    needle: str
    question: str
    system_prompt: str
    character_set: tuple[str, ...]
    seed: int
    task_template: str | None = None
    distractor: str | None = None
    gold_answers: tuple[str, ...] | None = None

    @property
    def pair(self) -> str:
        return f"{self.experiment_id}/{self.test_id}/{self.question_type}"


def fill(template: str, args: Sequence[str], name: str | None = None) -> str:
    """``template`` with ``{i}`` replaced by ``args[i - 1]`` (and ``{CHAR}`` by ``name``)."""

    def slot(match: re.Match) -> str:
        index = int(match.group(1))
        if not 1 <= index <= len(args):
            raise ValueError(f"slot {{{index}}} in {template!r} has no input_args[{index - 1}]")
        return args[index - 1]

    out = SLOT.sub(slot, template)
    return out if name is None else out.replace("{CHAR}", name)


def _strings(value: Any, *, allow_empty: bool = False) -> bool:
    return (
        isinstance(value, list)
        and (allow_empty or bool(value))
        and all(isinstance(v, str) and v for v in value)
    )


def _string_map(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, str) and v for k, v in value.items())
    )


def _field(entry: dict, where: str, name: str, check, expected: str, required: bool = True):
    if name not in entry:
        if required:
            raise ValueError(f"{where}: missing field {name!r} ({expected})")
        return None
    if not check(entry[name]):
        raise ValueError(
            f"{where}: field {name!r} must be {expected}, got {json.dumps(entry[name])[:80]}"
        )
    return entry[name]


def parse_needle_set(data: Any, source: str = "needle set") -> list[NeedleSet]:
    """Validated experiments from the decoded JSON ``data``.

    Raises:
        ValueError: naming the entry (index and id) and the field that is missing or
            malformed, or the test whose ``input_args`` do not fill a template's slots.
    """
    if not isinstance(data, list) or not data:
        raise ValueError(f"{source}: expected a non-empty JSON list of experiments")
    experiments, seen = [], set()
    for index, entry in enumerate(data):
        where = f"{source}: entry {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        entry_id = entry.get("id")
        if not isinstance(entry_id, str) or not entry_id[:4].isdigit() or len(entry_id) < 4:
            raise ValueError(
                f"{where}: field 'id' must be a string starting with 4 digits, got {entry_id!r}"
            )
        where = f"{source}: entry {index} (id {entry_id!r})"
        if entry_id in seen:
            raise ValueError(f"{where}: field 'id' repeats an earlier entry's id")
        seen.add(entry_id)

        field = functools.partial(_field, entry, where)

        system_prompt = field("system_prompt", lambda v: isinstance(v, str), "a string")
        needle = field(
            "needle", lambda v: isinstance(v, str) and "{CHAR}" in v, "a string holding {CHAR}"
        )
        questions = field("questions", _string_map, "a non-empty object of question templates")
        characters = field("character_set", _strings, "a non-empty list of names")
        tests = field(
            "tests", lambda v: isinstance(v, dict) and bool(v), "a non-empty object of tests"
        )
        template = field(
            "task_template",
            lambda v: isinstance(v, str) and "{haystack}" in v and "{question}" in v,
            "a string holding {haystack} and {question}",
            required=False,
        )
        distractors = field(
            "distractors", _string_map, "an object of distractor templates", required=False
        )
        if distractors is not None and set(distractors) - set(questions):
            raise ValueError(
                f"{where}: field 'distractors' has question types "
                f"{sorted(set(distractors) - set(questions))} not in 'questions'"
            )
        parsed = {}
        for test_id, test in tests.items():
            at = f"{where}, test {test_id!r}"
            if not isinstance(test, dict) or not _strings(test.get("input_args")):
                raise ValueError(f"{at}: field 'input_args' must be a non-empty list of strings")
            gold = test.get("gold_answers")
            if gold is not None and not _strings(gold):
                raise ValueError(f"{at}: field 'gold_answers' must be a non-empty list of strings")
            args = test["input_args"]
            templates = {"needle": needle, **{f"questions.{k}": q for k, q in questions.items()}}
            templates.update({f"distractors.{k}": d for k, d in (distractors or {}).items()})
            for name, text in templates.items():
                slots = [int(s) for s in SLOT.findall(text)]
                if slots and (min(slots) < 1 or max(slots) > len(args)):
                    raise ValueError(
                        f"{at}: field {name!r} uses slot {{{max(slots)}}} but "
                        f"'input_args' has {len(args)} values"
                    )
            parsed[test_id] = NeedleTest(tuple(args), None if gold is None else tuple(gold))
        experiments.append(
            NeedleSet(
                id=entry_id,
                system_prompt=system_prompt,
                needle=needle,
                questions=dict(questions),
                character_set=tuple(characters),
                tests=parsed,
                task_template=template,
                distractors=None if distractors is None else dict(distractors),
            )
        )
    return experiments


def load_needle_set(path: str | os.PathLike) -> list[NeedleSet]:
    """Reads and validates a needle-set JSON file (see ``parse_needle_set``)."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
    return parse_needle_set(data, source=path)


def to_json(experiments: Sequence[NeedleSet]) -> list[dict]:
    """The JSON form of ``experiments`` (``parse_needle_set`` reads it back)."""
    out = []
    for e in experiments:
        entry: dict[str, Any] = {"id": e.id, "system_prompt": e.system_prompt}
        if e.task_template is not None:
            entry["task_template"] = e.task_template
        entry.update(
            needle=e.needle, questions=dict(e.questions), character_set=list(e.character_set)
        )
        entry["tests"] = {
            k: {"input_args": list(t.input_args)}
            | ({} if t.gold_answers is None else {"gold_answers": list(t.gold_answers)})
            for k, t in e.tests.items()
        }
        if e.distractors is not None:
            entry["distractors"] = dict(e.distractors)
        out.append(entry)
    return out


def lhc_needle_set() -> list[NeedleSet]:
    """The needle set written for lhc (one-hop, two-hop and direct questions, each
    template in default and inverted order)."""
    return load_needle_set(LHC_NEEDLE_SET)


def needle_cases(
    experiments: Sequence[NeedleSet], question_types: Sequence[str] | None = None
) -> list[NeedleCase]:
    """Every question-needle pair, slots filled, in file order.

    Args:
        question_types: keep only these (e.g. ``("onehop", "twohop")``); all by default.
    """
    cases = []
    for e in experiments:
        for test_id, test in e.tests.items():
            for question_type, question in e.questions.items():
                if question_types is not None and question_type not in question_types:
                    continue
                distractor = (e.distractors or {}).get(question_type)
                cases.append(
                    NeedleCase(
                        experiment_id=e.id,
                        test_id=test_id,
                        question_type=question_type,
                        needle=fill(e.needle, test.input_args),
                        question=fill(question, test.input_args),
                        system_prompt=e.system_prompt,
                        character_set=e.character_set,
                        seed=e.seed,
                        task_template=e.task_template,
                        distractor=None
                        if distractor is None
                        else fill(distractor, test.input_args),
                        gold_answers=test.gold_answers,
                    )
                )
    return cases


def sample_cases(cases: Sequence[NeedleCase], count: int, seed: int) -> list[NeedleCase]:
    """``count`` of ``cases`` drawn without replacement with ``seed``, in their order
    (all of them when ``count`` is 0 or at least their number)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count == 0 or count >= len(cases):
        return list(cases)
    chosen = np.random.default_rng(seed).choice(len(cases), count, replace=False)
    return [cases[i] for i in sorted(chosen)]


def one_order_per_fact(cases: Sequence[NeedleCase]) -> list[NeedleCase]:
    """The cases of one needle order per fact, the orders alternating: the default order
    (experiment ``0101``) for the first fact of a template, the inverted one (``0101Inv``,
    the official set's naming) for the second, and so on. Halves a sweep while keeping
    every question type of every fact and both orders equally often."""
    facts: dict[tuple[str, str], list[str]] = {}
    for c in cases:
        base = c.experiment_id.removesuffix("Inv")
        facts.setdefault((base, c.test_id), [])
        if c.experiment_id not in facts[base, c.test_id]:
            facts[base, c.test_id].append(c.experiment_id)
    chosen, index = {}, {}
    for (base, test_id), experiments in facts.items():
        i = index[base] = index.get(base, -1) + 1
        wanted = base + "Inv" if i % 2 else base
        chosen[base, test_id] = wanted if wanted in experiments else experiments[0]
    return [
        c
        for c in cases
        if chosen[c.experiment_id.removesuffix("Inv"), c.test_id] == c.experiment_id
    ]


def words(text: str) -> list[str]:
    """ROUGE's default tokens: lower case, runs of ASCII letters and digits."""
    return WORD.findall(text.lower())


def rouge1_precision(prediction: str, reference: str) -> float:
    """ROUGE-1 precision: the share of ``prediction``'s words (counted with multiplicity,
    matches clipped) that occur in ``reference``. NoLiMa measures a question against its
    needle: ``rouge1_precision(question, needle)``."""
    predicted, counts = words(prediction), {}
    if not predicted:
        return 0.0
    for word in words(reference):
        counts[word] = counts.get(word, 0) + 1
    overlap = 0
    for word in predicted:
        if counts.get(word, 0) > 0:
            counts[word] -= 1
            overlap += 1
    return overlap / len(predicted)
