"""The Einstein puzzle generator and its traces against brute force, a clue checker and
a re-implementation of the trace's deductions written here."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from lhc.pencil import reduction
from lhc.pencil.einstein import (
    Clue,
    Einstein,
    brute_force_solutions,
    count_solutions,
    solver_trace,
)
from lhc.pencil.problems import make_problem, parse_answer, tokenizer_for
from lhc.pencil.reduction import CALL, RETURN, SEP
from lhc.pencil.tokenizer import BOS, END_OF_PROMPT, EOS

NATIONALITIES = ["Brit", "Swede", "Dane", "Norwegian", "German"]
VALUES = {  # the first k attributes and values of a k x k puzzle, as documented
    "Nationality": NATIONALITIES,
    "Color": ["Red", "Green", "White", "Yellow", "Blue"],
    "Pet": ["Fish", "Dog", "Bird", "Cat", "Horse"],
    "Drink": ["Tea", "Coffee", "Milk", "Beer", "Water"],
    "Smoke": ["PallMall", "Dunhill", "Blends", "BlueMaster", "Prince"],
}


def puzzle_values(size):
    return {name: values[:size] for name, values in list(VALUES.items())[:size]}


def attribute_of(value):
    return next(name for name, values in VALUES.items() if value in values)


def houses_of(table):
    """value -> house number (1-based) of a solution table (rows are houses)."""
    return {value: house for house, row in enumerate(table, start=1) for value in row}


def clue_holds(clue, table):
    where = houses_of(table)
    x = where[clue.first]
    if clue.kind == "at":
        return x == clue.second
    if clue.kind == "not_at":
        return x != clue.second
    y = where[clue.second]
    return {
        "same": x == y,
        "left": x + 1 == y,
        "next": abs(x - y) == 1,
        "before": x < y,
    }[clue.kind]


def fish_owner(table, size):
    names = list(puzzle_values(size))
    row = next(row for row in table if row[names.index("Pet")] == "Fish")
    return row[names.index("Nationality")]


def all_tables(size):
    """Every table, row by row (itertools, not numpy: a second brute force)."""
    columns = [list(itertools.permutations(values)) for values in puzzle_values(size).values()]
    for choice in itertools.product(*columns):
        yield tuple(tuple(column[house] for column in choice) for house in range(size))


def random_clue(rng, size):
    """Any clue on the puzzle's values, true or not."""
    values = [value for values in puzzle_values(size).values() for value in values]
    kind = ["at", "not_at", "same", "left", "next", "before"][rng.integers(6)]
    first, second = rng.choice(values, size=2, replace=False)
    if kind in ("at", "not_at"):
        return Clue(kind, str(first), int(rng.integers(1, size + 1)))
    return Clue(kind, str(first), str(second))


def parse_state(tokens, start, size):
    """``House 1 : Nationality Brit Dane ; ...`` from ``tokens[start]``: ({(house,
    attribute): [values]}, index after the state)."""
    state, i = {}, start
    for house in range(1, size + 1):
        assert tokens[i : i + 3] == ["House", str(house), ":"], tokens[i : i + 3]
        i += 3
        for attribute in puzzle_values(size):
            assert tokens[i] == attribute
            end = tokens.index(";", i)
            state[house, attribute] = tokens[i + 1 : end]
            i = end + 1
    return state, i


