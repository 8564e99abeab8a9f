"""lhc.icl.families: number words, the task families and task-superposition prompts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lhc.icl import families
from lhc.icl.families import (
    ANTONYMS,
    COUNTRIES,
    FAMILIES,
    WORDS,
    Family,
    get_family,
    number_words,
    superposition_prompt,
)

ENGLISH = {
    0: "zero",
    13: "thirteen",
    15: "fifteen",
    20: "twenty",
    21: "twenty-one",
    40: "forty",
    58: "fifty-eight",
    89: "eighty-nine",
    99: "ninety-nine",
    100: "one hundred",
    101: "one hundred one",
    112: "one hundred twelve",
    150: "one hundred fifty",
    189: "one hundred eighty-nine",
    199: "one hundred ninety-nine",
}

FRENCH = {
    0: "zéro",
    1: "un",
    16: "seize",
    17: "dix-sept",
    21: "vingt et un",
    22: "vingt-deux",
    30: "trente",
    41: "quarante et un",
    59: "cinquante-neuf",
    61: "soixante et un",
    70: "soixante-dix",
    71: "soixante et onze",
    77: "soixante-dix-sept",
    80: "quatre-vingts",
    81: "quatre-vingt-un",
    89: "quatre-vingt-neuf",
    90: "quatre-vingt-dix",
    91: "quatre-vingt-onze",
    99: "quatre-vingt-dix-neuf",
    100: "cent",
    101: "cent un",
    116: "cent seize",
    171: "cent soixante et onze",
    180: "cent quatre-vingts",
    198: "cent quatre-vingt-dix-huit",
}

SPANISH = {
    0: "cero",
    15: "quince",
    16: "dieciséis",
    17: "diecisiete",
    20: "veinte",
    21: "veintiuno",
    22: "veintidós",
    23: "veintitrés",
    26: "veintiséis",
    30: "treinta",
    31: "treinta y uno",
    45: "cuarenta y cinco",
    89: "ochenta y nueve",
    100: "cien",
    101: "ciento uno",
    115: "ciento quince",
    121: "ciento veintiuno",
    150: "ciento cincuenta",
    189: "ciento ochenta y nueve",
    198: "ciento noventa y ocho",
}

TABLES = {"english": ENGLISH, "french": FRENCH, "spanish": SPANISH}

CAPITALS = {
    "France": ("Paris", "Europe"),
    "Switzerland": ("Bern", "Europe"),
    "Japan": ("Tokyo", "Asia"),
    "India": ("New Delhi", "Asia"),
    "Egypt": ("Cairo", "Africa"),
    "Nigeria": ("Abuja", "Africa"),
    "Canada": ("Ottawa", "North America"),
    "Mexico": ("Mexico City", "North America"),
    "Brazil": ("Brasilia", "South America"),
    "Argentina": ("Buenos Aires", "South America"),
    "Australia": ("Canberra", "Oceania"),
    "New Zealand": ("Wellington", "Oceania"),
}

CONTINENTS = {"Africa", "Asia", "Europe", "North America", "South America", "Oceania"}


def draws(name, n=200, seed=0):
    family = get_family(name)
    rng = np.random.default_rng(seed)
    return family, [family.sample(rng) for _ in range(n)]


def check_distinct(family, samples):
    for text, answers in samples:
        assert tuple(answers) == family.tasks, text
        assert all(isinstance(a, str) and a for a in answers.values())
        assert len(set(answers.values())) == len(answers), (text, answers)


# Number words.


@pytest.mark.parametrize("language", sorted(TABLES))
def test_number_words_known_values(language):
    for n, words in TABLES[language].items():
        assert number_words(n, language) == words, n


def test_number_words_distinct_per_language():
    for language in TABLES:
        spelled = [number_words(n, language) for n in range(200)]
        assert len(set(spelled)) == 200, language


@pytest.mark.parametrize("n", [-1, 200, 1000, 1.5, True])
def test_number_words_range_errors(n):
    with pytest.raises(ValueError, match=r"\[0, 199\]"):
        number_words(n, "english")


def test_number_words_unknown_language():
    with pytest.raises(ValueError, match="german"):
        number_words(5, "german")


# Families.


def test_family_registry():
    assert set(FAMILIES) == {
        "addition",
        "country",
        "copy",
        "letters",
        "arith",
        "case",
        "antonym",
        "numbers",
    }
    for name, family in FAMILIES.items():
        assert isinstance(family, Family) and family.name == name
        assert get_family(name) is family
    with pytest.raises(ValueError, match="'nope'.*addition"):
        get_family("nope")


def test_addition():
    family, samples = draws("addition")
    assert family.tasks == ("digits", "english", "french", "spanish")
    assert family.separator == "->"
    check_distinct(family, samples)
    for text, answers in samples:
        a, b = map(int, text.split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert answers["digits"] == str(a + b)
        for language, table in TABLES.items():
            if a + b in table:
                assert answers[language] == table[a + b]
            assert answers[language] == number_words(a + b, language)


def test_addition_known_sample():
    answers = {
        "digits": "89",
        "english": "eighty-nine",
        "french": "quatre-vingt-neuf",
        "spanish": "ochenta y nueve",
    }
    rng = np.random.default_rng(0)
    samples = [get_family("addition").sample(rng) for _ in range(3000)]
    hits = [a for text, a in samples if sum(map(int, text.split("+"))) == 89]
    assert hits and all(a == answers for a in hits)


def test_country_table():
    assert len(COUNTRIES) >= 60
    assert {continent for _, continent in COUNTRIES.values()} == CONTINENTS
    for country, (capital, _) in COUNTRIES.items():
        assert country.isascii() and capital.isascii()
        assert capital != country and capital.upper() != country.upper()
    for country, fact in CAPITALS.items():
        assert COUNTRIES[country] == fact, country


def test_country():
    family, samples = draws("country")
    assert family.tasks == ("capital", "continent", "upper") and family.separator == "->"
    check_distinct(family, samples)
    for text, answers in samples:
        assert answers["upper"] == text.upper()
        assert (answers["capital"], answers["continent"]) == COUNTRIES[text]
        if text in CAPITALS:
            assert (answers["capital"], answers["continent"]) == CAPITALS[text]
    assert len({text for text, _ in samples}) > 40


def test_copy():
    family, samples = draws("copy")
    assert family.tasks == ("copy_a", "copy_b", "sum") and family.separator == "="
    check_distinct(family, samples)
    for text, answers in samples:
        a, b = text.split("@")
        assert len(a) == len(b) == 2 and a != b
        assert answers == {"copy_a": a, "copy_b": b, "sum": str(int(a) + int(b))}


def test_words_table():
    assert len(WORDS) >= 150 and len(set(WORDS)) == len(WORDS)
    for word in WORDS:
        assert word.isalpha() and word.islower() and word.isascii() and 4 <= len(word) <= 9
        assert word[0] != word[-1], word


def test_letters():
    family, samples = draws("letters")
    assert family.tasks == ("first_lower", "first_upper", "last_lower", "last_upper")
    check_distinct(family, samples)
    for text, answers in samples:
        assert text in WORDS
        first, last = text[0], text[-1]
        assert answers == {
            "first_lower": first,
            "first_upper": first.upper(),
            "last_lower": last,
            "last_upper": last.upper(),
        }


def test_arith():
    family, samples = draws("arith")
    assert family.tasks == ("plus_one", "times_two", "square", "minus_one")
    check_distinct(family, samples)
    for text, answers in samples:
        x = int(text)
        assert 10 <= x <= 99
        assert answers == {
            "plus_one": str(x + 1),
            "times_two": str(2 * x),
            "square": str(x * x),
            "minus_one": str(x - 1),
        }
    assert len({text for text, _ in samples}) > 60


def test_case():
    family, samples = draws("case")
    assert family.tasks == ("copy", "upper", "title")
    check_distinct(family, samples)
    for text, answers in samples:
        assert text in WORDS
        assert answers == {"copy": text, "upper": text.upper(), "title": text[0].upper() + text[1:]}


def test_antonym_table_and_family():
    words = [word for pair in ANTONYMS for word in pair]
    assert len(ANTONYMS) >= 50 and len(set(words)) == len(words)
    assert all(word.isalpha() and word.islower() and word.isascii() for word in words)
    assert ("hot", "cold") in ANTONYMS and ("laugh", "cry") in ANTONYMS
    family, samples = draws("antonym", n=400)
    assert family.tasks == ("antonym", "copy", "upper")
    check_distinct(family, samples)
    opposite = {a: b for a, b in ANTONYMS} | {b: a for a, b in ANTONYMS}
    for text, answers in samples:
        assert answers == {"antonym": opposite[text], "copy": text, "upper": text.upper()}
    assert {"hot", "cold"} <= {text for text, _ in samples}


def test_numbers():
    family, samples = draws("numbers")
    assert family.tasks == ("digits", "french", "spanish")
    check_distinct(family, samples)
    english = {ENGLISH[n]: n for n in (13, 15, 20)} | {"one": 1, "seven": 7}
    for text, answers in samples:
        n = int(answers["digits"])
        assert 1 <= n <= 20 and text == number_words(n, "english")
        assert answers["french"] == number_words(n, "french")
        assert answers["spanish"] == number_words(n, "spanish")
        if text in english:
            assert n == english[text]
    assert len({text for text, _ in samples}) == 20


def test_samples_are_seeded():
    for family in FAMILIES.values():
        a = family.samples(np.random.default_rng(7), 20)
        b = family.samples(np.random.default_rng(7), 20)
        assert a == b


# Prompts.


def recording(family):
    """The family with a sampler that records every input's answers."""
    seen = {}

    def sample(rng):
        text, answers = family.sample(rng)
        seen[text] = answers
        return text, answers

    return dataclasses.replace(family, sample=sample), seen


