"""Task superposition on a pretrained language model (Xiong et al., ICML 2025, Sec. 3).

Prompts of in-context demonstrations of several tasks of one family (``lhc.icl.families``)
mixed in given proportions, then a query; the model's probability of every task's answer
to the query, from one pass over the prompt (``lhc.icl.shared_prefix.score_answers``):

* ``first``: the probability of the answer's first token. The queries are drawn so that
  the K answers start with K different tokens (``token_prompts``), so these are K
  disjoint events of the next-token distribution and "other" is the rest of it.
* ``full``: the probability of the whole answer and the line end after it (the
  demonstrations' line separator), teacher-forced; with the line end, no answer is the
  prefix of another.

``measure`` summarises a set of prompts: the mean and standard deviation of each task's
probability, "other", the KL from the in-context proportions to the model's distribution
(per prompt, then averaged, as the paper's code; also within the K tasks alone), the
share of prompts that put at least ``at`` on two tasks or more (``spread``: several
tasks in one forward pass), the share whose K answers' first tokens are the K most
probable next tokens (``top_k_share``), and the single-task accuracies. ``sweep`` runs
the proportion sweep (the first task's share d, the others sharing 1 - d evenly) and
``calibration`` asks whether each task's probability grows with its share.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from lhc.icl.families import Family, superposition_prompt
from lhc.icl.scoring import kl_to_proportions, with_other
from lhc.icl.shared_prefix import ANSWER_BUCKET, AnswerScores, score_answers
from lhc.lm.prompts import bucket_length

LINE_END = "\n"


def answer_tokens(tokenizer, text: str, answer: str) -> list[int]:
    """The answer's tokens as the model sees them after ``text`` (the tail of the joint
    encoding when it extends the prompt's, else the answer alone)."""
    prompt, joint = tokenizer.encode(text), tokenizer.encode(text + answer)
    if joint[: len(prompt)] == prompt and len(joint) > len(prompt):
        return joint[len(prompt) :]
    return tokenizer.encode(answer)


@dataclasses.dataclass(frozen=True)
class TokenPrompt:
    """A superposition prompt in a model's tokens.

    Attributes:
        tokens: the prompt (the tokenizer's bos first when it adds one).
        answers: per task (in the order asked for), the answer and the line end.
        counts: demonstrations per task of the family.
    """

    tokens: list[int]
    answers: list[list[int]]
    counts: dict[str, int]


def token_prompts(
    rng: np.random.Generator,
    family: Family,
    tasks: Sequence[str],
    proportions: Mapping[str, float],
    num_demos: int,
    count: int,
    tokenizer,
    *,
    tries: int = 200,
) -> list[TokenPrompt]:
    """``count`` prompts of ``superposition_prompt``, tokenized, each with a query
    whose answers for ``tasks`` start with pairwise different tokens (prompts whose
    query fails that are drawn again, at most ``tries`` times each).

    Raises:
        ValueError: a task not of the family, or no query with distinct first tokens in
            ``tries`` draws (the message names the tasks).
    """
    unknown = [t for t in tasks if t not in family.tasks]
    if unknown or len(set(tasks)) != len(tasks) or not tasks:
        raise ValueError(
            f"tasks: expected distinct tasks of family {family.name!r} "
            f"({', '.join(family.tasks)}), got {', '.join(tasks) or 'none'}"
        )
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos_token", False) else []
    prompts = []
    for _ in range(count):
        for _ in range(tries):
            prompt = superposition_prompt(rng, family, proportions, num_demos)
            answers = [
                answer_tokens(tokenizer, prompt.text, prompt.answers[t] + LINE_END) for t in tasks
            ]
            if len({a[0] for a in answers}) == len(answers):
                prompts.append(
                    TokenPrompt(bos + tokenizer.encode(prompt.text), answers, prompt.counts)
                )
                break
        else:
            raise ValueError(
                f"tasks {', '.join(tasks)} of family {family.name!r}: no query in {tries} "
                "draws whose answers start with different tokens"
            )
    return prompts


def spread(probabilities: np.ndarray, at: float = 0.1) -> float:
    """The share of rows of ``[P, K]`` probabilities with at least two entries ``>= at``."""
    return float(np.mean((np.asarray(probabilities) >= at).sum(-1) >= 2))