def apply_steps(state, steps, size):
    """The deductions as the module docstring defines them, each checked to remove
    something that was there."""
    state = {cell: list(values) for cell, values in state.items()}
    i = 0
    while i < len(steps):
        if steps[i + 1 : i + 2] == ["ok"] or steps[i + 2 : i + 3] == ["ok"]:  # nothing removed
            i += 3 if steps[i] == "Clue" else 2
        elif steps[i] == "Clue":  # Clue n : House h Attr ≠ v
            assert steps[i + 2 : i + 4] == [":", "House"] and steps[i + 6] == "≠"
            cell, value = (int(steps[i + 4]), steps[i + 5]), steps[i + 7]
            state[cell].remove(value)
            i += 8
        elif steps[i] == "House":  # House h Attr = v: v nowhere else
            assert steps[i + 3] == "="
            house, attribute, value = int(steps[i + 1]), steps[i + 2], steps[i + 4]
            assert state[house, attribute] == [value]
            removed = [h for h in range(1, size + 1) if h != house and value in state[h, attribute]]
            assert removed
            for h in removed:
                state[h, attribute].remove(value)
            i += 5
        else:  # v only House h: nothing else in that cell
            assert steps[i + 1 : i + 3] == ["only", "House"]
            value, house = steps[i], int(steps[i + 3])
            cell = (house, attribute_of(value))
            holders = [h for h in range(1, size + 1) if value in state[h, cell[1]]]
            assert holders == [house] and len(state[cell]) > 1
            state[cell] = [value]
            i += 4
    return state


RELATIONS = {  # clue kind -> whether houses (x, y) of its two values fit it
    "same": lambda x, y: x == y,
    "left": lambda x, y: x + 1 == y,
    "next": lambda x, y: abs(x - y) == 1,
    "before": lambda x, y: x < y,
}


def clue_removals(clue, state, size):
    """``[(house, value)]`` that the clue rules out in ``state``: X's houses with no fitting
    house of Y, then Y's houses with no fitting house left for X (in house order)."""

    def houses(value):
        return [h for h in range(1, size + 1) if value in state[h, attribute_of(value)]]

    x_houses = houses(clue.first)
    if clue.kind == "at":
        return [(h, clue.first) for h in x_houses if h != clue.second]
    if clue.kind == "not_at":
        return [(h, clue.first) for h in x_houses if h == clue.second]
    fits = RELATIONS[clue.kind]
    y_houses = houses(clue.second)
    x_left = [h for h in x_houses if any(fits(h, g) for g in y_houses)]
    y_left = [g for g in y_houses if any(fits(h, g) for h in x_left)]
    return [(h, clue.first) for h in x_houses if h not in x_left] + [
        (g, clue.second) for g in y_houses if g not in y_left
    ]


def expected_call(state, clues, size):
    """What a call on ``state`` writes before ``[SEP]`` by the module docstring's rules:
    ``(steps, outcome)``, outcome ``"changed"``, ``"contradiction"`` (the steps end with
    the reason) or ``"stuck"`` (no rule removes anything)."""
    state = {cell: list(values) for cell, values in state.items()}
    values_of = puzzle_values(size)

    def houses(value):
        return [h for h in range(1, size + 1) if value in state[h, attribute_of(value)]]

    def contradiction():  # values first, then cells house by house
        for values in values_of.values():
            for value in values:
                if not houses(value):
                    return [value, "nowhere"]
        for house in range(1, size + 1):
            for attribute in values_of:
                if not state[house, attribute]:
                    return ["House", str(house), attribute, "empty"]
        return None

    checked = []  # the rules that removed nothing, in order
    for number, clue in enumerate(clues, start=1):  # the first clue that removes something
        removals = clue_removals(clue, state, size)
        if not removals:
            checked += ["Clue", str(number), "ok"]
        else:
            steps = list(checked)
            for house, value in removals:
                attribute = attribute_of(value)
                steps += ["Clue", str(number), ":", "House", str(house), attribute, "≠", value]
                state[house, attribute].remove(value)
            reason = contradiction()
            return (steps + reason, "contradiction") if reason else (steps, "changed")
    for attribute, values in values_of.items():  # else the first attribute's all-different
        steps = list(checked)
        for house in range(1, size + 1):
            if len(state[house, attribute]) == 1:
                value = state[house, attribute][0]
                elsewhere = [h for h in houses(value) if h != house]
                if elsewhere:
                    for h in elsewhere:
                        state[h, attribute].remove(value)
                    steps += ["House", str(house), attribute, "=", value]
                    if reason := contradiction():
                        return steps + reason, "contradiction"
        for value in values:
            value_houses = houses(value)
            if len(value_houses) == 1 and len(state[value_houses[0], attribute]) > 1:
                state[value_houses[0], attribute] = [value]
                steps += [value, "only", "House", str(value_houses[0])]
                if reason := contradiction():
                    return steps + reason, "contradiction"
        if steps != checked:
            return steps, "changed"
        checked = checked + [attribute, "ok"]
    return checked, "stuck"


