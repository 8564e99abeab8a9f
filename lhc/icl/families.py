"""Task families of "task superposition" (Xiong et al., ICML 2025).

A language model given in-context demonstrations of several tasks mixed in one prompt
spreads its answer probability over the answers of those tasks ("task superposition").
A *family* is a set of tasks that share their inputs: every sampled input has one answer
per task, for example ``"45+44"`` -> ``"89"`` (``digits``), ``"eighty-nine"``
(``english``), ``"quatre-vingt-neuf"`` (``french``) and ``"ochenta y nueve"``
(``spanish``). The families are those of the paper's Fig. 2 plus the generated numeric
ones of the official code:

* ``"addition"``: ``"A+B"`` with A, B in [10, 99]; the sum in digits, English, French or
  Spanish words (``number_words``).
* ``"country"``: a country name; its capital, its continent, or the name upper-cased.
* ``"copy"``: ``"A@B"`` with A, B in [10, 99] (A != B); copy A, copy B, or A + B.
* ``"letters"``: an English word; its first or last letter, lower- or upper-case.
* ``"arith"``: an integer x in [10, 99]; x + 1, 2x, x * x or x - 1.

Three families that are not the paper's, of tasks a 135M-parameter model does alone in
context (``experiments/icl/superposition``):

* ``"case"``: an English word; the word itself, upper-cased, or capitalised.
* ``"antonym"``: an English word of ``ANTONYMS``; its opposite, the word itself, or the
  word upper-cased.
* ``"numbers"``: a number from one to twenty in English words; in digits, French or
  Spanish.

Every family guarantees that, for each sampled input, the task answers are pairwise
different strings (inputs where two tasks would agree are resampled, and the word and
country tables are chosen so that none would), so the task behind a model's answer is
never ambiguous.

``superposition_prompt`` builds the prompts of the paper's Fig. 2 configurations: a
number of demonstrations (60 to 80 there), one per line as ``input + separator +
answer``, split across the tasks by given proportions (evenly there) in a random order,
each on a fresh input, then the query input and the separator with no instruction::

    rng = np.random.default_rng(0)
    family = get_family("addition")
    prompt = superposition_prompt(rng, family, {t: 0.25 for t in family.tasks}, 60)
    prompt.text     # "...\\n34+51->quatre-vingt-cinq\\n...\\n45+44->"
    prompt.answers  # {"digits": "89", "english": "eighty-nine", ...}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np

__all__ = [
    "ANTONYMS",
    "COUNTRIES",
    "FAMILIES",
    "LANGUAGES",
    "WORDS",
    "Family",
    "Prompt",
    "demo_counts",
    "get_family",
    "number_words",
    "superposition_prompt",
]

Sample = tuple[str, dict[str, str]]

# ---------------------------------------------------------------------------------------
# Number words.

_ENGLISH_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_ENGLISH_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()

_FRENCH_UNITS = (
    "zéro un deux trois quatre cinq six sept huit neuf dix onze douze treize quatorze quinze "
    "seize dix-sept dix-huit dix-neuf"
).split()
_FRENCH_TENS = "_ _ vingt trente quarante cinquante soixante".split()

_SPANISH_UNITS = (
    "cero uno dos tres cuatro cinco seis siete ocho nueve diez once doce trece catorce quince "
    "dieciséis diecisiete dieciocho diecinueve veinte veintiuno veintidós veintitrés "
    "veinticuatro veinticinco veintiséis veintisiete veintiocho veintinueve"
).split()
_SPANISH_TENS = "_ _ _ treinta cuarenta cincuenta sesenta setenta ochenta noventa".split()

LANGUAGES = ("english", "french", "spanish")


def _english(n: int) -> str:
    if n >= 100:
        return "one hundred" if n == 100 else "one hundred " + _english(n - 100)
    if n < 20:
        return _ENGLISH_UNITS[n]
    tens, units = divmod(n, 10)
    return _ENGLISH_TENS[tens] + ("" if units == 0 else "-" + _ENGLISH_UNITS[units])


def _french(n: int) -> str:
    if n >= 100:
        return "cent" if n == 100 else "cent " + _french(n - 100)
    if n < 20:
        return _FRENCH_UNITS[n]
    if n < 70:
        tens, units = divmod(n, 10)
        if units == 0:
            return _FRENCH_TENS[tens]
        joiner = " et " if units == 1 else "-"
        return _FRENCH_TENS[tens] + joiner + _FRENCH_UNITS[units]
    if n < 80:  # soixante-dix ... soixante-dix-neuf, with "soixante et onze"
        return "soixante" + (" et " if n == 71 else "-") + _FRENCH_UNITS[n - 60]
    if n == 80:
        return "quatre-vingts"
    return "quatre-vingt-" + _FRENCH_UNITS[n - 80]  # 81 quatre-vingt-un, 91 quatre-vingt-onze


def _spanish(n: int) -> str:
    if n >= 100:
        return "cien" if n == 100 else "ciento " + _spanish(n - 100)
    if n < 30:
        return _SPANISH_UNITS[n]
    tens, units = divmod(n, 10)
    return _SPANISH_TENS[tens] + ("" if units == 0 else " y " + _SPANISH_UNITS[units])


_NUMBER_WORDS: dict[str, Callable[[int], str]] = {
    "english": _english,
    "french": _french,
    "spanish": _spanish,
}


def number_words(n: int, language: str) -> str:
    """Spells out ``n`` in words.

    English hyphenates tens and units and writes no "and" ("one hundred eighty-nine").
    French is the traditional spelling: hyphens between tens and units, "et" in 21, 31,
    41, 51, 61 and 71, "quatre-vingts" for 80 but "quatre-vingt-un" for 81 ("cent
    quatre-vingt-dix-huit"). Spanish is accented where correct ("veintidós",
    "dieciséis"), with "cien" for 100 and "ciento" above it.

    Args:
        n: the integer, in [0, 199].
        language: ``"english"``, ``"french"`` or ``"spanish"``.

    Returns:
        The number in words, lower-case.

    Raises:
        ValueError: ``n`` is not an integer in [0, 199], or the language is unknown.
    """
    if language not in _NUMBER_WORDS:
        raise ValueError(
            f"number_words: language must be one of {', '.join(LANGUAGES)}, got {language!r}"
        )
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= 199:
        raise ValueError(f"number_words: n must be an integer in [0, 199], got {n!r}")
    return _NUMBER_WORDS[language](int(n))


# ---------------------------------------------------------------------------------------
# Tables.

# Country -> (capital, continent). ASCII only; transcontinental countries and countries with
# several or contested capitals are left out, and so are city-states named like their
# capital. Central America and the Caribbean count as North America.
COUNTRIES: dict[str, tuple[str, str]] = {
    # Europe
    "France": ("Paris", "Europe"),
    "Germany": ("Berlin", "Europe"),
    "Italy": ("Rome", "Europe"),
    "Spain": ("Madrid", "Europe"),
    "Portugal": ("Lisbon", "Europe"),
    "United Kingdom": ("London", "Europe"),
    "Ireland": ("Dublin", "Europe"),
    "Netherlands": ("Amsterdam", "Europe"),
    "Belgium": ("Brussels", "Europe"),
    "Switzerland": ("Bern", "Europe"),
    "Austria": ("Vienna", "Europe"),
    "Poland": ("Warsaw", "Europe"),
    "Czech Republic": ("Prague", "Europe"),
    "Hungary": ("Budapest", "Europe"),
    "Greece": ("Athens", "Europe"),
    "Sweden": ("Stockholm", "Europe"),
    "Norway": ("Oslo", "Europe"),
    "Denmark": ("Copenhagen", "Europe"),
    "Finland": ("Helsinki", "Europe"),
    "Iceland": ("Reykjavik", "Europe"),
    "Romania": ("Bucharest", "Europe"),
    "Bulgaria": ("Sofia", "Europe"),
    "Ukraine": ("Kyiv", "Europe"),
    "Croatia": ("Zagreb", "Europe"),
    "Serbia": ("Belgrade", "Europe"),
    # Asia
    "China": ("Beijing", "Asia"),
    "Japan": ("Tokyo", "Asia"),
    "India": ("New Delhi", "Asia"),
    "South Korea": ("Seoul", "Asia"),
    "Indonesia": ("Jakarta", "Asia"),
    "Thailand": ("Bangkok", "Asia"),
    "Vietnam": ("Hanoi", "Asia"),
    "Philippines": ("Manila", "Asia"),
    "Malaysia": ("Kuala Lumpur", "Asia"),
    "Pakistan": ("Islamabad", "Asia"),
    "Bangladesh": ("Dhaka", "Asia"),
    "Iran": ("Tehran", "Asia"),
    "Iraq": ("Baghdad", "Asia"),
    "Saudi Arabia": ("Riyadh", "Asia"),
    "Afghanistan": ("Kabul", "Asia"),
    "Nepal": ("Kathmandu", "Asia"),
    "Mongolia": ("Ulaanbaatar", "Asia"),
    "Jordan": ("Amman", "Asia"),
    "Syria": ("Damascus", "Asia"),
    "Lebanon": ("Beirut", "Asia"),
    "Qatar": ("Doha", "Asia"),
    "United Arab Emirates": ("Abu Dhabi", "Asia"),
    # Africa
    "Egypt": ("Cairo", "Africa"),
    "Nigeria": ("Abuja", "Africa"),
    "Kenya": ("Nairobi", "Africa"),
    "Ethiopia": ("Addis Ababa", "Africa"),
    "Morocco": ("Rabat", "Africa"),
    "Ghana": ("Accra", "Africa"),
    "Algeria": ("Algiers", "Africa"),
    "Senegal": ("Dakar", "Africa"),
    "Uganda": ("Kampala", "Africa"),
    "Zimbabwe": ("Harare", "Africa"),
    "Angola": ("Luanda", "Africa"),
    "Sudan": ("Khartoum", "Africa"),
    "Mali": ("Bamako", "Africa"),
    "Rwanda": ("Kigali", "Africa"),
    "Zambia": ("Lusaka", "Africa"),
    "Libya": ("Tripoli", "Africa"),
    "Madagascar": ("Antananarivo", "Africa"),
    "Cameroon": ("Yaounde", "Africa"),
    "Mozambique": ("Maputo", "Africa"),
    # North America
    "Canada": ("Ottawa", "North America"),
    "United States": ("Washington, D.C.", "North America"),
    "Mexico": ("Mexico City", "North America"),
    "Cuba": ("Havana", "North America"),
    "Jamaica": ("Kingston", "North America"),
    "Costa Rica": ("San Jose", "North America"),
    "Honduras": ("Tegucigalpa", "North America"),
    "Nicaragua": ("Managua", "North America"),
    "Haiti": ("Port-au-Prince", "North America"),
    "Dominican Republic": ("Santo Domingo", "North America"),
    # South America
    "Brazil": ("Brasilia", "South America"),
    "Argentina": ("Buenos Aires", "South America"),
    "Chile": ("Santiago", "South America"),
    "Peru": ("Lima", "South America"),
    "Colombia": ("Bogota", "South America"),
    "Venezuela": ("Caracas", "South America"),
    "Ecuador": ("Quito", "South America"),
    "Uruguay": ("Montevideo", "South America"),
    "Paraguay": ("Asuncion", "South America"),
    # Oceania
    "Australia": ("Canberra", "Oceania"),
    "New Zealand": ("Wellington", "Oceania"),
    "Fiji": ("Suva", "Oceania"),
    "Papua New Guinea": ("Port Moresby", "Oceania"),
    "Samoa": ("Apia", "Oceania"),
}

# Common English words of 4 to 9 lower-case letters whose first and last letters differ
# (so that the first-letter and last-letter tasks never agree).
WORDS: tuple[str, ...] = tuple(
    """
    apple bread chair dance flour garden honey island jacket kitchen lemon market number
    orange pencil quiet silver table uncle violin yellow zebra about again along always animal
    answer around before begin below better bottom branch bright brother build candle carry
    castle center change circle city clean clock cloud color corner country cousin cover crowd
    dark daughter doctor dollar dream drink early earth either enough evening every family
    farmer father field finger forest friend front funny glass grass green ground happy heavy
    horse hotel house hundred hunter inside jungle kind king language large laugh learn letter
    light listen little long lucky magic marble middle minute mirror money month morning
    mother mountain music narrow nature never night north ocean office often open paper party
    people picture plant pocket power pretty problem purple quick rabbit rain ready road rock
    rocket round salt school season second seven shadow shirt short simple sister small smile
    snow sound south spring square station stone story street strong student sugar summer
    sunny system teacher thank thing tiger today tomorrow tower travel tree turtle under
    valley very village visit voice water weather winter woman wonder world write young
    """.split()
)

# Pairs of opposites, each word in one pair only (lower case, ASCII).
ANTONYMS: tuple[tuple[str, str], ...] = tuple(
    tuple(pair.split("/"))
    for pair in """
    hot/cold big/small fast/slow high/low happy/sad light/dark long/short open/closed
    rich/poor young/old early/late hard/soft full/empty wet/dry strong/weak up/down
    left/right black/white day/night good/bad thick/thin love/hate win/lose buy/sell
    push/pull first/last in/out yes/no true/false alive/dead clean/dirty loud/quiet
    wide/narrow deep/shallow cheap/expensive inside/outside before/after above/below
    always/never easy/difficult friend/enemy sweet/sour north/south east/west
    summer/winter question/answer boy/girl asleep/awake give/take remember/forget
    beautiful/ugly polite/rude lost/found smooth/rough near/far begin/end front/back
    top/bottom public/private laugh/cry
    """.split()
)
_OPPOSITE = {a: b for pair in ANTONYMS for a, b in (pair, pair[::-1])}

# ---------------------------------------------------------------------------------------
# Families.


@dataclasses.dataclass(frozen=True)
class Family:
    """A set of tasks that share their inputs.

    Attributes:
        name: the family's name, its key in ``FAMILIES``.
        tasks: the task names, in a fixed order.
        separator: what goes between the input and the answer in a demonstration.
        sample: ``sample(rng) -> (input_text, {task: answer})``, an answer for every task;
            the answers of one input are pairwise different strings.
    """

    name: str
    tasks: tuple[str, ...]
    separator: str
    sample: Callable[[np.random.Generator], Sample]

    def __post_init__(self) -> None:
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(
                f"Family {self.name!r}: tasks must be non-empty and distinct, got {self.tasks}"
            )

    def samples(self, rng: np.random.Generator, n: int) -> list[Sample]:
        """``n`` samples ``(input_text, {task: answer})`` drawn one after the other."""
        return [self.sample(rng) for _ in range(n)]


def _distinct(
    tasks: tuple[str, ...], draw: Callable[[np.random.Generator], Sample]
) -> Callable[[np.random.Generator], Sample]:
    """Wraps ``draw`` to resample until the answers of ``tasks`` are pairwise different."""

    def sample(rng: np.random.Generator) -> Sample:
        for _ in range(1000):
            text, answers = draw(rng)
            values = [answers[t] for t in tasks]
            if len(set(values)) == len(values):
                return text, {t: answers[t] for t in tasks}
        raise RuntimeError(f"no input with pairwise different answers for tasks {tasks}")

    return sample


def _family(
    name: str, tasks: tuple[str, ...], separator: str, draw: Callable[[np.random.Generator], Sample]
) -> Family:
    return Family(name=name, tasks=tasks, separator=separator, sample=_distinct(tasks, draw))


def _two_digit(rng: np.random.Generator) -> int:
    return int(rng.integers(10, 100))


def _addition(rng: np.random.Generator) -> Sample:
    a, b = _two_digit(rng), _two_digit(rng)
    total = a + b
    answers = {"digits": str(total)}
    answers.update({language: number_words(total, language) for language in LANGUAGES})
    return f"{a}+{b}", answers


_COUNTRY_NAMES = tuple(COUNTRIES)


def _country(rng: np.random.Generator) -> Sample:
    country = _COUNTRY_NAMES[int(rng.integers(len(_COUNTRY_NAMES)))]
    capital, continent = COUNTRIES[country]
    return country, {"capital": capital, "continent": continent, "upper": country.upper()}


def _copy(rng: np.random.Generator) -> Sample:
    a, b = _two_digit(rng), _two_digit(rng)
    return f"{a}@{b}", {"copy_a": str(a), "copy_b": str(b), "sum": str(a + b)}


def _letters(rng: np.random.Generator) -> Sample:
    word = WORDS[int(rng.integers(len(WORDS)))]
    return word, {
        "first_lower": word[0].lower(),
        "first_upper": word[0].upper(),
        "last_lower": word[-1].lower(),
        "last_upper": word[-1].upper(),
    }


def _arith(rng: np.random.Generator) -> Sample:
    x = _two_digit(rng)
    return str(x), {
        "plus_one": str(x + 1),
        "times_two": str(2 * x),
        "square": str(x * x),
        "minus_one": str(x - 1),
    }


def _case(rng: np.random.Generator) -> Sample:
    word = WORDS[int(rng.integers(len(WORDS)))]
    return word, {"copy": word, "upper": word.upper(), "title": word.capitalize()}


_ANTONYM_WORDS = tuple(_OPPOSITE)


def _antonym(rng: np.random.Generator) -> Sample:
    word = _ANTONYM_WORDS[int(rng.integers(len(_ANTONYM_WORDS)))]
    return word, {"antonym": _OPPOSITE[word], "copy": word, "upper": word.upper()}


def _numbers(rng: np.random.Generator) -> Sample:
    n = int(rng.integers(1, 21))
    return number_words(n, "english"), {
        "digits": str(n),
        "french": number_words(n, "french"),
        "spanish": number_words(n, "spanish"),
    }


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        _family("addition", ("digits", "english", "french", "spanish"), "->", _addition),
        _family("country", ("capital", "continent", "upper"), "->", _country),
        _family("copy", ("copy_a", "copy_b", "sum"), "=", _copy),
        _family(
            "letters", ("first_lower", "first_upper", "last_lower", "last_upper"), "->", _letters
        ),
        _family("arith", ("plus_one", "times_two", "square", "minus_one"), "->", _arith),
        _family("case", ("copy", "upper", "title"), "->", _case),
        _family("antonym", ("antonym", "copy", "upper"), "->", _antonym),
        _family("numbers", ("digits", "french", "spanish"), "->", _numbers),
    )
}


def get_family(name: str) -> Family:
    """The family called ``name``.

    Raises:
        ValueError: no family has that name (the message lists the known ones).
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


