"""Questions about facts inserted into a real text: long-context QA with known answers.

Each fact is one sentence about a person the text never names. A literal question shares
its words and asks for the value ("Marisol's secret code word is lantern." / "What is
Marisol's secret code word?"), so retrieval by words can find it and the answer is one
span. A paraphrased question, as in NoLiMa, shares none of its content words
(``content_words``): it asks who the sentence is about and describes the value in other
words ("Marisol once visited the Eiffel Tower." / "Which person travelled to Paris?"),
so the answer is the name and retrieval by words misses the sentence. ``fact_contexts``
puts several facts into each context (a shuffled window of a book,
``lhc.data.haystack``) at depths spread over the whole set, so that one prefill of a
context serves several questions; the same contexts, cut to each length, serve every
length.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from lhc.data.haystack import Haystack, filter_lines, shuffled_haystack

# The first 40 are the original set: while they suffice, make_facts draws from them alone,
# so a seed's literal facts are those it always gave. None occurs in the King James Bible;
# Santiago (a city) and Wren (the Salt Wren) are also words of literal values.
NAMES = (
    "Marisol", "Dorian", "Yuki", "Tobias", "Ingrid", "Rafael", "Anouk", "Kenji", "Priya",
    "Lucian", "Odette", "Emeka", "Svetlana", "Matteo", "Zainab", "Henrik", "Amara",
    "Florian", "Leilani", "Casimir", "Noor", "Bruno", "Freya", "Tariq", "Ottilie", "Santiago",
    "Mei", "Laszlo", "Imogen", "Kofi", "Astrid", "Dmitri", "Paloma", "Rohan", "Greta",
    "Ignatius", "Wren", "Hamid", "Solveig", "Thaddeus",
    "Aurelio", "Beatriz", "Cosimo", "Dagny", "Fenella", "Giacomo", "Hallvard", "Isolde",
    "Ludmila", "Nikolai", "Oksana", "Pilar", "Quentin", "Rosalind", "Ragnhild", "Thorvald",
    "Ulrike", "Ximena", "Yevgeny", "Zofia", "Cressida", "Desmond", "Elowen", "Gunnar",
    "Hiroshi", "Lorcan", "Nadia", "Orla", "Radomir", "Saoirse", "Tancredi", "Vesna",
    "Wolfgang", "Zoltan", "Akosua", "Babajide", "Chiamaka", "Dumisani", "Folasade", "Kwame",
    "Nkechi", "Thandiwe", "Wanjiru", "Haruki", "Akiko", "Takeshi", "Xiulan", "Arjun",
    "Kavya", "Siddharth", "Ananya", "Farhan", "Emre", "Selin", "Arash", "Shirin", "Timur",
    "Gulnara", "Joaquim", "Catalina", "Renata", "Lautaro", "Maarten", "Linnea", "Eero",
    "Bohdan", "Jadwiga", "Levente", "Ioana", "Stavros", "Despina", "Leonor", "Iker",
    "Mireille", "Gaspard", "Niamh", "Eilidh", "Rhiannon", "Dafydd", "Evander",
)  # fmt: skip
_FIRST_NAMES = 40

# Literal facts, (statement, question, values): "{name}" and "{value}" are filled in.
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

# Paraphrased facts, (statement, question, {value: description}): "{name}" and "{value}"
# fill the statement, "{description}" the question, which shares no content word with
# the statement, whatever the name. Each description names its value among all of them
# (every value occurs in one template only), so a question about a set of facts drawn
# without repeating a value has one answer.
PARAPHRASE_TEMPLATES = (
    (
        "{name} once visited {value}.",
        "Which person travelled to {description}?",
        {"the Eiffel Tower": "Paris", "the Taj Mahal": "Agra",
         "the Golden Gate Bridge": "San Francisco", "the Sagrada Familia": "Barcelona",
         "the Kremlin": "Moscow", "Big Ben": "London", "the Statue of Liberty": "New York",
         "the Brandenburg Gate": "Berlin", "the Alhambra": "Granada",
         "Hagia Sophia": "Istanbul", "the Forbidden City": "Beijing",
         "Angkor Wat": "Cambodia", "Machu Picchu": "Peru", "the Space Needle": "Seattle",
         "the Burj Khalifa": "Dubai"},
    ),
    (
        "{name} moved to {value} last spring.",
        "Which person relocated to {description}?",
        {"Helsinki": "the capital of Finland", "Dublin": "the capital of Ireland",
         "Vienna": "the capital of Austria", "Canberra": "the capital of Australia",
         "Stockholm": "the capital of Sweden", "Budapest": "the capital of Hungary",
         "Prague": "the capital of the Czech Republic",
         "Seoul": "the capital of South Korea", "Bangkok": "the capital of Thailand",
         "Havana": "the capital of Cuba", "Copenhagen": "the capital of Denmark",
         "Wellington": "the capital of New Zealand",
         "Buenos Aires": "the capital of Argentina", "Jakarta": "the capital of Indonesia",
         "Kathmandu": "the capital of Nepal"},
    ),
    (
        "{name} has worked as a {value} for years.",
        "Which person earns a living {description}?",
        {"dentist": "repairing teeth", "plumber": "fixing leaky pipes",
         "baker": "making bread and pastries", "pilot": "flying passenger jets",
         "librarian": "lending books to readers", "florist": "selling cut flowers",
         "veterinarian": "treating sick animals",
         "locksmith": "opening locks and cutting keys",
         "firefighter": "extinguishing burning buildings",
         "translator": "turning texts from one language into another",
         "tailor": "sewing suits to measure", "beekeeper": "tending hives for honey",
         "pharmacist": "dispensing prescription medicines",
         "mechanic": "repairing car engines", "sculptor": "carving statues from marble"},
    ),
    (
        "{name} keeps a pet {value}.",
        "Which person owns {description}?",
        {"hedgehog": "a small spiny mammal that rolls into a ball",
         "tarantula": "a large hairy spider", "ferret": "a slinky relative of the weasel",
         "gecko": "a small wall-climbing lizard",
         "goldfish": "an orange fish swimming in a bowl",
         "hamster": "a small rodent that stores food in its cheeks",
         "tortoise": "a slow reptile with a domed shell",
         "python": "a huge constricting snake",
         "axolotl": "a Mexican salamander that never loses its gills",
         "alpaca": "a woolly Andean grazer related to the camel", "pony": "a small horse",
         "rabbit": "a long-eared burrowing animal that hops",
         "chameleon": "a colour-changing lizard",
         "hermit crab": "a crustacean living in a borrowed shell",
         "stick insect": "a bug disguised as a twig"},
    ),
    (
        "{name} plays the {value} every evening.",
        "Which person performs on {description}?",
        {"violin": "the bowed fiddle held under the chin",
         "cello": "the large bowed string instrument held between the knees",
         "piano": "a keyboard with eighty-eight keys",
         "accordion": "a squeezebox with bellows",
         "bagpipes": "the Scottish Highland instrument with drones and a bag",
         "banjo": "the twangy round-bodied instrument of bluegrass",
         "saxophone": "the curved brass reed horn of jazz",
         "ukulele": "the small four-stringed Hawaiian guitar",
         "xylophone": "wooden bars struck with mallets",
         "clarinet": "the black single-reed woodwind",
         "tuba": "the largest and lowest brass instrument",
         "sitar": "the long-necked Indian lute with sympathetic strings",
         "didgeridoo": "the Aboriginal Australian drone pipe",
         "trombone": "the brass instrument with a slide",
         "oboe": "the double-reed woodwind that tunes the orchestra"},
    ),
    (
        "{name} competes in {value} at weekends.",
        "Which person's sport involves {description}?",
        {"fencing": "fighting with thin swords", "archery": "shooting arrows at targets",
         "rowing": "racing narrow boats with oars",
         "curling": "sliding granite stones across ice",
         "judo": "Japanese grappling and throws", "surfing": "riding ocean waves on a board",
         "cricket": "bats, balls and wickets", "polo": "mallets and balls on horseback",
         "badminton": "hitting a shuttlecock over a net",
         "bowling": "knocking down ten pins", "skiing": "gliding down snowy slopes",
         "snooker": "potting coloured balls with a cue",
         "golf": "hitting a small ball around eighteen holes",
         "sumo": "Japanese heavyweight wrestling in a ring",
         "triathlon": "swimming, cycling and running in one race"},
    ),
    (
        "{name} is learning to speak {value}.",
        "Which person is studying {description}?",
        {"Portuguese": "the main language of Brazil",
         "Swahili": "the lingua franca of Tanzania", "Tagalog": "the main language of Manila",
         "Farsi": "the language of Iran", "Hindi": "the most widely spoken language of India",
         "Mandarin": "the official language of China",
         "Dutch": "the language of Amsterdam", "Spanish": "the main language of Mexico",
         "Greek": "the language of Homer", "Arabic": "the language of the Quran",
         "Malay": "the national language of Malaysia",
         "Mongolian": "the language of Genghis Khan", "Ukrainian": "the language of Kyiv",
         "Romanian": "the language of Bucharest", "Welsh": "the Celtic language of Wales"},
    ),
    (
        "{name} cooked {value} for the neighbours.",
        "Which person prepared {description}?",
        {"paella": "the Valencian rice pan dish",
         "sushi": "vinegared rice rolled with raw fish",
         "lasagne": "layered pasta baked with cheese and meat sauce",
         "goulash": "a Hungarian paprika stew", "borscht": "a beetroot soup",
         "gazpacho": "a chilled tomato soup", "fondue": "a pot of melted cheese for dipping",
         "guacamole": "a mashed avocado dip", "hummus": "a chickpea and tahini dip",
         "tiramisu": "a coffee-soaked mascarpone dessert",
         "pavlova": "a meringue cake with cream and berries",
         "kimchi": "spicy fermented cabbage", "ceviche": "raw fish cured in lime juice",
         "risotto": "creamy Italian rice stirred in broth",
         "baklava": "a layered nut pastry soaked in syrup"},
    ),
)  # fmt: skip

# Lucene's English stop words (bm25s's too, so a paraphrased question's BM25 score on its
# own fact is 0): the only words a paraphrased question may share with its fact.
STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is",
    "it", "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there",
    "these", "they", "this", "to", "was", "will", "with",
))  # fmt: skip

INSTRUCTION = "Answer from the text above. "


def content_words(text: str) -> set[str]:
    """The words of ``text``, lower-cased, without punctuation, a possessive "'s" or
    ``STOPWORDS``."""
    words = re.findall(r"[^\W_]+", re.sub(r"'s\b", "", text.lower()))
    return {w for w in words if w not in STOPWORDS}


@dataclasses.dataclass(frozen=True)
class Fact:
    """One inserted sentence, the question about it and its answer.

    Attributes:
        statement: the sentence put into the context.
        question: literal, it names the person and asks for ``value`` (the answer);
            paraphrased, it asks who the statement is about, by a description of
            ``value`` that shares no word of ``content_words`` with the statement.
        answer: ``value`` (literal) or the person's name (paraphrased).
        value: what the statement says of its person.
        paraphrased: which kind of question.
    """

    statement: str
    question: str
    answer: str
    value: str
    paraphrased: bool = False


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


def make_facts(count: int, seed: int = 0, paraphrased: float = 0.0) -> list[Fact]:
    """``count`` facts about different people, a share ``paraphrased`` of them with a
    paraphrased question.

    Literal facts take ``TEMPLATES`` in turn (in an order drawn with ``seed``), each value
    drawn with ``seed``; the names come from the first 40 of ``NAMES`` while ``count``
    allows, so with ``paraphrased=0`` a seed gives the facts it gave before there were
    more names or paraphrases. ``round(paraphrased * count)`` facts (halves up), spread
    evenly over the list (every other one at 0.5), are paraphrased instead: the same
    person, ``PARAPHRASE_TEMPLATES`` in turn (in an order drawn with ``seed``), no value
    twice. The other facts are those of ``paraphrased=0``.

    Raises:
        ValueError: ``count`` below 1 or above ``len(NAMES)``, or ``paraphrased`` outside
            [0, 1].
    """
    if not 1 <= count <= len(NAMES):
        raise ValueError(f"count must lie in [1, {len(NAMES)}] (one name per fact), got {count}")
    if not 0.0 <= paraphrased <= 1.0:
        raise ValueError(
            f"paraphrased must lie in [0, 1] (a share of the facts), got {paraphrased}"
        )
    rng = np.random.default_rng(seed)
    names = rng.permutation(NAMES[:_FIRST_NAMES] if count <= _FIRST_NAMES else NAMES)[:count]
    order = rng.permutation(len(TEMPLATES))
    facts = []
    for i, name in enumerate(names):
        statement, question, values = TEMPLATES[order[i % len(TEMPLATES)]]
        value = str(values[rng.integers(len(values))])
        facts.append(
            Fact(statement.format(name=name, value=value), question.format(name=name), value, value)
        )
    num_paraphrased = int(paraphrased * count + 0.5)
    if num_paraphrased:
        # Drawn after the literal facts, so those stay what paraphrased=0 gives.
        kinds = rng.permutation(len(PARAPHRASE_TEMPLATES))
        picks = [rng.permutation(len(values)) for _, _, values in PARAPHRASE_TEMPLATES]
        spread = [
            i
            for i in range(count)
            if (i + 1) * num_paraphrased // count > i * num_paraphrased // count
        ]
        for m, i in enumerate(spread):
            kind = kinds[m % len(kinds)]
            statement, question, descriptions = PARAPHRASE_TEMPLATES[kind]
            value = list(descriptions)[picks[kind][m // len(kinds)]]
            name = str(names[i])
            fact = Fact(
                statement.format(name=name, value=value),
                question.format(description=descriptions[value]),
                name,
                value,
                paraphrased=True,
            )
            shared = content_words(fact.question) & content_words(fact.statement)
            assert not shared, f"{fact.question!r} shares {sorted(shared)} with its fact"
            facts[i] = fact
    return facts


def fact_contexts(
    paths: Sequence[str],
    tokenizer,
    lengths: Sequence[int],
    *,
    num_contexts: int,
    facts_per_context: int,
    seed: int = 0,
    paraphrased: float = 0.0,
) -> dict[int, FactContexts]:
    """``{length: FactContexts}``: ``num_contexts`` contexts of book text (snippets of
    the files at ``paths`` shuffled with ``seed + c``, lines naming any person, answer or
    value dropped), each holding ``facts_per_context`` facts of ``make_facts`` (a share
    ``paraphrased`` of them with paraphrased questions).

    The ``num_contexts * facts_per_context`` facts sit at depths evenly spread over
    (0, 1): fact j of context c at ``(c + j * num_contexts + 0.5) / total``, so every
    context holds one near the start and one near the end, and every length the same
    facts at the same depths.
    """
    total = num_contexts * facts_per_context
    facts = make_facts(total, seed, paraphrased)
    keywords = [*NAMES, *(f.answer for f in facts), *(f.value for f in facts)]
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
