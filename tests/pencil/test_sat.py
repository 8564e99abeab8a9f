"""The 3-SAT generator and its DPLL traces against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from lhc.pencil import reduction
from lhc.pencil.problems import make_problem, parse_answer, tokenizer_for, trace_statistics
from lhc.pencil.sat import SAT, assign, brute_force_satisfiable, dpll_trace
from lhc.pencil.tokenizer import BOS, END_OF_PROMPT, EOS


def test_dpll_answer_equals_brute_force_on_random_formulas():
    rng = np.random.default_rng(0)
    answers = []
    for _ in range(300):
        num_vars = int(rng.integers(3, 7))
        clauses = []
        for _ in range(int(rng.integers(1, 5 * num_vars))):
            size = int(rng.integers(1, 4))
            variables = rng.choice(num_vars, size=min(size, num_vars), replace=False) + 1
            clauses.append(tuple(int(v) * int(rng.choice([-1, 1])) for v in variables))
        answer, trace = dpll_trace(clauses)
        assert answer == brute_force_satisfiable(clauses, num_vars)
        assert reduction.reduce(trace) == ["Answer:", str(answer)]
        answers.append(answer)
    assert 0.2 < np.mean(answers) < 0.8  # both outcomes exercised


@pytest.mark.parametrize("num_vars", [3, 5, 7])
def test_instances(num_vars):
    problem = make_problem("sat", num_vars=num_vars)
    tokenizer = tokenizer_for(problem)
    rng = np.random.default_rng(num_vars)
    labels = []
    for _ in range(40):
        instance = problem.sample(rng)
        clauses = instance.info["clauses"]
        assert len(clauses) == round(4.3 * num_vars)
        assert all(len(set(map(abs, c))) == 3 for c in clauses)
        assert instance.label == str(brute_force_satisfiable(clauses, num_vars))
        assert instance.prompt[0] == BOS and instance.prompt[-1] == END_OF_PROMPT
        assert instance.trace[-1] == EOS
        reduced = reduction.reduce(instance.prompt + instance.trace)
        assert reduced[len(instance.prompt) :] == ["Answer:", instance.label, EOS]
        assert parse_answer(instance.trace, problem.labels()) == instance.label
        tokenizer.encode(instance.prompt + instance.trace)  # every token is known
        labels.append(instance.label == "True")
    assert 0.25 < np.mean(labels) < 0.75
    again = problem.sample(np.random.default_rng(123))
    assert again == problem.sample(np.random.default_rng(123))


def test_trace_format():
    answer, trace = dpll_trace([(1, -2, 3), (-1,), (2,)])
    assert answer is True
    text = " ".join(trace)
    assert text.startswith(
        "[CALL] Question: ( 1 ∨ ¬ 2 ∨ 3 ) ( ¬ 1 ) ( 2 ) Found ( ¬ 1 ) Let 1 = False"
    )
    assert text.endswith("[SEP] Answer: True [RETURN]")
    assert assign([(1, -2), (2, 3)], 2, False) == [(3,)]
    assert assign([(1, -2), (2,)], 2, False) == [()]  # an emptied clause stays


def test_bad_parameters():
    for kwargs in (dict(num_vars=2), dict(num_vars=5.0), dict(clause_ratio=0)):
        with pytest.raises(ValueError, match="SAT"):
            SAT(**kwargs)
    with pytest.raises(ValueError, match="problem must be one of"):
        make_problem("sudoku")
    with pytest.raises(ValueError, match="unexpected keyword"):
        make_problem("sat", size=3)
    with pytest.raises(ValueError, match="no unsatisfiable formula"):
        SAT(num_vars=20, clause_ratio=0.1).sample(np.random.default_rng(1))


def test_trace_statistics():
    stats = trace_statistics("sat", dict(num_vars=4), 20, context_limit=300, seed=3)
    cot, context = [], []
    for i in range(20):
        instance = SAT(num_vars=4).sample(np.random.default_rng([3, i]))
        cot.append(len(instance.prompt) + len(instance.trace))
        context.append(
            max(len(s.tokens) for s in reduction.subsequences(instance.prompt, instance.trace))
        )
    assert stats["cot_max"] == max(cot) and stats["pencil_context_max"] == max(context)
    assert stats["cot_over_limit"] == np.mean(np.array(cot) > 300)
    assert stats["pencil_over_limit"] == np.mean(np.array(context) > 300)
    assert stats["pencil_context_median"] <= stats["cot_median"]
