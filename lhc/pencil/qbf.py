"""Random quantified Boolean formulas with traces of the quantifier tree, PENCIL's QBF task.

An instance is a QBF in prenex CNF over ``num_vars`` variables (numbered from 1): each
variable is quantified ``∃`` or ``∀`` with probability 1/2, in a random order (the prefix
is a random permutation of the variables: the relabelling that keeps a model from
learning a fixed quantifier order). The matrix has ``round(clause_ratio * num_vars)``
clauses of 1 to ``max_clause_size`` distinct variables with random signs, and 0 to
``max_filler_clauses`` tautologies such as ``( 1 ∨ ¬ 1 )`` inserted at random places (the
official generator's filler clauses, which a solver must check and can never fail on).
The label is the truth value of the QBF. Half of the instances are true: the label is
drawn first and formulas are redrawn until the brute-force value (``evaluate_qbf``)
matches it. (The official generator builds true formulas from an AND/OR "aggregator"
encoding and false ones by perturbing them; rejection sampling gives formulas from the
plain random distribution conditioned on the label instead.) True formulas are rare in
that distribution (about 3% at n = 5, 0.2% at n = 9, 0.04% at n = 11, so a true instance
costs hundreds to thousands of draws, ~50 us each), and the condition shows: true
instances quantify about 86% of their variables with ``∃`` (false ones about half) and
never have a unit clause on a ``∀`` variable (most false ones do).

The prompt is the prefix, ``:``, and the numbered clauses::

    <|startoftext|> ∃ 2 ∀ 3 ∀ 1 : #1 ( 1 ∨ ¬ 1 ) #2 ( 3 ∨ 1 ∨ ¬ 2 ) #3 ( ¬ 3 ∨ 3 )
    #4 ( 2 ) <|endofprompt|>

The trace walks the quantifier tree with one call per node. The node of the prefix
suffix that starts at ``Q v`` tries ``v = False``, then ``v = True`` unless the first
answer already decides it (``∃`` needs one ``True``, ``∀`` one ``False``)::

    [CALL] Question: prefix_from ∃ 2
        Try 2 = False [CALL] Question: prefix_from ∀ 3 ... [SEP] Answer: False [RETURN]
        Try 2 = True [CALL] Question: prefix_from ∀ 3 ... [SEP] Answer: False [RETURN]
    [SEP] Answer: False [RETURN]

A leaf (every variable set) lists the assignment in variable order and checks the
clauses in prompt order, stopping at the first false one::

    [CALL] Question: evaluate 1 = False 2 = False 3 = False Check #1 ( 1 ∨ ¬ 1 ) True
        Check #2 ( 3 ∨ 1 ∨ ¬ 2 ) True Check #3 ( ¬ 3 ∨ 3 ) True Check #4 ( 2 ) False
    [SEP] Answer: False [RETURN]

The top call covers the whole prefix; after its answer comes ``<|endoftext|>``. Reduced,
the trace leaves ``Answer: <label> <|endoftext|>`` after the prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence

import numpy as np

from lhc.pencil.problems import Instance
from lhc.pencil.reduction import CALL, RETURN, SEP
from lhc.pencil.sat import NOT, OR, Clause, clause_tokens
from lhc.pencil.tokenizer import BOS, END_OF_PROMPT, EOS

EXISTS, FORALL = "∃", "∀"
Prefix = Sequence[tuple[str, int]]  # (quantifier, variable), outermost first
# Formulas tried per instance: ample for true ones up to n = 12 or so (P(true) ~ 1e-4).
_MAX_DRAWS = 100_000
_MAX_BRUTE_FORCE_VARS = 24
_WORDS = (
    "(",
    ")",
    NOT,
    OR,
    EXISTS,
    FORALL,
    ":",
    "Question:",
    "prefix_from",
    "evaluate",
    "Try",
    "=",
    "Check",
    "Answer:",
    "True",
    "False",
)


def _check_formula(prefix: Prefix, clauses: Sequence[Clause]) -> int:
    """The number of variables; ``ValueError`` unless the prefix quantifies each of
    ``1..n`` once and the clauses use only those variables."""
    quantifiers = [quantifier for quantifier, _ in prefix]
    variables = sorted(variable for _, variable in prefix)
    num_vars = len(variables)
    if variables != list(range(1, num_vars + 1)) or not set(quantifiers) <= {EXISTS, FORALL}:
        raise ValueError(
            f"a QBF prefix must quantify each of the variables 1..n once with {EXISTS} or "
            f"{FORALL}, got {list(prefix)}"
        )
    bad = [clause for clause in clauses if any(not 1 <= abs(lit) <= num_vars for lit in clause)]
    if bad:
        raise ValueError(f"clauses may use only the variables 1..{num_vars}, got {bad}")
    return num_vars


@functools.cache
def _true_where(num_vars: int) -> tuple[int, ...]:
    """For each variable, the assignments (bits of a ``2**num_vars``-bit int) where it is
    true: assignment ``r`` gives variable ``v`` the value of bit ``v - 1`` of ``r``."""
    all_ones = (1 << (1 << num_vars)) - 1
    masks = []
    for variable in range(1, num_vars + 1):
        stride = 1 << (variable - 1)
        # The upper half of every block of 2 * stride bits, repeated over the whole int.
        block = ((1 << stride) - 1) << stride
        masks.append(block * (all_ones // ((1 << (2 * stride)) - 1)))
    return tuple(masks)


def evaluate_qbf(prefix: Prefix, clauses: Sequence[Clause]) -> bool:
    """The truth value of a QBF by brute force, independently of the trace.

    The matrix is evaluated on all ``2**n`` assignments at once, as a truth table packed
    in an int (one bit per assignment: fast enough to reject thousands of formulas per
    instance). The quantifiers are then folded from the innermost out: each bit is
    combined with the bit of the assignment that flips the variable (``or`` for ``∃``,
    ``and`` for ``∀``), after which the table no longer depends on that variable; once
    every variable is folded, all bits hold the value.

    Args:
        prefix: ``(quantifier, variable)`` pairs, outermost first, quantifying each of
            the variables ``1..n`` once.
        clauses: the matrix, each clause a tuple of literals ``+v``/``-v`` (an empty
            clause is false).

    Raises:
        ValueError: a malformed formula, or more than 24 variables.
    """
    num_vars = _check_formula(prefix, clauses)
    if num_vars > _MAX_BRUTE_FORCE_VARS:
        raise ValueError(
            f"brute force over 2**{num_vars} assignments is too slow; at most "
            f"{_MAX_BRUTE_FORCE_VARS} variables"
        )
    true_where = _true_where(num_vars)
    all_ones = (1 << (1 << num_vars)) - 1
    table = all_ones
    for clause in clauses:
        clause_true = 0
        for literal in clause:
            where = true_where[abs(literal) - 1]
            clause_true |= where if literal > 0 else all_ones ^ where
        table &= clause_true
    for quantifier, variable in reversed(prefix):
        stride, where = 1 << (variable - 1), true_where[variable - 1]
        flipped = ((table & where) >> stride) | ((table & (all_ones ^ where)) << stride)
        table = table | flipped if quantifier == EXISTS else table & flipped
    return bool(table & 1)


def qbf_prompt(prefix: Prefix, clauses: Sequence[Clause]) -> tuple[str, ...]:
    """``<|startoftext|> ∃ 2 ∀ 1 : #1 ( 1 ∨ ¬ 2 ) ... <|endofprompt|>`` as tokens."""
    tokens = [BOS]
    for quantifier, variable in prefix:
        tokens += [quantifier, str(variable)]
    tokens.append(":")
    for number, clause in enumerate(clauses, start=1):
        tokens += [f"#{number}", *clause_tokens(clause)]
    return (*tokens, END_OF_PROMPT)