@pytest.mark.parametrize(
    "name, proportions, num_demos, expected",
    [
        # quotas 5, 2.5, 2.5, 0: the tie goes to the first task.
        ("addition", {"digits": 0.5, "english": 0.25, "french": 0.25, "spanish": 0}, 10,
         {"digits": 5, "english": 3, "french": 2, "spanish": 0}),
        # 2.5 each: two left over, to the first two tasks.
        ("addition", dict.fromkeys(("digits", "english", "french", "spanish"), 0.25), 10,
         {"digits": 3, "english": 3, "french": 2, "spanish": 2}),
        # quotas 3.6, 2.8, 1.6: two left over, to .8 then to the first .6.
        ("addition", {"digits": 0.45, "english": 0.35, "french": 0.2}, 8,
         {"digits": 4, "english": 3, "french": 1, "spanish": 0}),
        # quotas 4.2, 2.1, 0.7: one left over, to .7.
        ("copy", {"copy_a": 0.6, "copy_b": 0.3, "sum": 0.1}, 7,
         {"copy_a": 4, "copy_b": 2, "sum": 1}),
        ("copy", dict.fromkeys(("copy_a", "copy_b", "sum"), 1 / 3), 10,
         {"copy_a": 4, "copy_b": 3, "sum": 3}),
        # the paper's setting: 60 demonstrations split evenly.
        ("arith", dict.fromkeys(("plus_one", "times_two", "square", "minus_one"), 0.25), 60,
         {"plus_one": 15, "times_two": 15, "square": 15, "minus_one": 15}),
        ("country", {"capital": 1.0}, 3, {"capital": 3, "continent": 0, "upper": 0}),
    ],
)  # fmt: skip
def test_prompt_counts_and_lines(name, proportions, num_demos, expected):
    family, seen = recording(get_family(name))
    prompt = superposition_prompt(np.random.default_rng(1), family, proportions, num_demos)
    assert prompt.counts == expected
    lines = prompt.text.split("\n")
    assert len(lines) == num_demos + 1
    assert lines[-1] == prompt.query + family.separator
    assert prompt.text.endswith("\n" + prompt.query + family.separator)
    assert prompt.answers == seen[prompt.query]
    per_task = dict.fromkeys(family.tasks, 0)
    for line in lines[:-1]:
        text, answer = line.split(family.separator, 1)
        tasks = [t for t in family.tasks if proportions.get(t, 0) > 0 and seen[text][t] == answer]
        assert len(tasks) == 1, line
        per_task[tasks[0]] += 1
    assert per_task == expected


