"""Random 3-SAT with DPLL traces, PENCIL's SAT task.

An instance has ``num_vars`` variables and ``round(clause_ratio * num_vars)`` clauses of
``clause_size`` distinct variables with random signs (the paper's default ratio is 4.3,
near the satisfiability threshold). Half of the instances are satisfiable, built around
a planted assignment (clauses it falsifies are redrawn); the other half are drawn
uniformly until one is unsatisfiable (which DPLL, a complete solver, decides).

The trace is DPLL as recursive calls, each on the simplified formula::

    [CALL] Question: ( 1 ∨ ¬ 3 ∨ 4 ) ( ¬ 2 ∨ 3 ∨ 5 ) ...
        Found ( ¬ 2 ) Let 2 = False [CALL] Question: ... [SEP] Answer: False [RETURN]
        (or) Try 1 = True [CALL] Question: ... [SEP] Answer: False [RETURN]
             Try 1 = False [CALL] Question: ... [SEP] Answer: True [RETURN]
    [SEP] Answer: True [RETURN]

A call answers ``True`` at once when no clause is left and ``False`` when a clause is
empty (``( )``); otherwise it sets the variable of the first unit clause ("Found ...
Let ..."), or else branches on the smallest variable left, ``True`` first, and tries
``False`` only if ``True`` fails. Its answer is that of the last sub-call. The prompt is
``<|startoftext|>`` and the clauses, then ``<|endofprompt|>``; after the top call's
answer comes ``<|endoftext|>``.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from lhc.pencil.problems import Instance
from lhc.pencil.reduction import CALL, RETURN, SEP
from lhc.pencil.tokenizer import BOS, END_OF_PROMPT, EOS

Clause = tuple[int, ...]  # literals: +v or -v, variables numbered from 1
NOT, OR = "¬", "∨"
_MAX_UNSAT_DRAWS = 10_000
_WORDS = ("(", ")", NOT, OR, "Question:", "Answer:", "Found", "Let", "Try", "=", "True", "False")


def clause_tokens(clause: Clause) -> list[str]:
    """``( 1 ∨ ¬ 3 ∨ 4 )`` as tokens."""
    out = ["("]
    for i, literal in enumerate(clause):
        if i:
            out.append(OR)
        if literal < 0:
            out.append(NOT)
        out.append(str(abs(literal)))
    return out + [")"]


def formula_tokens(clauses: list[Clause]) -> list[str]:
    return [token for clause in clauses for token in clause_tokens(clause)]


def assign(clauses: list[Clause], variable: int, value: bool) -> list[Clause]:
    """The formula after setting ``variable``: satisfied clauses dropped, false literals
    removed (an emptied clause stays, empty)."""
    true_literal = variable if value else -variable
    out = []
    for clause in clauses:
        if true_literal in clause:
            continue
        out.append(tuple(literal for literal in clause if literal != -true_literal))
    return out


def dpll_trace(clauses: list[Clause]) -> tuple[bool, list[str]]:
    """DPLL on ``clauses``: ``(satisfiable, the call's tokens)`` (see the module docstring)."""
    tokens = [CALL, "Question:", *formula_tokens(clauses)]
    if not clauses:
        answer = True
    elif any(len(clause) == 0 for clause in clauses):
        answer = False
    else:
        unit = next((clause for clause in clauses if len(clause) == 1), None)
        if unit is not None:
            literal = unit[0]
            value = literal > 0
            tokens += ["Found", *clause_tokens(unit), "Let", str(abs(literal)), "=", str(value)]
            answer, sub = dpll_trace(assign(clauses, abs(literal), value))
            tokens += sub
        else:
            variable = min(abs(literal) for clause in clauses for literal in clause)
            for value in (True, False):
                tokens += ["Try", str(variable), "=", str(value)]
                answer, sub = dpll_trace(assign(clauses, variable, value))
                tokens += sub
                if answer:
                    break
    return answer, tokens + [SEP, "Answer:", str(answer), RETURN]


def brute_force_satisfiable(clauses: list[Clause], num_vars: int) -> bool:
    """Whether some assignment satisfies every clause (all ``2**num_vars`` tried)."""
    if num_vars > 24:
        raise ValueError(f"brute force over 2**{num_vars} assignments is too slow; num_vars <= 24")
    values = np.array(list(itertools.product([False, True], repeat=num_vars)), bool)
    satisfied = np.ones(len(values), bool)
    for clause in clauses:
        literal_true = [
            values[:, abs(lit) - 1] if lit > 0 else ~values[:, abs(lit) - 1] for lit in clause
        ]
        satisfied &= np.any(literal_true, axis=0) if literal_true else False
    return bool(satisfied.any())


@dataclasses.dataclass(frozen=True)
class SAT:
    """Random 3-SAT instances with DPLL traces.

    Attributes:
        num_vars: n, variables per instance (the paper: 5 to 10).
        clause_ratio: clauses per variable (4.3, the paper's default).
        clause_size: literals per clause (3).
    """

    num_vars: int = 5
    clause_ratio: float = 4.3
    clause_size: int = 3
    name: str = dataclasses.field(default="sat", init=False)

    def __post_init__(self):
        if not isinstance(self.num_vars, int) or self.num_vars < self.clause_size:
            raise ValueError(
                f"SAT num_vars must be an int >= clause_size={self.clause_size}, got "
                f"{self.num_vars!r}"
            )
        if not self.clause_size >= 1 or not self.clause_ratio > 0:
            raise ValueError(
                f"SAT needs clause_size >= 1 and clause_ratio > 0, got {self.clause_size} "
                f"and {self.clause_ratio}"
            )

    @property
    def num_clauses(self) -> int:
        return max(1, round(self.clause_ratio * self.num_vars))

    def symbols(self) -> tuple[str, ...]:
        return _WORDS + tuple(str(v) for v in range(1, self.num_vars + 1))

    def labels(self) -> tuple[str, ...]:
        return ("True", "False")

    def _clause(self, rng: np.random.Generator) -> Clause:
        variables = rng.choice(self.num_vars, size=self.clause_size, replace=False) + 1
        signs = rng.integers(0, 2, size=self.clause_size) * 2 - 1
        return tuple(int(v * s) for v, s in zip(variables, signs))

    def sample(self, rng: np.random.Generator) -> Instance:
        """Satisfiable (planted) or unsatisfiable with probability 1/2 each."""
        satisfiable = bool(rng.integers(2))
        if satisfiable:
            planted = rng.integers(0, 2, size=self.num_vars).astype(bool)
            clauses = []
            while len(clauses) < self.num_clauses:
                clause = self._clause(rng)
                if any(planted[abs(lit) - 1] == (lit > 0) for lit in clause):
                    clauses.append(clause)
            answer, trace = dpll_trace(clauses)
        else:
            for _ in range(_MAX_UNSAT_DRAWS):
                clauses = [self._clause(rng) for _ in range(self.num_clauses)]
                answer, trace = dpll_trace(clauses)
                if not answer:
                    break
            else:
                raise ValueError(
                    f"no unsatisfiable formula in {_MAX_UNSAT_DRAWS} draws with num_vars="
                    f"{self.num_vars}, clause_ratio={self.clause_ratio}: raise clause_ratio"
                )
        assert answer == satisfiable
        prompt = (BOS, *formula_tokens(clauses), END_OF_PROMPT)
        return Instance(
            prompt=prompt, trace=(*trace, EOS), label=str(answer), info={"clauses": clauses}
        )