def top_k_share(first_ranks: np.ndarray) -> float:
    """The share of prompts whose K answers' first tokens are the K most probable next
    tokens (every rank below K), from ``[P, K]`` ranks."""
    ranks = np.asarray(first_ranks)
    return float(np.mean((ranks < ranks.shape[-1]).all(-1)))


def _summary(probabilities: np.ndarray, proportions: np.ndarray, at: float) -> dict:
    """Mean, std, other, KL (to the K answers and other; within the K answers) and spread."""
    within = probabilities / np.maximum(probabilities.sum(-1, keepdims=True), 1e-300)
    return dict(
        mean=probabilities.mean(0).tolist(),
        std=probabilities.std(0).tolist(),
        other=float(with_other(probabilities.mean(0))[-1]),
        kl=float(kl_to_proportions(probabilities, proportions).mean()),
        kl_within=float(kl_to_proportions(within, proportions).mean()),
        spread=spread(probabilities, at),
    )


def measure(
    model,
    params,
    prompts: Sequence[TokenPrompt],
    proportions: Sequence[float],
    *,
    at: float = 0.1,
    batch_size: int = 8,
    width: int | None = None,
    answer_width: int | None = None,
) -> dict:
    """The superposition statistics of ``prompts`` whose tasks have ``proportions``
    (``width``, ``answer_width``: as for ``score_answers``).

    Returns:
        ``first`` and ``full`` (``mean [K]``, ``std [K]``, ``other``, ``kl``,
        ``kl_within``, ``spread``), ``top`` (``top_k_share``), ``first_accuracy [K]``
        (the answer's first token is the most probable), ``greedy_accuracy [K]``
        (greedy decoding writes the answer and its line end) and ``per_prompt``
        (``first`` and ``full``: ``[P, K]`` probabilities).
    """
    scores: AnswerScores = score_answers(
        model,
        params,
        [p.tokens for p in prompts],
        [p.answers for p in prompts],
        batch_size=batch_size,
        width=width,
        answer_width=answer_width,
    )
    proportions = np.asarray(proportions, np.float64)
    return dict(
        proportions=proportions.tolist(),
        first=_summary(scores.first_probabilities, proportions, at),
        full=_summary(scores.probabilities, proportions, at),
        top=top_k_share(scores.first_ranks),
        first_accuracy=(scores.first_ranks == 0).mean(0).tolist(),
        greedy_accuracy=scores.greedy.mean(0).tolist(),
        # Each prompt's ``[K]`` probabilities (5 significant digits), for intervals over
        # the prompts.
        per_prompt={
            "first": _rounded(scores.first_probabilities),
            "full": _rounded(scores.probabilities),
        },
    )


def _rounded(values: np.ndarray) -> list:
    return [[float(f"{v:.5g}") for v in row] for row in np.asarray(values, np.float64)]


def _rng(seed: int, name: str, index: int) -> np.random.Generator:
    """A generator per (seed, family, point): the same prompts whatever else is run."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), index])


def sweep_proportions(num_tasks: int, shares: Sequence[float]) -> np.ndarray:
    """``[D, K]``: the first task's share d, the other K - 1 tasks (1 - d) / (K - 1) each."""
    shares = np.asarray(shares, np.float64)
    if num_tasks < 2 or shares.ndim != 1 or ((shares < 0) | (shares > 1)).any():
        raise ValueError(
            f"sweep: expected >= 2 tasks and shares in [0, 1], got {num_tasks} tasks and "
            f"shares {shares.tolist()}"
        )
    rest = np.repeat(((1 - shares) / (num_tasks - 1))[:, None], num_tasks - 1, axis=1)
    return np.concatenate([shares[:, None], rest], axis=1)


def draw(tokenizer, family: Family, groups, num_demos: int, prompts: int, seed: int):
    """``prompts`` prompts (``token_prompts``) of each ``(tasks, proportions)`` of
    ``groups``; group ``i`` draws from a generator of (seed, family and tasks, i), so the
    first n of its prompts are the same whatever the count."""
    drawn = []
    for i, (tasks, row) in enumerate(groups):
        rng = _rng(seed, "/".join([family.name, *tasks]), i)
        proportions = dict(zip(tasks, row))
        drawn.append(token_prompts(rng, family, tasks, proportions, num_demos, prompts, tokenizer))
    return drawn


