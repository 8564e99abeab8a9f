"""Questions about facts inserted into a real text: long-context QA with known answers.

Each fact is one sentence about a person the text never names ("Marisol's secret code
word is lantern.") with a question that shares its words ("What is Marisol's secret code
word?"), so retrieval by words can find it and the answer is one span. ``fact_contexts``
puts several facts into each context (a shuffled window of a book, ``lhc.data.haystack``)
at depths spread over the whole set, so that one prefill of a context serves several
questions; the same contexts, cut to each length, serve every length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lhc.data.haystack import Haystack, filter_lines, shuffled_haystack

NAMES = (
    "Marisol", "Dorian", "Yuki", "Tobias", "Ingrid", "Rafael", "Anouk", "Kenji", "Priya",
    "Lucian", "Odette", "Emeka", "Svetlana", "Matteo", "Zainab", "Henrik", "Amara",
    "Florian", "Leilani", "Casimir", "Noor", "Bruno", "Freya", "Tariq", "Ottilie", "Santiago",
    "Mei", "Laszlo", "Imogen", "Kofi", "Astrid", "Dmitri", "Paloma", "Rohan", "Greta",
    "Ignatius", "Wren", "Hamid", "Solveig", "Thaddeus",
)  # fmt: skip

# (statement, question, values): "{name}" and "{value}" are filled in.
TEMPLATES = (
    (
        "{name}'s secret code word is {value}.",
        "What is {name}'s secret code word?",
        ("lantern", "marmalade", "telescope", "pinecone", "harmonica", "velvet", "compass",
         "thimble", "saffron", "glacier"),
    ),
    (
        "{name} has a parrot named {value}.",
        "What is the name of {name}'s parrot?",
        ("Biscuit", "Pickles", "Mango", "Captain", "Waffles", "Pepper", "Noodle", "Sprocket",
         "Tofu", "Jellybean"),
    ),
    (
        "{name} was born in the city of {value}.",
        "In which city was {name} born?",
        ("Nairobi", "Lisbon", "Oslo", "Santiago", "Hanoi", "Montreal", "Reykjavik", "Kraków",
         "Osaka", "Tbilisi"),
    ),
    (
        "{name} paid {value} silver coins for the old map.",
        "How many silver coins did {name} pay for the old map?",
        tuple(str(n) for n in range(112, 1000, 97)),
    ),
    (
        "{name}'s favourite fruit is the {value}.",
        "What is {name}'s favourite fruit?",
        ("apricot", "papaya", "kiwi", "lychee", "guava", "persimmon", "mango", "plum",
         "quince", "tangerine"),
    ),
    (
        "The boat that {name} built is called the {value}.",
        "What is the name of the boat that {name} built?",
        ("Sea Lark", "Blue Heron", "Morning Star", "Silver Gull", "Red Fox", "Storm Petrel",
         "Golden Eel", "Night Owl", "Salt Wren", "Iron Crane"),
    ),
)  # fmt: skip

INSTRUCTION = "Answer from the text above. "


@dataclasses.dataclass(frozen=True)
class Fact:
    """One inserted sentence, the question about it and its answer."""

    statement: str
    question: str
    answer: str


@dataclasses.dataclass(frozen=True)
class FactContexts:
    """``contexts[c]``: tokens of context c (``length`` tokens); ``facts[c][j]``: the j-th
    fact inserted into it, at token ``starts[c][j]`` (requested depth ``depths[c][j]``)."""

    length: int
    contexts: list[np.ndarray]
    facts: list[list[Fact]]
    starts: list[list[int]]
    depths: list[list[float]]

    def questions(self, j: int) -> list[str]:
        """The j-th question of every context, with ``INSTRUCTION`` before it."""
        return [INSTRUCTION + facts[j].question for facts in self.facts]

    def answers(self, j: int) -> list[str]:
        return [facts[j].answer for facts in self.facts]


def make_facts(count: int, seed: int = 0) -> list[Fact]:
    """``count`` facts about different people, the templates taken in turn (in an order
    drawn with ``seed``), each value drawn with ``seed``.

    Raises:
        ValueError: ``count`` below 1 or above ``len(NAMES)``.
    """
    if not 1 <= count <= len(NAMES):
        raise ValueError(f"count must lie in [1, {len(NAMES)}] (one name per fact), got {count}")
    rng = np.random.default_rng(seed)
    names = rng.permutation(NAMES)[:count]
    order = rng.permutation(len(TEMPLATES))
    facts = []
    for i, name in enumerate(names):
        statement, question, values = TEMPLATES[order[i % len(TEMPLATES)]]
        value = str(values[rng.integers(len(values))])
        facts.append(
            Fact(statement.format(name=name, value=value), question.format(name=name), value)
        )
    return facts


def fact_contexts(
    paths: Sequence[str],
    tokenizer,
    lengths: Sequence[int],
    *,
    num_contexts: int,
    facts_per_context: int,
    seed: int = 0,
) -> dict[int, FactContexts]:
    """``{length: FactContexts}``: ``num_contexts`` contexts of book text (snippets of
    the files at ``paths`` shuffled with ``seed + c``, lines naming any person or answer
    dropped), each holding ``facts_per_context`` facts of ``make_facts``.

    The ``num_contexts * facts_per_context`` facts sit at depths evenly spread over
    (0, 1): fact j of context c at ``(c + j * num_contexts + 0.5) / total``, so every
    context holds one near the start and one near the end, and every length the same
    facts at the same depths.
    """
    total = num_contexts * facts_per_context
    facts = make_facts(total, seed)
    keywords = [*NAMES, *(f.answer for f in facts)]
    longest = max(lengths)
    out = {n: FactContexts(n, [], [], [], []) for n in lengths}
    for c in range(num_contexts):
        lines = shuffled_haystack(paths, num_lines=max(64, longest // 6), seed=seed + c)
        haystack = Haystack(filter_lines(lines, keywords)[0], tokenizer)
        mine = [facts[c + j * num_contexts] for j in range(facts_per_context)]
        depths = [(c + j * num_contexts + 0.5) / total for j in range(facts_per_context)]
        for n, bucket in out.items():
            tokens, starts = haystack.insert(
                [(d, f.statement) for d, f in zip(depths, mine)], length=n
            )
            bucket.contexts.append(np.asarray(tokens, np.int32))
            bucket.facts.append(mine)
            bucket.starts.append(starts)
            bucket.depths.append(depths)
    return out
