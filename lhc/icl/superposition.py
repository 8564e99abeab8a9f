"""Task superposition from scratch (Xiong et al., ICML 2025, Sec. 4): a small decoder
trained on prompts that each hold ONE task, then given prompts that mix two.

Two task kinds, character-level (byte tokens), a demonstration ``input>answer\\n``:

* ``"bias_add"``: input a digit x, answer (x + b) mod 10 for a hidden b in 0..9;
* ``"copy"``: input 8 distinct random letters, answer the letter at a hidden index
  k in 0..7.

Training prompts (``training_row``, those of ``lhc.icl.task.SuperpositionTask``) hold
``demos`` demonstrations of one task whose hidden parameter is drawn per prompt, the
loss on the answers (the answer character and the newline). A mixture prompt
(``mixture_prompt``) draws each demonstration's task from two hidden parameters (2 and
6 by default, as the paper's code) with proportions (d, 1 - d); its query input gets
two different answers, one per task. The model's probability of each answer
(teacher-forced, ``lhc.icl.answer_probabilities``) against d is the experiment
(``superposition_curve``).
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from lhc.icl.scoring import answer_probabilities

KINDS = ("bias_add", "copy")
SEPARATOR, NEWLINE = ord(">"), ord("\n")
LETTERS = np.frombuffer(string.ascii_letters.encode(), np.uint8).astype(np.int32)
DIGITS = np.arange(ord("0"), ord("9") + 1, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class ScratchTask:
    """A task kind and the demonstrations per training prompt."""

    kind: str = "bias_add"
    demos: int = 40

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.demos < 1:
            raise ValueError(f"demos must be >= 1, got {self.demos}")

    @property
    def num_params(self) -> int:
        """How many hidden parameters there are (b in 0..9, or k in 0..7)."""
        return 10 if self.kind == "bias_add" else 8

    @property
    def input_length(self) -> int:
        return 1 if self.kind == "bias_add" else 8

    @property
    def demo_length(self) -> int:
        return self.input_length + 3  # input, ">", answer, "\n"

    def sample_input(self, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "bias_add":
            return rng.choice(DIGITS, 1)
        return rng.choice(LETTERS, 8, replace=False)

    def answer(self, inputs: np.ndarray, param: int) -> int:
        """The answer token of ``inputs`` under hidden parameter ``param``."""
        if not 0 <= param < self.num_params:
            raise ValueError(
                f"the {self.kind} parameter must be in [0, {self.num_params}), got {param}"
            )
        if self.kind == "bias_add":
            return int(DIGITS[(int(inputs[0]) - ord("0") + param) % 10])
        return int(inputs[param])

    def demonstration(self, inputs: np.ndarray, param: int) -> np.ndarray:
        return np.concatenate([inputs, [SEPARATOR, self.answer(inputs, param), NEWLINE]])


def training_row(rng: np.random.Generator, task: ScratchTask) -> dict[str, np.ndarray]:
    """One training prompt: ``task.demos`` demonstrations of one hidden parameter;
    ``tokens``, ``targets``, ``weights`` (1 on answers and their newlines), ``[1, T]``."""
    param = int(rng.integers(task.num_params))
    demos = [task.demonstration(task.sample_input(rng), param) for _ in range(task.demos)]
    tokens = np.concatenate(demos).astype(np.int32)
    weights = np.zeros(tokens.size, np.float32)
    answer_at = np.arange(task.demos) * task.demo_length + task.input_length + 1
    weights[answer_at] = weights[answer_at + 1] = 1
    return {"tokens": tokens[None, :-1], "targets": tokens[None, 1:], "weights": weights[None, 1:]}


@dataclasses.dataclass
class MixturePrompt:
    """A prompt mixing two tasks: ``tokens`` ends with the query's separator;
    ``answers[i]`` is the query's answer (token and newline) under ``params[i]``."""

    tokens: np.ndarray
    answers: list[list[int]]
    counts: tuple[int, int]


def mixture_prompt(
    rng: np.random.Generator,
    task: ScratchTask,
    proportion: float,
    params: tuple[int, int] = (2, 6),
    demos: int | None = None,
) -> MixturePrompt:
    """``demos`` demonstrations (default ``task.demos``), each of ``params[0]`` with
    probability ``proportion`` and else of ``params[1]``, then a query whose two answers
    differ.

    Raises:
        ValueError: a proportion outside [0, 1] or equal parameters.
    """
    if not 0 <= proportion <= 1:
        raise ValueError(f"proportion must be in [0, 1], got {proportion}")
    if params[0] == params[1]:
        raise ValueError(f"the two tasks need different parameters, got {params}")
    demos = task.demos if demos is None else demos
    first = rng.random(demos) < proportion
    parts = [task.demonstration(task.sample_input(rng), params[0 if f else 1]) for f in first]
    query = task.sample_input(rng)
    answers = [[task.answer(query, p), NEWLINE] for p in params]
    tokens = np.concatenate(parts + [query, [SEPARATOR]]).astype(np.int32)
    return MixturePrompt(tokens, answers, (int(first.sum()), int(demos - first.sum())))


def superposition_curve(
    model,
    params,
    task: ScratchTask,
    proportions,
    *,
    prompts: int = 50,
    seed: int = 0,
    task_params: tuple[int, int] = (2, 6),
    demos: int | None = None,
    both_at: float = 0.1,
) -> dict[str, np.ndarray]:
    """Mean and standard deviation over ``prompts`` prompts of each task's answer
    probability at every proportion d of the first task.

    Returns:
        ``proportion [D]``, ``mean [D, 2]``, ``std [D, 2]``, ``realised [D]`` (the mean
        fraction of demonstrations of the first task), ``both [D]`` (the fraction of
        prompts giving each answer at least ``both_at``: superposed in one pass).
    """
    rng = np.random.default_rng(seed)
    means, stds, realised, both = [], [], [], []
    for d in proportions:
        batch = [mixture_prompt(rng, task, float(d), task_params, demos) for _ in range(prompts)]
        probs = answer_probabilities(
            model, params, [p.tokens for p in batch], [p.answers for p in batch]
        )
        means.append(probs.mean(0))
        stds.append(probs.std(0))
        realised.append(np.mean([p.counts[0] / sum(p.counts) for p in batch]))
        both.append(np.mean(probs.min(axis=1) >= both_at))
    return dict(
        proportion=np.asarray(proportions, np.float64),
        mean=np.array(means),
        std=np.array(stds),
        realised=np.array(realised),
        both=np.array(both),
    )