# ---------------------------------------------------------------------------------------
# Prompts.


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A task-superposition prompt.

    Attributes:
        text: the demonstrations, one per line as ``input + separator + answer`` each ended
            by the line separator, then the query input and the separator (no answer).
        query: the query input.
        answers: the query's answer for every task of the family.
        counts: how many demonstrations each task of the family got.
    """

    text: str
    query: str
    answers: dict[str, str]
    counts: dict[str, int]


def demo_counts(family: Family, proportions: Mapping[str, float], num_demos: int) -> dict[str, int]:
    """Splits ``num_demos`` demonstrations across the tasks by the largest-remainder method.

    Each task gets the floor of its quota ``proportions[task] * num_demos``; the
    demonstrations left over go one each to the tasks with the largest remainders (ties
    in the family's task order). Tasks missing from ``proportions`` or with proportion 0
    get none.

    Args:
        family: the task family.
        proportions: task -> proportion, non-negative and summing to 1 (within 1e-6).
        num_demos: the number of demonstrations, at least 1.

    Returns:
        task -> number of demonstrations, for every task of the family, summing to
        ``num_demos``.

    Raises:
        ValueError: on an unknown task, a negative or non-finite proportion, proportions
            that do not sum to 1, or ``num_demos`` < 1.
    """
    unknown = [task for task in proportions if task not in family.tasks]
    if unknown:
        raise ValueError(
            f"proportions: expected tasks of family {family.name!r} "
            f"({', '.join(family.tasks)}), got unknown {', '.join(map(repr, unknown))}"
        )
    for task, p in proportions.items():
        if not math.isfinite(p) or p < 0:
            raise ValueError(
                f"proportions: expected non-negative finite values, got {task!r}: {p!r}"
            )
    total = math.fsum(proportions.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"proportions: expected values summing to 1 (within 1e-6), got {total!r}")
    if isinstance(num_demos, bool) or not isinstance(num_demos, int | np.integer) or num_demos < 1:
        raise ValueError(f"num_demos: expected an integer >= 1, got {num_demos!r}")
    num_demos = int(num_demos)
    # Quotas of the normalized proportions, rounded so that 0.1 * 10 counts as exactly 1.
    quotas = {t: round(proportions.get(t, 0.0) / total * num_demos, 9) for t in family.tasks}
    counts = {t: math.floor(q) for t, q in quotas.items()}
    positive = [t for t in family.tasks if proportions.get(t, 0.0) > 0]
    order = sorted(positive, key=lambda t: (-(quotas[t] - counts[t]), family.tasks.index(t)))
    for i in range(num_demos - sum(counts.values())):
        counts[order[i % len(order)]] += 1
    return counts


def superposition_prompt(
    rng: np.random.Generator,
    family: Family,
    proportions: Mapping[str, float],
    num_demos: int,
    query: Sample | None = None,
    line_sep: str = "\n",
) -> Prompt:
    """A prompt of demonstrations of several tasks of a family, mixed, then a query.

    Task ``t`` gets ``proportions[t] * num_demos`` demonstrations, rounded by the
    largest-remainder method so that the counts sum to ``num_demos`` (``demo_counts``).
    The demonstrations come in a random order, each on a fresh input from
    ``family.sample``; the query follows with the separator and no answer.

    Args:
        rng: the random generator (order of the demonstrations, their inputs, the query).
        family: the task family.
        proportions: task -> proportion of the demonstrations, non-negative, summing to 1
            (within 1e-6); tasks left out get none.
        num_demos: the number of demonstrations, at least 1.
        query: the query as ``(input_text, {task: answer})``; sampled from the family
            when None.
        line_sep: what ends each demonstration.

    Returns:
        The ``Prompt``.

    Raises:
        ValueError: on an unknown task, a negative proportion, proportions that do not sum
            to 1, ``num_demos`` < 1, or a query whose answers do not name the family's tasks.
    """
    counts = demo_counts(family, proportions, num_demos)
    if query is not None:
        text, answers = query
        if set(answers) != set(family.tasks):
            raise ValueError(
                f"query: expected answers for the tasks {', '.join(family.tasks)} of family "
                f"{family.name!r}, got answers for {', '.join(answers) or 'no task'}"
            )
    labels = [task for task in family.tasks for _ in range(counts[task])]
    lines = []
    for i in rng.permutation(len(labels)):
        demo_input, demo_answers = family.sample(rng)
        lines.append(demo_input + family.separator + demo_answers[labels[i]] + line_sep)
    if query is None:
        query = family.sample(rng)
    query_input, query_answers = query
    return Prompt(
        text="".join(lines) + query_input + family.separator,
        query=query_input,
        answers=dict(query_answers),
        counts=counts,
    )
