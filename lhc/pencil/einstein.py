"""Einstein (zebra) puzzles with propagate-and-branch traces, PENCIL's Einstein task.

A ``size`` k puzzle has k houses in a row (numbered 1 to k) and the first k attributes of
``ATTRIBUTES`` with the first k values of each; every value lies in exactly one house.
The label is the nationality of the house that holds the ``Fish``.

Generation (as in quint-t's Puzzle-Generator-and-Solver, on which PENCIL's generator is
built): a random solution table; random clues true of it are added until the solution
is unique, then removed one by one in random order while it stays unique, which leaves
a minimal set (removing any one clue admits a second solution). The clues, with X and Y
values (tokens of the prompt in brackets)::

    at      X is in house h                         Clue 1 : Brit = House 2
    not_at  X is not in house h                     Clue 2 : Dog ≠ House 3
    same    X and Y are in the same house           Clue 3 : Brit same Red
    left    X is directly left of Y (house + 1)     Clue 4 : Dog left Red
    next    X and Y are in neighbouring houses      Clue 5 : Dog next Tea
    before  X is somewhere left of Y                Clue 6 : Dog before Tea

The prompt is ``<|startoftext|>``, the clues, ``<|endofprompt|>``. The trace is a
solver as PENCIL calls. A call opens with the state, the candidates left in every cell
(house, attribute)::

    [CALL] Question: House 1 : Nationality Brit Dane ; Color Red ; Pet Fish Dog Bird ;
                     House 2 : ...

then runs one round of propagation: it checks the rules in the order clue 1, clue 2,
..., then the all-different rule (every value in exactly one house) for each attribute
in turn, writes ``Clue 1 ok`` (or ``Color ok``) for each rule that removes nothing, and
applies the first rule that removes a candidate, writing each deduction::

    Clue 3 : House 2 Color ≠ Red     clue 3 rules out Red in house 2
    House 1 Color = Red              Red is the only colour left in house 1: not elsewhere
    Red only House 1                 house 1 is the only house left for Red: nothing else there

A clue is applied to both of its values (X given Y, then Y given the new X, after which
the clue holds for every candidate left); the all-different rule of an attribute first
to its cells with one candidate, then to its values with one house. One rule per call
keeps the deductions close to the state the call shows, and gives sub-sequence counts
and trace lengths of the order of PENCIL's official generator. The call then ends:

- on a contradiction, at once after the step that caused it:
  ``House 2 Color empty`` or ``Red nowhere`` then ``[SEP] Answer: None [RETURN]``;
- when the rule removed candidates, with a tail call on the new state,
  ``[SEP] [CALL] Question: <new state> [RETURN]``. PENCIL's rule
  (``C [CALL] T [SEP] A [RETURN] -> C A``) erases the call and its deductions and leaves
  ``[CALL] Question: <new state>``, from which the solver goes on: the context holds
  one state, never the deductions that led to it;
- when no rule removes anything and every cell has one candidate (the clues then all
  hold): ``Fish = House h Nationality = X [SEP] Answer: X [RETURN]``;
- otherwise it branches on the first undecided cell with the fewest candidates, each in
  turn: ``Try House h Color = Red [CALL] Question: <state with that choice> ... [SEP]
  Answer: X [RETURN]`` (which reduces to ``Try House h Color = Red Answer: X``), stops
  at the first ``X`` that is not ``None`` and ends with ``[SEP] Answer: X [RETURN]``
  (``None`` if every choice failed).

After the top call comes ``<|endoftext|>``; the whole trace reduces to
``Answer: <label> <|endoftext|>``. ``lhc.pencil.trace_statistics`` (1,000 puzzles at 3x3,
50 at 5x5) gives median trace lengths (prompt included) of 854 and 9.7k tokens (largest
2.3k and 30k), largest contexts of 167 and 588 (largest 391 and 1,222), and 13 and 53
sub-sequences; the paper's generator: 1.4k-1.9k and 8.9k-16.4k, 450-520 and 1.7k-2.2k,
14-18 and 71-138. Our states are more compact than the paper's, so our contexts are
shorter; branching makes a long tail at 5x5.

``count_solutions`` (the generator's uniqueness test) runs the same propagation to a
fixed point between branches; ``brute_force_solutions`` checks every table (k <= 4) with
numpy, independently of it.

Internally a state is a list of bit masks, one per value (``a * k + v`` for value ``v``
of attribute ``a``), with bit ``h`` set while house ``h + 1`` is possible for it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from lhc.pencil.problems import Instance
from lhc.pencil.reduction import CALL, RETURN, SEP
from lhc.pencil.tokenizer import BOS, END_OF_PROMPT, EOS

ATTRIBUTES = (
    ("Nationality", ("Brit", "Swede", "Dane", "Norwegian", "German")),
    ("Color", ("Red", "Green", "White", "Yellow", "Blue")),
    ("Pet", ("Fish", "Dog", "Bird", "Cat", "Horse")),
    ("Drink", ("Tea", "Coffee", "Milk", "Beer", "Water")),
    ("Smoke", ("PallMall", "Dunhill", "Blends", "BlueMaster", "Prince")),
)
SIZES = (3, 4, 5)
NATIONALITY, PET, FISH = "Nationality", "Pet", "Fish"
NONE = "None"  # the answer of a call whose state has no solution
OK = "ok"  # a rule checked that removes nothing
CLUE_KINDS = ("at", "not_at", "same", "left", "next", "before")
_CLUE_WORDS = {
    "at": "=",
    "not_at": "≠",
    "same": "same",
    "left": "left",
    "next": "next",
    "before": "before",
}
# Clue numbers are tokens up to this bound; a puzzle with more clues is drawn again. Minimal
# puzzles have far fewer (seed 1: 4 to 7 over 1000 at 3x3, 8 to 13 and 14 to 20 over 300
# at 4x4 and 5x5), so the bound never biases the distribution in practice.
MAX_CLUES = {3: 12, 4: 20, 5: 30}
_MAX_CLUE_DRAWS = 10_000
_WORDS = (
    "Clue",
    ":",
    ";",
    "=",
    "≠",
    "House",
    "same",
    "left",
    "next",
    "before",
    "Question:",
    "Answer:",
    NONE,
    "Try",
    "only",
    "empty",
    "nowhere",
    OK,
)

Solution = tuple[tuple[str, ...], ...]  # solution[h][a]: attribute a's value in house h + 1


class Clue(NamedTuple):
    """One clue (see the module docstring for the kinds).

    Attributes:
        kind: one of ``CLUE_KINDS``.
        first: the value X (``"Brit"``).
        second: the value Y, or for ``"at"`` and ``"not_at"`` the house number (1 to k).
    """

    kind: str
    first: str
    second: str | int


def attributes(size: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The ``(name, values)`` of a ``size`` x ``size`` puzzle's attributes, in order."""
    return tuple((name, values[:size]) for name, values in ATTRIBUTES[:size])


