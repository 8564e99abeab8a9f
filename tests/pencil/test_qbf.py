"""The QBF generator, its brute-force evaluator and its quantifier-tree traces, against
an independent recursive evaluator and hand-written traces."""

from __future__ import annotations

import numpy as np
import pytest

from lhc.pencil import qbf as qbf_module
from lhc.pencil import reduction
from lhc.pencil.problems import make_problem, parse_answer, tokenizer_for
from lhc.pencil.qbf import QBF, evaluate_qbf, qbf_prompt, qbf_trace
from lhc.pencil.tokenizer import BOS, END_OF_PROMPT, EOS

# The official repository's example: ∃ 2 ∀ 3 ∀ 1 with two filler clauses (#1, #3).
EXAMPLE_PREFIX = [("∃", 2), ("∀", 3), ("∀", 1)]
EXAMPLE_CLAUSES = [(1, -1), (3, 1, -2), (-3, 3), (2,)]


def recursive_value(prefix, clauses, assignment=None):
    """The QBF's value by recursion over the prefix, both branches always evaluated."""
    assignment = assignment or {}
    if len(assignment) == len(prefix):
        return all(any(assignment[abs(lit)] == (lit > 0) for lit in clause) for clause in clauses)
    quantifier, variable = prefix[len(assignment)]
    branches = [recursive_value(prefix, clauses, {**assignment, variable: v}) for v in (0, 1)]
    return any(branches) if quantifier == "∃" else all(branches)


def random_formula(rng, num_vars):
    """A formula drawn independently of the module's generator (any clause count, empty
    clauses and tautologies included)."""
    prefix = [(str(rng.choice(["∃", "∀"])), int(v) + 1) for v in rng.permutation(num_vars)]
    clauses = []
    for _ in range(int(rng.integers(0, 3 * num_vars))):
        size = int(rng.integers(0, num_vars + 1))
        variables = rng.choice(num_vars, size=size, replace=True) + 1
        clauses.append(tuple(int(v) * int(rng.choice([-1, 1])) for v in variables))
    return prefix, clauses


def render_prompt(prefix, clauses):
    """The prompt as text, written from the format in the official example."""
    quantified = " ".join(f"{q} {v}" for q, v in prefix)
    numbered = " ".join(
        f"#{k} ( " + " ∨ ".join(f"¬ {-lit}" if lit < 0 else str(lit) for lit in clause) + " )"
        for k, clause in enumerate(clauses, start=1)
    )
    return f"{BOS} {quantified} : {numbered} {END_OF_PROMPT}"


def test_evaluate_qbf_hand_checked():
    clauses = [(1, 2), (-1, -2)]  # 2 must be the negation of 1
    assert evaluate_qbf([("∀", 1), ("∃", 2)], clauses) is True  # 2 chosen after 1
    assert evaluate_qbf([("∃", 2), ("∀", 1)], clauses) is False  # 2 chosen before 1
    assert evaluate_qbf([("∃", 1), ("∃", 2)], clauses) is True
    assert evaluate_qbf([("∀", 1), ("∀", 2)], [(1, -1)]) is True  # a tautology
    assert evaluate_qbf([("∃", 1)], [(1,), ()]) is False  # an empty clause
    assert evaluate_qbf([("∀", 1), ("∃", 2), ("∀", 3)], []) is True
    # Every assignment but 1 = 2 = 3 = False satisfies the matrix.
    assert evaluate_qbf([("∀", 1), ("∀", 2), ("∀", 3)], [(1, 2, 3)]) is False
    assert evaluate_qbf([("∀", 1), ("∀", 2), ("∃", 3)], [(1, 2, 3)]) is True
    assert evaluate_qbf(EXAMPLE_PREFIX, EXAMPLE_CLAUSES) is False  # ∀ 3, 1 falsify #2


def test_evaluate_qbf_and_trace_equal_recursion_on_random_formulas():
    rng = np.random.default_rng(0)
    values = []
    for _ in range(300):
        prefix, clauses = random_formula(rng, int(rng.integers(1, 7)))
        expected = recursive_value(prefix, clauses)
        assert evaluate_qbf(prefix, clauses) == expected
        answer, trace = qbf_trace(prefix, clauses)
        assert answer == expected
        assert trace[-4:] == [reduction.SEP, "Answer:", str(expected), reduction.RETURN]
        values.append(expected)
    assert 0.2 < np.mean(values) < 0.8  # both outcomes exercised