def test_prompt_order_is_shuffled_and_seeded():
    family, seen = recording(get_family("arith"))
    proportions = dict.fromkeys(family.tasks, 0.25)
    prompt = superposition_prompt(np.random.default_rng(3), family, proportions, 60)
    again = superposition_prompt(np.random.default_rng(3), get_family("arith"), proportions, 60)
    assert prompt == again
    order = []
    for line in prompt.text.split("\n")[:-1]:
        text, answer = line.split("->")
        order.append(next(t for t in family.tasks if seen[text][t] == answer))
    assert order != sorted(order, key=family.tasks.index)
    assert len({line.split("->")[0] for line in prompt.text.split("\n")[:-1]}) > 30


def test_prompt_given_query_and_line_sep():
    family = get_family("copy")
    query = ("12@34", {"copy_a": "12", "copy_b": "34", "sum": "46"})
    prompt = superposition_prompt(
        np.random.default_rng(0),
        family,
        {"copy_a": 0.5, "sum": 0.5},
        4,
        query=query,
        line_sep=" | ",
    )
    assert prompt.query == "12@34" and prompt.answers == query[1]
    assert prompt.text.endswith(" | 12@34=") and prompt.text.count(" | ") == 4
    with pytest.raises(ValueError, match="query"):
        superposition_prompt(np.random.default_rng(0), family, {"sum": 1}, 4, query=("1@2", {}))


@pytest.mark.parametrize(
    "proportions, num_demos, match",
    [
        ({"digits": 0.5, "german": 0.5}, 10, "proportions.*'german'"),
        ({"digits": 1.5, "english": -0.5}, 10, "proportions.*non-negative.*-0.5"),
        ({"digits": 0.5, "english": 0.4}, 10, "proportions.*sum.*0.9"),
        ({"digits": float("nan"), "english": 1.0}, 10, "proportions.*nan"),
        ({"digits": 1.0}, 0, "num_demos.*>= 1.*0"),
        ({"digits": 1.0}, -3, "num_demos.*-3"),
    ],
)
def test_prompt_errors(proportions, num_demos, match):
    with pytest.raises(ValueError, match=match):
        superposition_prompt(
            np.random.default_rng(0), get_family("addition"), proportions, num_demos
        )


def test_demo_counts_sum_exactly():
    family = get_family("addition")
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = rng.random(4) * (rng.random(4) > 0.3)
        if weights.sum() == 0:
            continue
        proportions = dict(zip(family.tasks, (weights / weights.sum()).tolist()))
        num_demos = int(rng.integers(1, 100))
        counts = families.demo_counts(family, proportions, num_demos)
        assert sum(counts.values()) == num_demos
        for task, p in proportions.items():
            assert abs(counts[task] - p * num_demos) < 1
            if p == 0:
                assert counts[task] == 0