def check_calls(prompt, trace, size, clues, table=None):
    """Replays every sub-sequence that ends a call and checks what the call wrote against
    ``expected_call`` on its state: the deductions, the new state of a tail call (also
    by ``apply_steps``), contradictions, solved states, the branching cell and order.
    With the solution ``table``: no candidate of it is lost before the first guess.

    Returns:
        How often each kind of ending occurred.
    """
    endings = collections.Counter()
    for sub in reduction.subsequences(prompt, trace):
        tokens = list(sub.tokens)
        if tokens[-1] != RETURN:
            continue
        sep = len(tokens) - 1 - tokens[::-1].index(SEP)
        call = sep - tokens[sep::-1].index(CALL)
        assert tokens[call + 1] == "Question:"
        state, after = parse_state(tokens, call + 2, size)
        body, answer = tokens[after:sep], tokens[sep + 1 : -1]
        if table is not None and "Try" not in tokens:  # the true value is still everywhere
            for house, row in enumerate(table, start=1):
                for attribute, value in zip(puzzle_values(size), row):
                    assert value in state[house, attribute]
        steps, outcome = expected_call(state, clues, size)
        if answer[0] == CALL:  # tail call
            assert outcome == "changed" and body == steps
            assert answer[1] == "Question:"
            new_state, end = parse_state(answer, 2, size)
            assert end == len(answer) and apply_steps(state, body, size) == new_state
            endings["tail call"] += 1
        elif outcome == "contradiction":
            assert body == steps and answer == ["Answer:", "None"]
            endings[body[-1]] += 1  # empty or nowhere
            # the reason holds once the deductions before it are applied
            after_steps = apply_steps(state, body[: -4 if body[-1] == "empty" else -2], size)
            if body[-1] == "empty":
                assert after_steps[int(body[-3]), body[-2]] == []
            else:
                assert not any(body[-2] in values for values in after_steps.values())
        elif all(len(values) == 1 for values in state.values()):  # solved
            assert outcome == "stuck"
            solved = [[state[h, a][0] for a in puzzle_values(size)] for h in range(1, size + 1)]
            assert all(clue_holds(clue, solved) for clue in clues)
            house = next(h for h in range(1, size + 1) if state[h, "Pet"] == ["Fish"])
            owner = state[house, "Nationality"][0]
            assert body == steps + ["Fish", "=", "House", str(house), "Nationality", "=", owner]
            assert answer == ["Answer:", owner]
            endings["solved"] += 1
        else:  # branched: Try House h Attr = v Answer: X, for each v in turn
            assert outcome == "stuck"
            undecided = [cell for cell, values in state.items() if len(values) > 1]
            fewest = min(len(state[cell]) for cell in undecided)
            house, attribute = next(cell for cell in undecided if len(state[cell]) == fewest)
            assert body[: len(steps)] == steps  # every rule checked, none removes anything
            body = body[len(steps) :]
            tries = [body[i : i + 8] for i in range(0, len(body), 8)]
            assert 8 * len(tries) == len(body)
            for value, attempt in zip(state[house, attribute], tries):
                assert attempt[:6] == ["Try", "House", str(house), attribute, "=", value]
                assert attempt[6] == "Answer:"
            results = [attempt[7] for attempt in tries]
            assert all(result == "None" for result in results[:-1])
            assert results[-1] != "None" or len(tries) == fewest
            assert answer == ["Answer:", results[-1]]
            endings["branched"] += 1
    return endings