def _leaf_trace(assignment: dict[int, bool], clauses: Sequence[Clause]) -> tuple[bool, list[str]]:
    tokens = [CALL, "Question:", "evaluate"]
    for variable in sorted(assignment):
        tokens += [str(variable), "=", str(assignment[variable])]
    answer = True
    for number, clause in enumerate(clauses, start=1):
        clause_true = any(assignment[abs(literal)] == (literal > 0) for literal in clause)
        tokens += ["Check", f"#{number}", *clause_tokens(clause), str(clause_true)]
        if not clause_true:
            answer = False
            break
    return answer, tokens + [SEP, "Answer:", str(answer), RETURN]


def _node_trace(
    prefix: Prefix, clauses: Sequence[Clause], assignment: dict[int, bool]
) -> tuple[bool, list[str]]:
    if len(assignment) == len(prefix):
        return _leaf_trace(assignment, clauses)
    quantifier, variable = prefix[len(assignment)]
    tokens = [CALL, "Question:", "prefix_from", quantifier, str(variable)]
    # The value that settles the node at once: one true branch for ∃, one false for ∀.
    deciding = quantifier == EXISTS
    for value in (False, True):
        tokens += ["Try", str(variable), "=", str(value)]
        answer, sub = _node_trace(prefix, clauses, {**assignment, variable: value})
        tokens += sub
        if answer == deciding:
            break
    return answer, tokens + [SEP, "Answer:", str(answer), RETURN]


