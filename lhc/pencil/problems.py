"""The reasoning problems PENCIL is trained on, behind one interface.

A problem draws instances from a numpy generator: a prompt (``<|startoftext|> ...
<|endofprompt|>``), the solver's complete trace with its ``[CALL]``/``[SEP]``/``[RETURN]``
tokens (ending with ``<|endoftext|>``), and the label. The chain-of-thought baseline
trains on the same trace without reducing it. ``make_problem(name, **params)`` builds
one by name: ``"sat"`` (``lhc.pencil.sat``), ``"qbf"`` (``lhc.pencil.qbf``),
``"einstein"`` (``lhc.pencil.einstein``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from lhc.pencil.reduction import subsequences
from lhc.pencil.tokenizer import PencilTokenizer


@dataclasses.dataclass(frozen=True)
class Instance:
    """One problem with its solution trace.

    Attributes:
        prompt: tokens from ``<|startoftext|>`` to ``<|endofprompt|>``.
        trace: the generated part, from the first thought to ``<|endoftext|>``.
        label: the answer token (``"True"``/``"False"``, or a nationality).
        info: what the generator knows about the instance (the formula, the solution).
    """

    prompt: tuple[str, ...]
    trace: tuple[str, ...]
    label: str
    info: Any = dataclasses.field(default=None, compare=False)


class Problem(Protocol):
    """What every problem offers."""

    name: str

    def symbols(self) -> tuple[str, ...]:
        """Every token its prompts and traces use, special tokens aside."""

    def labels(self) -> tuple[str, ...]:
        """The answer classes."""

    def sample(self, rng: np.random.Generator) -> Instance:
        """A random instance."""


def parse_answer(tokens: Sequence[str], labels: Sequence[str]) -> str | None:
    """The answer a generated trace gives: its last token that is a label (the
    paper's rule: the last ``True``/``False``, or the last nationality), or ``None``."""
    labels = set(labels)
    for token in reversed(tokens):
        if token in labels:
            return token
    return None


def tokenizer_for(problem: Problem) -> PencilTokenizer:
    """The tokenizer of ``problem``'s vocabulary."""
    return PencilTokenizer(problem.symbols())


_PROBLEMS = {
    "sat": "lhc.pencil.sat:SAT",
    "qbf": "lhc.pencil.qbf:QBF",
    "einstein": "lhc.pencil.einstein:Einstein",
}


# Each problem's size parameter: a list of sizes there makes a ``Mixture``.
SIZE_PARAMS = {"sat": "num_vars", "qbf": "num_vars", "einstein": "size"}


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Instances of one problem at several sizes, a size drawn uniformly per instance
    (training on a range of sizes at once). The vocabulary is the union of the sizes'
    (the largest size's symbols first), so one tokenizer serves every part.

    Attributes:
        parts: ``(size, problem)`` pairs, sizes ascending.
    """

    parts: tuple[tuple[int, Any], ...]

    @property
    def name(self) -> str:
        return self.parts[0][1].name

    def symbols(self) -> tuple[str, ...]:
        ordered = [self.parts[-1][1], *(problem for _, problem in self.parts[:-1])]
        return tuple(dict.fromkeys(s for problem in ordered for s in problem.symbols()))

    def labels(self) -> tuple[str, ...]:
        return self.parts[0][1].labels()

    def sample(self, rng: np.random.Generator) -> Instance:
        return self.parts[int(rng.integers(len(self.parts)))][1].sample(rng)


def make_problem(name: str, **params: Any) -> Problem:
    """The problem called ``name`` with ``params`` (e.g. ``make_problem("sat", num_vars=5)``);
    a list of sizes (``num_vars=[3, 4, 5]``) gives a ``Mixture`` of them.

    Raises:
        ValueError: an unknown name or parameters the problem does not take.
    """
    if name not in _PROBLEMS:
        raise ValueError(f"problem must be one of {sorted(_PROBLEMS)}, got {name!r}")
    size = params.get(SIZE_PARAMS[name])
    if isinstance(size, (list, tuple)):
        if not size or len(set(size)) != len(size):
            raise ValueError(
                f"problem {name!r}: {SIZE_PARAMS[name]} as a list must hold distinct sizes, "
                f"got {size!r}"
            )
        parts = tuple(
            (n, make_problem(name, **{**params, SIZE_PARAMS[name]: n})) for n in sorted(size)
        )
        return Mixture(parts)
    module_name, class_name = _PROBLEMS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    try:
        return cls(**params)
    except TypeError as error:
        raise ValueError(f"problem {name!r}: {error}") from error


def trace_statistics(
    name: str, params: dict, num_instances: int, *, context_limit: int, seed: int = 0
) -> dict[str, float]:
    """Lengths of ``num_instances`` instances of a problem, as the paper tabulates them.

    Returns:
        Medians and maxima of the chain-of-thought length (prompt and whole trace), of
        PENCIL's largest context (``max`` over ``subsequences`` of their length) and of
        the number of sub-sequences, and the fractions of instances whose CoT trace and
        whose PENCIL context exceed ``context_limit``.
    """
    problem = make_problem(name, **params)
    cot, context, count = [], [], []
    for i in range(num_instances):
        instance = problem.sample(np.random.default_rng([seed, i]))
        subs = subsequences(instance.prompt, instance.trace)
        cot.append(len(instance.prompt) + len(instance.trace))
        context.append(max(len(s.tokens) for s in subs))
        count.append(len(subs))
    cot, context, count = map(np.asarray, (cot, context, count))
    return {
        "cot_median": float(np.median(cot)),
        "cot_max": int(cot.max()),
        "pencil_context_median": float(np.median(context)),
        "pencil_context_max": int(context.max()),
        "subsequences_median": float(np.median(count)),
        "subsequences_max": int(count.max()),
        "cot_over_limit": float((cot > context_limit).mean()),
        "pencil_over_limit": float((context > context_limit).mean()),
    }