def test_hand_made_puzzle():
    # Brit in 2 with Red; Green right of Red, so White in 1; Fish with Red; Dog left of
    # Bird; Swede with Green. Unique: (Dane White Dog) (Brit Red Fish) (Swede Green Bird).
    clues = [
        Clue("at", "Brit", 2),
        Clue("same", "Brit", "Red"),
        Clue("left", "Red", "Green"),
        Clue("same", "Fish", "Red"),
        Clue("before", "Dog", "Bird"),
        Clue("same", "Swede", "Green"),
    ]
    expected = (("Dane", "White", "Dog"), ("Brit", "Red", "Fish"), ("Swede", "Green", "Bird"))
    assert brute_force_solutions(3, clues) == [expected]
    assert count_solutions(3, clues) == 1
    answer, trace = solver_trace(3, clues)
    assert answer == "Brit"
    assert reduction.reduce(trace) == ["Answer:", "Brit"]
    without_order = [clue for clue in clues if clue.kind != "before"]  # Dog and Bird swap
    assert count_solutions(3, without_order) == 2
    assert len(brute_force_solutions(3, without_order)) == 2
    assert count_solutions(3, [*clues, Clue("next", "Dane", "Swede")]) == 0
    answer, trace = solver_trace(3, [*clues, Clue("next", "Dane", "Swede")])
    assert answer is None and trace[-3:] == ["Answer:", "None", RETURN]


def test_brute_force_against_itertools():
    rng = np.random.default_rng(0)
    tables = list(all_tables(3))
    assert len(tables) == 216
    assert sorted(brute_force_solutions(3, [], limit=1000)) == sorted(tables)
    for _ in range(30):
        clues = [random_clue(rng, 3) for _ in range(int(rng.integers(1, 6)))]
        expected = [t for t in tables if all(clue_holds(c, t) for c in clues)]
        assert sorted(brute_force_solutions(3, clues, limit=1000)) == sorted(expected)
    with pytest.raises(ValueError, match="size 3 or 4"):
        brute_force_solutions(5, [])


@pytest.mark.parametrize("size", [3, 4])
def test_counter_and_solver_against_brute_force(size):
    rng = np.random.default_rng(size)
    counts, endings = [], collections.Counter()
    for _ in range(60 if size == 3 else 8):
        low = 1 if size == 3 else 8  # few 4x4 tables left: their conversion is slow
        clues = [random_clue(rng, size) for _ in range(int(rng.integers(low, 3 * size)))]
        solutions = brute_force_solutions(size, clues, limit=10**6)
        assert count_solutions(size, clues, limit=3) == min(len(solutions), 3)
        answer, trace = solver_trace(size, clues)
        if solutions:  # the solver finds one of them
            assert answer in {fish_owner(table, size) for table in solutions}
        else:
            assert answer is None
        assert reduction.reduce(trace) == ["Answer:", str(answer)]
        endings += check_calls([BOS], trace, size, clues)
        counts.append(min(len(solutions), 2))
    assert {0, 1, 2} <= set(counts) if size == 3 else len(set(counts)) > 1
    assert set(endings) == {"tail call", "branched", "empty", "nowhere", "solved"}


@pytest.mark.parametrize("size, num_samples", [(3, 25), (4, 3)])
def test_instances_are_unique_and_minimal(size, num_samples):
    problem = Einstein(size)
    tokenizer = tokenizer_for(problem)
    rng = np.random.default_rng(10 + size)
    branched = 0
    for _ in range(num_samples):
        instance = problem.sample(rng)
        table, clues = instance.info["solution"], instance.info["clues"]
        for column, values in zip(zip(*table), puzzle_values(size).values()):
            assert sorted(column) == sorted(values)
        assert brute_force_solutions(size, clues, limit=10) == [table]
        for i in range(len(clues)):  # minimal: any clue removed admits a second solution
            assert len(brute_force_solutions(size, clues[:i] + clues[i + 1 :])) == 2
        assert instance.label == fish_owner(table, size)
        assert parse_answer(instance.trace, problem.labels()) == instance.label
        assert instance.prompt[0] == BOS and instance.prompt[-1] == END_OF_PROMPT
        reduced = reduction.reduce(instance.prompt + instance.trace)
        assert reduced[len(instance.prompt) :] == ["Answer:", instance.label, EOS]
        tokenizer.encode(instance.prompt + instance.trace)  # every token is known
        endings = check_calls(instance.prompt, instance.trace, size, clues, table)
        assert endings["tail call"] > 0
        branched += "Try" in instance.trace
    if size == 3:
        assert branched > 0  # branching is exercised