def qbf_trace(prefix: Prefix, clauses: Sequence[Clause]) -> tuple[bool, list[str]]:
    """The walk of the quantifier tree: ``(value, the top call's tokens)`` (see the module
    docstring; ``<|endoftext|>`` not included).

    Raises:
        ValueError: a malformed formula.
    """
    _check_formula(prefix, clauses)
    return _node_trace(list(prefix), list(clauses), {})


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class QBF:
    """Random prenex-CNF QBF instances with traces of the quantifier tree.

    Attributes:
        num_vars: n, variables per instance (the trace grows as ``2**n`` in the worst
            case; true formulas get rarer, see the module docstring).
        clause_ratio: clauses per variable, filler clauses aside (2).
        max_clause_size: clauses have 1 to this many literals (3; at most ``num_vars``).
        max_filler_clauses: 0 to this many tautologies are added (3).
    """

    num_vars: int = 5
    clause_ratio: float = 2.0
    max_clause_size: int = 3
    max_filler_clauses: int = 3
    name: str = dataclasses.field(default="qbf", init=False)

    def __post_init__(self):
        if not _is_int(self.num_vars) or not 1 <= self.num_vars <= _MAX_BRUTE_FORCE_VARS:
            raise ValueError(
                f"QBF num_vars must be an int in [1, {_MAX_BRUTE_FORCE_VARS}], got "
                f"{self.num_vars!r}"
            )
        if isinstance(self.clause_ratio, bool) or not (
            isinstance(self.clause_ratio, numbers.Real) and self.clause_ratio > 0
        ):
            raise ValueError(f"QBF clause_ratio must be a number > 0, got {self.clause_ratio!r}")
        if not _is_int(self.max_clause_size) or self.max_clause_size < 1:
            raise ValueError(
                f"QBF max_clause_size must be an int >= 1, got {self.max_clause_size!r}"
            )
        if not _is_int(self.max_filler_clauses) or self.max_filler_clauses < 0:
            raise ValueError(
                f"QBF max_filler_clauses must be an int >= 0, got {self.max_filler_clauses!r}"
            )

    @property
    def num_clauses(self) -> int:
        """Clauses per instance, filler clauses aside."""
        return max(1, round(self.clause_ratio * self.num_vars))

    def symbols(self) -> tuple[str, ...]:
        max_clauses = self.num_clauses + self.max_filler_clauses
        return (
            _WORDS
            + tuple(f"#{k}" for k in range(1, max_clauses + 1))
            + tuple(str(v) for v in range(1, self.num_vars + 1))
        )

    def labels(self) -> tuple[str, ...]:
        return ("True", "False")

    def _formula(self, rng: np.random.Generator) -> tuple[list[tuple[str, int]], list[Clause]]:
        """A random prefix and matrix (filler clauses included), label aside."""
        order = (rng.permutation(self.num_vars) + 1).tolist()
        quantifiers = rng.integers(0, 2, size=self.num_vars).tolist()
        prefix = [(EXISTS if q else FORALL, v) for q, v in zip(quantifiers, order)]
        # All clauses at once: each row's argsort of random keys is a random permutation,
        # whose first `size` entries are the clause's distinct variables.
        width = min(self.max_clause_size, self.num_vars)
        variables = rng.random((self.num_clauses, self.num_vars)).argsort(axis=1)[:, :width] + 1
        signs = rng.integers(0, 2, size=(self.num_clauses, width)) * 2 - 1
        sizes = rng.integers(1, width + 1, size=self.num_clauses).tolist()
        literals = (variables * signs).tolist()
        clauses = [tuple(row[:size]) for row, size in zip(literals, sizes)]
        for _ in range(int(rng.integers(0, self.max_filler_clauses + 1))):
            variable = int(rng.integers(1, self.num_vars + 1))
            filler = (variable, -variable) if rng.integers(2) else (-variable, variable)
            clauses.insert(int(rng.integers(0, len(clauses) + 1)), filler)
        return prefix, clauses

    def sample(self, rng: np.random.Generator) -> Instance:
        """True or false with probability 1/2 each (formulas redrawn until the value is
        the label drawn)."""
        label = bool(rng.integers(2))
        for _ in range(_MAX_DRAWS):
            prefix, clauses = self._formula(rng)
            if evaluate_qbf(prefix, clauses) == label:
                break
        else:
            raise ValueError(
                f"no {label} QBF in {_MAX_DRAWS} draws with num_vars={self.num_vars}, "
                f"clause_ratio={self.clause_ratio}, max_clause_size={self.max_clause_size}: "
                f"{'lower' if label else 'raise'} clause_ratio"
            )
        answer, trace = qbf_trace(prefix, clauses)
        assert answer == label
        return Instance(
            prompt=qbf_prompt(prefix, clauses),
            trace=(*trace, EOS),
            label=str(answer),
            info={"prefix": prefix, "clauses": clauses},
        )