def clue_tokens(number: int, clue: Clue) -> list[str]:
    """``Clue 4 : Dog left Red`` as tokens (``number`` counts from 1)."""
    second = ["House", str(clue.second)] if clue.kind in ("at", "not_at") else [clue.second]
    return ["Clue", str(number), ":", clue.first, _CLUE_WORDS[clue.kind], *second]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The value numbering of one puzzle size."""

    size: int
    attribute_names: tuple[str, ...]
    value_names: tuple[str, ...]  # value index a * size + v -> name
    index: dict  # name -> value index
    full: int  # every house possible

    def attribute_of(self, value: int) -> int:
        return value // self.size

    def values_of(self, attribute: int) -> range:
        return range(attribute * self.size, (attribute + 1) * self.size)


@functools.cache
def _layout(size: int) -> _Layout:
    if size not in SIZES:
        raise ValueError(f"Einstein size must be one of {SIZES}, got {size!r}")
    attrs = attributes(size)
    value_names = tuple(value for _, values in attrs for value in values)
    return _Layout(
        size=size,
        attribute_names=tuple(name for name, _ in attrs),
        value_names=value_names,
        index={name: i for i, name in enumerate(value_names)},
        full=(1 << size) - 1,
    )


def _compile(layout: _Layout, clues: Sequence[Clue]) -> list[tuple[int, str, int, int]]:
    """Clues as ``(number, kind, x, y)``: value indices, or a 0-based house for ``y``."""
    out = []
    for number, clue in enumerate(clues, start=1):
        if clue.kind not in CLUE_KINDS:
            raise ValueError(f"clue kind must be one of {CLUE_KINDS}, got {clue.kind!r}")
        house_clue = clue.kind in ("at", "not_at")
        values = (clue.first,) if house_clue else (clue.first, clue.second)
        if any(value not in layout.index for value in values):
            raise ValueError(f"clue values must be among {layout.value_names}, got {clue!r}")
        if house_clue and clue.second not in range(1, layout.size + 1):
            raise ValueError(f"clue house must be in 1..{layout.size}, got {clue!r}")
        x = layout.index[clue.first]
        y = clue.second - 1 if house_clue else layout.index[clue.second]
        out.append((number, clue.kind, x, y))
    return out


def _revise(kind: str, x: int, y: int, pos: list[int], full: int) -> tuple[tuple[int, int], ...]:
    """``(value, mask)`` for X (and Y, for a clue on two values) once the clue is
    enforced: X keeps the houses that fit some house left for Y, then Y those that fit
    some house left for X. ``y`` is a 0-based house for ``at`` and ``not_at``."""
    if kind == "at":
        return ((x, pos[x] & (1 << y)),)
    if kind == "not_at":
        return ((x, pos[x] & ~(1 << y) & full),)
    if kind == "same":
        new_x = pos[x] & pos[y]
        new_y = pos[y] & new_x
    elif kind == "left":  # house(Y) = house(X) + 1
        new_x = pos[x] & (pos[y] >> 1)
        new_y = pos[y] & (new_x << 1)
    elif kind == "next":
        new_x = pos[x] & ((pos[y] >> 1) | (pos[y] << 1))
        new_y = pos[y] & ((new_x >> 1) | (new_x << 1))
    else:  # before, house(X) < house(Y): X below Y's last house, Y above X's first house
        below_last_y = (1 << (pos[y].bit_length() - 1)) - 1 if pos[y] else 0
        new_x = pos[x] & below_last_y
        lowest = new_x & -new_x
        new_y = pos[y] & ~((lowest << 1) - 1) if new_x else 0
    return (x, new_x), (y, new_y)


def _contradiction(pos: list[int], layout: _Layout) -> list[str] | None:
    """Why the state has no solution (``House 2 Color empty``, ``Red nowhere``), or None."""
    k = layout.size
    for value, mask in enumerate(pos):
        if not mask:
            return [layout.value_names[value], "nowhere"]
    for house, attribute in itertools.product(range(k), range(k)):
        if not any(pos[v] >> house & 1 for v in layout.values_of(attribute)):
            return ["House", str(house + 1), layout.attribute_names[attribute], "empty"]
    return None


def _propagation_round(
    pos: list[int],
    layout: _Layout,
    clues: list,
    steps: list[str] | None,
    first_rule_only: bool = False,
) -> tuple[bool, list[str] | None]:
    """Propagation on ``pos``, in place: every rule once in order (a round of
    ``count_solutions``), or only the first rule that removes a candidate (a call of the
    trace; see the module docstring).

    Args:
        clues: the compiled clues (``_compile``).
        steps: where each deduction's tokens go, or None to skip writing them.
        first_rule_only: stop after the first rule that removed a candidate.

    Returns:
        ``(changed, contradiction)``: whether a candidate was removed, and the reason
        tokens of the first contradiction (the round stops there) or None.
    """
    k, full, names = layout.size, layout.full, layout.value_names
    changed = False
    # A call writes every rule it checks: a rule that removes nothing is "ok", so that each
    # step decides one rule against the state shown.
    explicit = first_rule_only and steps is not None
    for number, kind, x, y in clues:
        revised = _revise(kind, x, y, pos, full)
        if all(pos[value] == new for value, new in revised):
            if explicit:
                steps += ["Clue", str(number), OK]
            continue
        changed = True
        for value, new in revised:
            if steps is not None:
                attribute = layout.attribute_names[layout.attribute_of(value)]
                for house in range(k):
                    if (pos[value] & ~new) >> house & 1:
                        steps += ["Clue", str(number), ":", "House", str(house + 1), attribute]
                        steps += ["≠", names[value]]
            pos[value] = new
        if (reason := _contradiction(pos, layout)) is not None:
            return changed, reason
        if first_rule_only:
            return changed, None
    for attribute in range(k):
        values = layout.values_of(attribute)
        for house in range(k):  # a cell with one candidate: that value is nowhere else
            left = [v for v in values if pos[v] >> house & 1]
            if len(left) == 1 and pos[left[0]] != 1 << house:
                changed = True
                pos[left[0]] = 1 << house
                if steps is not None:
                    steps += ["House", str(house + 1), layout.attribute_names[attribute], "="]
                    steps.append(names[left[0]])
                if (reason := _contradiction(pos, layout)) is not None:
                    return changed, reason
        for value in values:  # a value with one house: nothing else in that cell
            house_bit = pos[value]
            if house_bit & (house_bit - 1) or not house_bit:
                continue
            others = [v for v in values if v != value and pos[v] & house_bit]
            if others:
                changed = True
                for v in others:
                    pos[v] &= ~house_bit
                if steps is not None:
                    steps += [names[value], "only", "House", str(house_bit.bit_length())]
                if (reason := _contradiction(pos, layout)) is not None:
                    return changed, reason
        if changed and first_rule_only:
            return changed, None
        if explicit:
            steps += [layout.attribute_names[attribute], OK]
    return changed, None


def _branch_cell(pos: list[int], layout: _Layout) -> tuple[int, int, list[int]] | None:
    """The first undecided cell ``(house, attribute, candidates)`` with the fewest
    candidates, or None when every cell is decided."""
    best = None
    for house, attribute in itertools.product(range(layout.size), range(layout.size)):
        left = [v for v in layout.values_of(attribute) if pos[v] >> house & 1]
        if len(left) > 1 and (best is None or len(left) < len(best[2])):
            best = (house, attribute, left)
    return best


def _choose(pos: list[int], layout: _Layout, house: int, attribute: int, value: int) -> list[int]:
    """A copy of ``pos`` with cell (house, attribute) set to ``value``."""
    child = list(pos)
    for v in layout.values_of(attribute):
        if v != value:
            child[v] &= ~(1 << house)
    return child


def _start(layout: _Layout) -> list[int]:
    return [layout.full] * (layout.size * layout.size)


def _solution_of(pos: list[int], layout: _Layout) -> Solution:
    k = layout.size
    table = [[""] * k for _ in range(k)]
    for value, mask in enumerate(pos):
        table[mask.bit_length() - 1][layout.attribute_of(value)] = layout.value_names[value]
    return tuple(tuple(row) for row in table)


def fish_owner(solution: Solution) -> str:
    """The label: the nationality of the house with the fish."""
    size = len(solution)
    names = [name for name, _ in attributes(size)]
    house = next(h for h, row in enumerate(solution) if row[names.index(PET)] == FISH)
    return solution[house][names.index(NATIONALITY)]


def count_solutions(size: int, clues: Sequence[Clue], limit: int = 2) -> int:
    """The number of solution tables that satisfy ``clues``, counted up to ``limit``
    (backtracking over the cell with the fewest candidates, propagating in between)."""
    layout = _layout(size)
    compiled = _compile(layout, clues)

    def search(pos: list[int], limit: int) -> int:
        while True:
            changed, contradiction = _propagation_round(pos, layout, compiled, None)
            if contradiction is not None:
                return 0
            if not changed:
                break
        cell = _branch_cell(pos, layout)
        if cell is None:
            return 1
        house, attribute, candidates = cell
        count = 0
        for value in candidates:
            count += search(_choose(pos, layout, house, attribute, value), limit - count)
            if count >= limit:
                break
        return count

    return search(_start(layout), limit)


def _state_tokens(pos: list[int], layout: _Layout) -> list[str]:
    """``House 1 : Nationality Brit Dane ; Color Red ; ... House 2 : ...``."""
    out = []
    for house in range(layout.size):
        out += ["House", str(house + 1), ":"]
        for attribute, name in enumerate(layout.attribute_names):
            out.append(name)
            out += [
                layout.value_names[v] for v in layout.values_of(attribute) if pos[v] >> house & 1
            ]
            out.append(";")
    return out


def solver_trace(size: int, clues: Sequence[Clue]) -> tuple[str | None, list[str]]:
    """The solver's calls on a puzzle: ``(the fish owner's nationality or None, tokens)``,
    the tokens from the top ``[CALL]`` to its ``[RETURN]`` (see the module docstring)."""
    layout = _layout(size)
    compiled = _compile(layout, clues)
    pet, nationality = layout.attribute_names.index(PET), layout.attribute_names.index(NATIONALITY)

    def call(pos: list[int]) -> tuple[str | None, list[str]]:
        tokens = [CALL, "Question:", *_state_tokens(pos, layout)]
        while True:
            steps = []
            changed, contradiction = _propagation_round(
                pos, layout, compiled, steps, first_rule_only=True
            )
            tokens += steps
            if contradiction is not None:
                return None, tokens + [*contradiction, SEP, "Answer:", NONE, RETURN]
            if not changed:
                break
            tokens += [SEP, CALL, "Question:", *_state_tokens(pos, layout), RETURN]  # tail call
        cell = _branch_cell(pos, layout)
        if cell is None:
            solution = _solution_of(pos, layout)
            house = next(h for h, row in enumerate(solution) if row[pet] == FISH)
            answer = solution[house][nationality]
            tokens += [FISH, "=", "House", str(house + 1), NATIONALITY, "=", answer]
            return answer, tokens + [SEP, "Answer:", answer, RETURN]
        house, attribute, candidates = cell
        answer = None
        for value in candidates:
            tokens += ["Try", "House", str(house + 1), layout.attribute_names[attribute], "="]
            tokens.append(layout.value_names[value])
            answer, sub = call(_choose(pos, layout, house, attribute, value))
            tokens += sub
            if answer is not None:
                break
        return answer, tokens + [SEP, "Answer:", str(answer), RETURN]

    return call(_start(layout))


def brute_force_solutions(size: int, clues: Sequence[Clue], limit: int = 2) -> list[Solution]:
    """The first ``limit`` of all ``(size!)**size`` tables that satisfy every clue
    (each clue checked on every table with numpy; no propagation).

    Raises:
        ValueError: ``size`` above 4 (5x5 has 24.9 billion tables).
    """
    if size not in (3, 4):
        raise ValueError(f"brute force needs size 3 or 4, got {size!r}")
    attrs = attributes(size)
    houses_of = np.array(list(itertools.permutations(range(1, size + 1))), np.int8)
    choice = np.indices((len(houses_of),) * size).reshape(size, -1).T  # one perm per attribute
    where = {}  # value name -> [num_tables] house number of that value in each table
    for attribute, (_, values) in enumerate(attrs):
        for v, value in enumerate(values):
            where[value] = houses_of[choice[:, attribute], v]
    ok = np.ones(len(choice), bool)
    for clue in clues:
        x = where[clue.first]
        if clue.kind == "at":
            ok &= x == clue.second
        elif clue.kind == "not_at":
            ok &= x != clue.second
        elif clue.kind == "same":
            ok &= x == where[clue.second]
        elif clue.kind == "left":
            ok &= x + 1 == where[clue.second]
        elif clue.kind == "next":
            ok &= np.abs(x - where[clue.second]) == 1
        elif clue.kind == "before":
            ok &= x < where[clue.second]
        else:
            raise ValueError(f"clue kind must be one of {CLUE_KINDS}, got {clue.kind!r}")
    out = []
    for table in np.flatnonzero(ok)[:limit]:
        rows = [[""] * size for _ in range(size)]
        for attribute, (_, values) in enumerate(attrs):
            for value in values:
                rows[where[value][table] - 1][attribute] = value
        out.append(tuple(tuple(row) for row in rows))
    return out


def _random_clue(rng: np.random.Generator, house_of: list[int], layout: _Layout) -> Clue:
    """A random clue true of the solution (``house_of[value]``: its 0-based house)."""
    k, names = layout.size, layout.value_names
    kind = CLUE_KINDS[rng.integers(len(CLUE_KINDS))]

    def value_in(houses: Sequence[int], exclude_attribute: int | None = None) -> int:
        options = [
            v
            for v in range(k * k)
            if house_of[v] in houses and layout.attribute_of(v) != exclude_attribute
        ]
        return options[rng.integers(len(options))]

    if kind == "at":
        x = value_in(range(k))
        return Clue(kind, names[x], house_of[x] + 1)
    if kind == "not_at":
        x = value_in(range(k))
        others = [h for h in range(k) if h != house_of[x]]
        return Clue(kind, names[x], others[rng.integers(len(others))] + 1)
    if kind == "same":
        x = value_in(range(k))
        return Clue(kind, names[x], names[value_in([house_of[x]], layout.attribute_of(x))])
    if kind == "left":
        x = value_in(range(k - 1))
        return Clue(kind, names[x], names[value_in([house_of[x] + 1])])
    if kind == "next":
        x = value_in(range(k))
        return Clue(kind, names[x], names[value_in([house_of[x] - 1, house_of[x] + 1])])
    x = value_in(range(k - 1))
    return Clue(kind, names[x], names[value_in(range(house_of[x] + 1, k))])


def _clue_key(clue: Clue) -> tuple:
    """Equal for clues that say the same (``same`` and ``next`` are symmetric)."""
    if clue.kind in ("same", "next"):
        return (clue.kind, *sorted((clue.first, clue.second)))
    return tuple(clue)


def generate_puzzle(size: int, rng: np.random.Generator) -> tuple[Solution, list[Clue]]:
    """A random solution and a minimal clue set that has it as its only solution."""
    layout = _layout(size)
    k = size
    house_of = [0] * (k * k)
    for attribute in range(k):
        for v, house in zip(layout.values_of(attribute), rng.permutation(k)):
            house_of[v] = int(house)
    clues, keys = [], set()
    for _ in range(_MAX_CLUE_DRAWS):
        if clues and count_solutions(size, clues) == 1:
            break
        clue = _random_clue(rng, house_of, layout)
        if _clue_key(clue) not in keys:  # a repeated clue adds nothing
            keys.add(_clue_key(clue))
            clues.append(clue)
    else:
        raise RuntimeError(f"no unique {size}x{size} puzzle after {_MAX_CLUE_DRAWS} clue draws")
    drawn = list(clues)
    # One pass leaves a minimal set: a clue kept was needed by a superset of the final set.
    for index in rng.permutation(len(drawn)):
        kept = [clue for clue in clues if clue != drawn[index]]
        if count_solutions(size, kept) == 1:
            clues = kept
    solution = _solution_of([1 << h for h in house_of], layout)
    return solution, clues


@dataclasses.dataclass(frozen=True)
class Einstein:
    """Einstein puzzles with propagate-and-branch traces.

    Attributes:
        size: k, houses and attributes (3, 4 or 5; the paper: 3x3 to 5x5).
    """

    size: int = 3
    name: str = dataclasses.field(default="einstein", init=False)

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size not in SIZES:
            raise ValueError(f"Einstein size must be one of {SIZES}, got {self.size!r}")

    def symbols(self) -> tuple[str, ...]:
        layout = _layout(self.size)
        numbers = tuple(str(n) for n in range(1, max(self.size, MAX_CLUES[self.size]) + 1))
        return _WORDS + layout.attribute_names + layout.value_names + numbers

    def labels(self) -> tuple[str, ...]:
        return dict(attributes(self.size))[NATIONALITY]

    def sample(self, rng: np.random.Generator) -> Instance:
        """A random minimal puzzle (drawn again in the rare case of more than
        ``MAX_CLUES[size]`` clues)."""
        while True:
            solution, clues = generate_puzzle(self.size, rng)
            if len(clues) <= MAX_CLUES[self.size]:
                break
        answer, trace = solver_trace(self.size, clues)
        label = fish_owner(solution)
        assert answer == label, (answer, label)
        prompt = [BOS]
        for number, clue in enumerate(clues, start=1):
            prompt += clue_tokens(number, clue)
        return Instance(
            prompt=(*prompt, END_OF_PROMPT),
            trace=(*trace, EOS),
            label=label,
            info={"solution": solution, "clues": clues},
        )