def test_five_by_five():
    problem = make_problem("einstein", size=5)
    tokenizer = tokenizer_for(problem)
    rng = np.random.default_rng(5)
    for _ in range(3):
        instance = problem.sample(rng)
        table, clues = instance.info["solution"], instance.info["clues"]
        for column, values in zip(zip(*table), puzzle_values(5).values()):
            assert sorted(column) == sorted(values)
        assert all(clue_holds(clue, table) for clue in clues)
        assert instance.label == fish_owner(table, 5)
        reduced = reduction.reduce(instance.prompt + instance.trace)
        assert reduced[len(instance.prompt) :] == ["Answer:", instance.label, EOS]
        tokenizer.encode(instance.prompt + instance.trace)
        endings = check_calls(instance.prompt, instance.trace, 5, clues, table)
        assert endings["tail call"] > 0
        subsequences = reduction.subsequences(instance.prompt, instance.trace)
        assert max(len(sub.tokens) for sub in subsequences) <= 2048  # the paper's context


def test_prompt_and_tail_call_format():
    instance = Einstein(3).sample(np.random.default_rng(0))
    clues = instance.info["clues"]
    words = {"at": "=", "not_at": "≠"}
    expected = [BOS]
    for number, clue in enumerate(clues, start=1):
        second = ["House", str(clue.second)] if clue.kind in words else [clue.second]
        expected += ["Clue", str(number), ":", clue.first, words.get(clue.kind, clue.kind)]
        expected += second
    assert list(instance.prompt) == [*expected, END_OF_PROMPT]
    text = " ".join(instance.trace)
    full_state = " ".join(
        f"House {h} : Nationality Brit Swede Dane ; Color Red Green White ; Pet Fish Dog Bird ;"
        for h in (1, 2, 3)
    )
    assert text.startswith(f"[CALL] Question: {full_state} Clue 1 : ")
    # The first tail call reduces to the new state alone: the deductions are erased.
    trace = list(instance.trace)
    first_return = trace.index(RETURN)
    assert trace[trace.index(SEP) + 1] == CALL
    prefix = list(instance.prompt) + trace[: first_return + 1]
    new_state = trace[trace.index(SEP) + 1 : first_return]
    assert reduction.reduce_once(prefix) == [*instance.prompt, *new_state]
    assert new_state[:2] == [CALL, "Question:"] and "Clue" not in new_state


def test_same_seed_same_instance():
    for size in (3, 5):
        problem = Einstein(size)
        first = problem.sample(np.random.default_rng(7))
        again = problem.sample(np.random.default_rng(7))
        assert first == again and first.info == again.info
        assert first != problem.sample(np.random.default_rng(8))


def test_vocabulary_and_bad_size():
    for size in (3, 4, 5):
        problem = Einstein(size)
        assert problem.name == "einstein"
        assert problem.labels() == tuple(NATIONALITIES[:size])
        symbols = problem.symbols()
        assert len(set(symbols)) == len(symbols)
        assert set(problem.labels()) <= set(symbols) and "None" in symbols
    for size in (2, 6, 3.0, True, "3"):
        with pytest.raises(ValueError, match=r"size must be one of \(3, 4, 5\), got"):
            Einstein(size=size)
    with pytest.raises(ValueError, match="size"):
        make_problem("einstein", size=7)
    with pytest.raises(ValueError, match="clue values"):
        count_solutions(3, [Clue("same", "Brit", "Blue")])  # Blue is the fifth colour