def _run(
    model,
    params,
    tokenizer,
    family,
    groups,
    num_demos,
    prompts,
    seed,
    batch,
    done=None,
    on_row=None,
):
    """``measure`` of each ``(tasks, proportions)`` of ``groups``, every prompt padded to
    one width and every answer to another (one compiled program: the first call
    compiles), with its ``seconds`` and the ``width``. ``done``: ``{group index: row}``
    measured before (not measured again); ``on_row(index, row)``: called as each new row
    is measured."""
    drawn = draw(tokenizer, family, groups, num_demos, prompts, seed)
    every = [p for group in drawn for p in group]
    width = bucket_length(max(len(p.tokens) for p in every))
    longest_answer = max(len(a) for p in every for a in p.answers)
    answer_width = -(-longest_answer // ANSWER_BUCKET) * ANSWER_BUCKET
    results = []
    for index, (group, (_, row)) in enumerate(zip(drawn, groups)):
        if done and index in done:
            results.append(done[index])
            continue
        began = time.perf_counter()
        result = measure(
            model, params, group, row, batch_size=batch, width=width, answer_width=answer_width
        )
        results.append(dict(result, seconds=time.perf_counter() - began, width=width))
        if on_row:
            on_row(index, results[-1])
    return results


def single_task(model, params, tokenizer, family: Family, *, num_demos, prompts, seed, batch=8):
    """Each task of ``family`` alone (every demonstration of it), its answer scored
    among the family's: ``{task: measure(...)}`` with the task first."""
    groups = []
    for task in family.tasks:
        tasks = [task] + [t for t in family.tasks if t != task]
        groups.append((tasks, np.eye(len(tasks))[0]))
    rows = _run(model, params, tokenizer, family, groups, num_demos, prompts, seed, batch)
    return dict(zip(family.tasks, rows))


def sweep(
    model,
    params,
    tokenizer,
    family: Family,
    tasks: Sequence[str],
    shares: Sequence[float],
    *,
    num_demos: int,
    prompts: int,
    seed: int,
    batch: int = 8,
    done: Mapping[int, dict] | None = None,
    on_row: Callable[[int, dict], None] | None = None,
) -> dict:
    """The proportion sweep: ``measure`` at each share d of ``tasks[0]`` (the others
    sharing 1 - d), and (at two shares or more) ``calibration`` of both scorings.
    ``done`` and ``on_row``: the points of an interrupted sweep, as for ``_run`` (every
    point's prompts are drawn whatever is done, so a resumed sweep equals one run whole)."""
    proportions = sweep_proportions(len(tasks), shares)
    groups = [(list(tasks), row) for row in proportions]
    rows = _run(
        model, params, tokenizer, family, groups, num_demos, prompts, seed, batch, done, on_row
    )
    return dict(
        tasks=list(tasks),
        rows=rows,
        calibration={
            kind: calibration(proportions, np.array([r[kind]["mean"] for r in rows]))
            for kind in ("first", "full")
        }
        if len(rows) > 1
        else None,
    )


def calibration(proportions: np.ndarray, probabilities: np.ndarray) -> dict:
    """Does each task's probability grow with its share?

    Args:
        proportions: ``[D, K]`` the tasks' shares at the D points.
        probabilities: ``[D, K]`` their mean probabilities there.

    Returns:
        ``grows [K]``: the probability is larger at the task's largest share than at its
        smallest; ``monotone [K]``: it never falls as the share rises; ``r`` and
        ``slope``: Pearson correlation and least-squares slope, over all D x K points,
        of the probability normalised over the K tasks against the share (1 and 1 when
        the model follows the proportions exactly).
    """
    shares, probs = np.asarray(proportions, np.float64), np.asarray(probabilities, np.float64)
    within = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-300)
    order = np.argsort(shares, axis=0, kind="stable")
    by_share = np.take_along_axis(probs, order, axis=0)
    x, y = shares.ravel(), within.ravel()
    return dict(
        grows=(by_share[-1] > by_share[0]).tolist(),
        monotone=(np.diff(by_share, axis=0) >= 0).all(0).tolist(),
        r=float(np.corrcoef(x, y)[0, 1]),
        slope=float(np.polyfit(x, y, 1)[0]),
    )