def test_trace_of_the_official_example():
    answer, trace = qbf_trace(EXAMPLE_PREFIX, EXAMPLE_CLAUSES)
    text = " ".join(trace)
    assert answer is False
    assert text.startswith(
        "[CALL] Question: prefix_from ∃ 2 Try 2 = False [CALL] Question: prefix_from ∀ 3 "
        "Try 3 = False [CALL] Question: prefix_from ∀ 1 Try 1 = False [CALL] Question: "
        "evaluate 1 = False 2 = False 3 = False Check #1 ( 1 ∨ ¬ 1 ) True Check #2 "
        "( 3 ∨ 1 ∨ ¬ 2 ) True Check #3 ( ¬ 3 ∨ 3 ) True Check #4 ( 2 ) False [SEP] Answer: "
        "False [RETURN] [SEP] Answer: False [RETURN] [SEP] Answer: False [RETURN] Try 2 = True "
        "[CALL] Question: prefix_from ∀ 3 Try 3 = False"
    )
    assert text.endswith("[SEP] Answer: False [RETURN]")
    assert " ".join(qbf_prompt(EXAMPLE_PREFIX, EXAMPLE_CLAUSES)) == (
        "<|startoftext|> ∃ 2 ∀ 3 ∀ 1 : #1 ( 1 ∨ ¬ 1 ) #2 ( 3 ∨ 1 ∨ ¬ 2 ) #3 ( ¬ 3 ∨ 3 ) "
        "#4 ( 2 ) <|endofprompt|>"
    )


def test_whole_trace_written_by_hand():
    # ∀ 1 ∃ 2: 1 = False needs 2 = True (2 = False fails #1); 1 = True is settled by
    # 2 = False, so its ∃ node stops after one branch.
    answer, trace = qbf_trace([("∀", 1), ("∃", 2)], [(1, 2), (-1, -2)])
    assert answer is True
    assert " ".join(trace) == (
        "[CALL] Question: prefix_from ∀ 1 "
        "Try 1 = False [CALL] Question: prefix_from ∃ 2 "
        "Try 2 = False [CALL] Question: evaluate 1 = False 2 = False "
        "Check #1 ( 1 ∨ 2 ) False [SEP] Answer: False [RETURN] "
        "Try 2 = True [CALL] Question: evaluate 1 = False 2 = True "
        "Check #1 ( 1 ∨ 2 ) True Check #2 ( ¬ 1 ∨ ¬ 2 ) True [SEP] Answer: True [RETURN] "
        "[SEP] Answer: True [RETURN] "
        "Try 1 = True [CALL] Question: prefix_from ∃ 2 "
        "Try 2 = False [CALL] Question: evaluate 1 = True 2 = False "
        "Check #1 ( 1 ∨ 2 ) True Check #2 ( ¬ 1 ∨ ¬ 2 ) True [SEP] Answer: True [RETURN] "
        "[SEP] Answer: True [RETURN] "
        "[SEP] Answer: True [RETURN]"
    )
    # ∃ 2 ∀ 1: the first ∀ 1 branch under 2 = False already fails, so ∀ stops there.
    answer, trace = qbf_trace([("∃", 2), ("∀", 1)], [(1, 2), (-1, -2)])
    assert answer is False
    assert " ".join(trace) == (
        "[CALL] Question: prefix_from ∃ 2 "
        "Try 2 = False [CALL] Question: prefix_from ∀ 1 "
        "Try 1 = False [CALL] Question: evaluate 1 = False 2 = False "
        "Check #1 ( 1 ∨ 2 ) False [SEP] Answer: False [RETURN] "
        "[SEP] Answer: False [RETURN] "
        "Try 2 = True [CALL] Question: prefix_from ∀ 1 "
        "Try 1 = False [CALL] Question: evaluate 1 = False 2 = True "
        "Check #1 ( 1 ∨ 2 ) True Check #2 ( ¬ 1 ∨ ¬ 2 ) True [SEP] Answer: True [RETURN] "
        "Try 1 = True [CALL] Question: evaluate 1 = True 2 = True "
        "Check #1 ( 1 ∨ 2 ) True Check #2 ( ¬ 1 ∨ ¬ 2 ) False [SEP] Answer: False [RETURN] "
        "[SEP] Answer: False [RETURN] "
        "[SEP] Answer: False [RETURN]"
    )


