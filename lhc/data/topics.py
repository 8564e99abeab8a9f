"""English sentences about eight topics, generated, for in-context classification with
pretrained language models (Iterative Vectors, EMLoC, task vectors).

Each topic has subjects, predicates and complements whose words belong to it; a
sentence is one of each (``subject predicate complement.``), 6 x 6 x 6 = 216 sentences
per topic. A model that reads English tells the topic from the words; what it cannot
know without the context is which *label* names which topic when the labels are
arbitrary (``labels="letters"``: " A", " B", ...), which is where in-context learning
has headroom. With ``labels="names"`` the labels are the topics' own names.

    task = TopicTask(topics=("sports", "food", "weather", "music"), labels="letters")
    texts, classes = task.sample(np.random.default_rng(0), 100)
    task.label_texts()   # (' A', ' B', ' C', ' D')
"""

from __future__ import annotations

import dataclasses

import numpy as np

# topic: (subjects, predicates, complements)
TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "sports": (
        (
            "The striker",
            "Our goalkeeper",
            "The home team",
            "The coach",
            "The young sprinter",
            "The tennis champion",
        ),
        (
            "scored twice in",
            "trained hard before",
            "celebrated after",
            "was injured during",
            "dominated",
            "lost narrowly in",
        ),
        (
            "the final match",
            "the league game",
            "yesterday's race",
            "the championship",
            "the semi-final",
            "the season opener",
        ),
    ),
    "food": (
        (
            "The chef",
            "My grandmother",
            "The bakery",
            "Our waiter",
            "The pastry cook",
            "The food critic",
        ),
        ("served", "slowly roasted", "tasted", "baked", "seasoned", "recommended"),
        (
            "a spicy tomato soup",
            "fresh bread with butter",
            "the grilled salmon",
            "a chocolate cake",
            "the garlic pasta",
            "a bowl of rice and beans",
        ),
    ),
    "weather": (
        (
            "A cold front",
            "The storm",
            "Heavy rain",
            "The morning fog",
            "A strong wind",
            "The heat wave",
        ),
        (
            "swept across",
            "flooded",
            "settled over",
            "brought snow to",
            "cooled down",
            "is forecast for",
        ),
        (
            "the northern coast",
            "the valley tonight",
            "the mountain passes",
            "the city by noon",
            "the eastern plains",
            "the islands this weekend",
        ),
    ),
    "music": (
        (
            "The orchestra",
            "The guitarist",
            "Our choir",
            "The jazz pianist",
            "The young violinist",
            "The rock band",
        ),
        ("performed", "recorded", "rehearsed", "improvised on", "released", "sang"),
        (
            "a new symphony",
            "their latest album",
            "an old folk song",
            "the slow ballad",
            "a piano concerto",
            "the opening melody",
        ),
    ),
    "science": (
        (
            "The physicist",
            "A team of biologists",
            "The chemist",
            "The astronomer",
            "Our laboratory",
            "The geologist",
        ),
        (
            "measured",
            "discovered",
            "published a study on",
            "analysed",
            "observed",
            "tested a theory about",
        ),
        (
            "the decay of the isotope",
            "a new species of bacteria",
            "the orbit of the comet",
            "the molecule's structure",
            "the magnetic field",
            "the ancient rock samples",
        ),
    ),
    "politics": (
        (
            "The senator",
            "The prime minister",
            "The opposition party",
            "The parliament",
            "The mayor",
            "The governor",
        ),
        ("voted against", "announced", "debated", "vetoed", "campaigned for", "signed"),
        (
            "the new tax bill",
            "the election reform",
            "the budget proposal",
            "a trade agreement",
            "the immigration law",
            "the coalition deal",
        ),
    ),
    "travel": (
        (
            "The tourists",
            "Our flight",
            "The backpacker",
            "The cruise ship",
            "My family",
            "The tour guide",
        ),
        (
            "departed for",
            "explored",
            "booked a hotel in",
            "arrived late in",
            "hiked through",
            "took a train to",
        ),
        (
            "the old harbour town",
            "the desert oasis",
            "the capital's museums",
            "a quiet beach resort",
            "the alpine villages",
            "the famous temples",
        ),
    ),
    "health": (
        ("The doctor", "The nurse", "My dentist", "The patient", "The surgeon", "The pharmacist"),
        ("prescribed", "treated", "recommended", "examined", "operated on", "monitored"),
        (
            "the fever with antibiotics",
            "a daily vitamin",
            "the broken wrist",
            "the high blood pressure",
            "the infected tooth",
            "the flu symptoms",
        ),
    ),
}
LABEL_KINDS = ("names", "letters")


@dataclasses.dataclass(frozen=True)
class TopicTask:
    """A classification task over some of the topics.

    Attributes:
        topics: the classes, names from ``TOPICS``, in class order.
        labels: ``"names"`` (" sports", ...) or ``"letters"`` (" A", " B", ...).
    """

    topics: tuple[str, ...] = ("sports", "food", "weather", "music")
    labels: str = "letters"

    def __post_init__(self):
        unknown = [t for t in self.topics if t not in TOPICS]
        if unknown or len(set(self.topics)) != len(self.topics) or len(self.topics) < 2:
            raise ValueError(
                f"topics must be at least two distinct names from {sorted(TOPICS)}, got "
                f"{self.topics!r}"
            )
        if self.labels not in LABEL_KINDS:
            raise ValueError(f"labels must be one of {LABEL_KINDS}, got {self.labels!r}")

    @property
    def num_classes(self) -> int:
        return len(self.topics)

    def label_texts(self) -> tuple[str, ...]:
        """Each class's label, with its leading space (it follows a colon)."""
        if self.labels == "names":
            return tuple(f" {topic}" for topic in self.topics)
        return tuple(f" {chr(ord('A') + i)}" for i in range(self.num_classes))

    def prompt_input(self, text: str) -> str:
        """A demonstration's input, ``Text: <sentence>\\nTopic`` (the label follows a colon)."""
        return f"Text: {text}\nTopic"

    def sentence(self, rng: np.random.Generator, label: int) -> str:
        subjects, predicates, complements = TOPICS[self.topics[label]]
        parts = [part[int(rng.integers(len(part)))] for part in (subjects, predicates, complements)]
        return " ".join(parts) + "."

    def sample(self, rng: np.random.Generator, count: int) -> tuple[list[str], np.ndarray]:
        """``count`` sentences, classes balanced and shuffled, and their classes."""
        classes = rng.permutation(np.arange(count) % self.num_classes)
        return [self.sentence(rng, int(c)) for c in classes], classes