@pytest.mark.parametrize("num_vars", [3, 4, 5, 6])
def test_instances(num_vars):
    problem = make_problem("qbf", num_vars=num_vars)
    tokenizer = tokenizer_for(problem)
    rng = np.random.default_rng(num_vars)
    labels, fillers, sizes = [], 0, set()
    for index in range(50):
        instance = problem.sample(rng)
        prefix, clauses = instance.info["prefix"], instance.info["clauses"]
        assert sorted(v for _, v in prefix) == list(range(1, num_vars + 1))
        assert {q for q, _ in prefix} <= {"∃", "∀"}
        tautologies = [c for c in clauses if len(c) == 2 and c[0] == -c[1]]
        real = [c for c in clauses if c not in tautologies]
        assert len(real) == 2 * num_vars and 0 <= len(tautologies) <= 3
        assert all(1 <= len(c) <= 3 and len(set(map(abs, c))) == len(c) for c in real)
        fillers += len(tautologies)
        sizes.update(len(c) for c in real)
        value = recursive_value(prefix, clauses)
        assert instance.label == str(value) == str(evaluate_qbf(prefix, clauses))
        assert " ".join(instance.prompt) == render_prompt(prefix, clauses)
        assert instance.trace[-1] == EOS
        assert parse_answer(instance.trace, problem.labels()) == instance.label
        tokenizer.encode(instance.prompt + instance.trace)  # every token is known
        if index < 10:  # reducing is quadratic in the trace length: a few suffice
            reduced = reduction.reduce(instance.prompt + instance.trace)
            assert reduced == [*instance.prompt, "Answer:", instance.label, EOS]
        labels.append(value)
    assert 0.25 < np.mean(labels) < 0.75
    assert fillers > 0 and sizes == {1, 2, 3}


def test_labels_and_quantifiers_balanced():
    problem = QBF(num_vars=4)
    rng = np.random.default_rng(7)
    instances = [problem.sample(rng) for _ in range(300)]
    # 300 fair coins: 150 +- 8.7, so [110, 190] is beyond 4.5 standard deviations.
    assert 110 <= sum(i.label == "True" for i in instances) <= 190
    first_variables = {i.info["prefix"][0][1] for i in instances}
    assert first_variables == {1, 2, 3, 4}  # the prefix order is relabelled
    # Before the label selects them, formulas quantify each variable ∃ or ∀ evenly (true
    # formulas are mostly ∃: conditioned on the label, the quantifiers are skewed).
    prefixes = [problem._formula(rng)[0] for _ in range(2000)]
    exists = sum(q == "∃" for prefix in prefixes for q, _ in prefix) / (4 * len(prefixes))
    assert 0.47 < exists < 0.53  # 8000 coins: 0.5 +- 0.0056


def test_same_seed_same_instance():
    problem = QBF(num_vars=5)
    first = problem.sample(np.random.default_rng(123))
    again = problem.sample(np.random.default_rng(123))
    assert first == again and first.info == again.info
    assert first != problem.sample(np.random.default_rng(124))


def test_symbols():
    problem = QBF(num_vars=6, clause_ratio=2.0, max_filler_clauses=3)
    symbols = problem.symbols()
    assert "#15" in symbols and "#16" not in symbols  # 12 clauses + 3 fillers
    assert "6" in symbols and "7" not in symbols
    assert problem.labels() == ("True", "False") and problem.name == "qbf"
    assert tokenizer_for(problem).vocab_size == len(symbols) + 7


def test_bad_parameters():
    bad = [
        ("num_vars", dict(num_vars=0)),
        ("num_vars", dict(num_vars=5.0)),
        ("num_vars", dict(num_vars=True)),
        ("num_vars", dict(num_vars=25)),
        ("clause_ratio", dict(clause_ratio=0)),
        ("clause_ratio", dict(clause_ratio="2")),
        ("max_clause_size", dict(max_clause_size=0)),
        ("max_filler_clauses", dict(max_filler_clauses=-1)),
        ("max_filler_clauses", dict(max_filler_clauses=1.5)),
    ]
    for field, kwargs in bad:
        with pytest.raises(ValueError, match=f"QBF {field} must be"):
            QBF(**kwargs)
    with pytest.raises(ValueError, match="unexpected keyword"):
        make_problem("qbf", clause_size=3)
    with pytest.raises(ValueError, match="prefix must quantify"):
        evaluate_qbf([("∃", 1), ("∃", 1)], [(1,)])
    with pytest.raises(ValueError, match="prefix must quantify"):
        qbf_trace([("E", 1)], [(1,)])
    with pytest.raises(ValueError, match="only the variables 1..2"):
        evaluate_qbf([("∃", 1), ("∀", 2)], [(1, -3)])


def test_rejection_gives_up_with_a_clear_error(monkeypatch):
    # One variable under 30 unit clauses: true only if all 30 have the same sign.
    monkeypatch.setattr(qbf_module, "_MAX_DRAWS", 50)
    problem = QBF(num_vars=1, clause_ratio=30)
    with pytest.raises(ValueError, match="no True QBF in 50 draws with num_vars=1"):
        for seed in range(20):  # a label True comes up among 20 seeds
            problem.sample(np.random.default_rng(seed))
