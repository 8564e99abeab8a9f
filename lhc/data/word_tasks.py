"""Text classification tasks for in-context learning with pretrained language models,
made from word lists written here (Iterative Vectors, task vectors).

A task is a set of inputs per class, the label text of each class and the prompt
template of an input; in a prompt a demonstration reads ``<template>: <label>``:

    Review: The concert was superb.
    Sentiment: A

What a pretrained model knows is what the inputs are about (sentiment, a word's
category, a sentence's topic, a word's letter case); what the prompt alone tells it is
which label names which class when the labels are arbitrary (letters, unrelated words)
or swapped (another class's name), which is where in-context learning has headroom.
``TASKS`` names them ``<inputs>-<labels>``:

* ``sentiment``: ``The <noun> was <adjective>.`` and two other frames, 16 nouns x 12
  positive or 12 negative adjectives x 3 frames (576 per class); labels ``letters``
  (" A" positive, " B" negative), ``words`` (" blue", " green") or ``flipped``
  (" negative" for the positive class);
* ``category``: single English words, 20 per class (animal, fruit, colour, vehicle);
  labels ``letters`` (" A".." D"), ``words`` (" river", " chair", " cloud", " piano") or
  ``names`` (" animal", ...: the control at the ceiling);
* ``case``: two-word phrases, a colour and an animal, fruit or vehicle (1,200), in
  lower case, upper case or title case; labels ``letters``;
* ``topic``: the generated sentences of ``lhc.data.topics``, as they are or ending
  "last week" or "this morning" (648 per topic; sports, food, weather, music); labels
  ``letters`` or ``swapped`` (each topic labelled with the next one's name).

Every class of the sentiment, case and topic tasks has at least 144 inputs in its test
quarter; the category tasks have 5.

    task = TASKS["category-letters"]
    texts, classes = task.sample(np.random.default_rng(0), 8)
    task.prompt_input(texts[0])    # 'Word: plum\\nCategory'
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools

import numpy as np

from lhc.data.topics import TOPICS

SENTIMENT_NOUNS = tuple(
    "movie meal hotel concert service book trip game album show restaurant museum flight "
    "course lecture party".split()
)
POSITIVE = tuple(
    "wonderful excellent delightful superb lovely fantastic great brilliant amazing "
    "enjoyable pleasant outstanding".split()
)
NEGATIVE = tuple(
    "terrible awful boring disappointing dreadful horrible bad dull mediocre unpleasant "
    "annoying miserable".split()
)
SENTIMENT_FRAMES = ("The {noun} was {adjective}.", "I thought the {noun} was {adjective}.",
                    "Honestly, the {noun} was {adjective}.")  # fmt: skip
# Appended to a topic sentence: they name no topic, and make 3 sentences of each.
TOPIC_TIMES = ("", " last week", " this morning")
CATEGORIES = {
    name: tuple(words.split())
    for name, words in {
        "animal": "dog cat horse lion tiger rabbit eagle whale snake wolf bear sheep goat "
        "monkey zebra camel deer fox owl duck",
        "fruit": "apple banana cherry grape lemon mango peach pear plum melon kiwi apricot "
        "lime papaya fig coconut pineapple strawberry raspberry blueberry",
        "colour": "red blue green yellow purple brown black white pink grey violet crimson "
        "beige maroon turquoise magenta navy scarlet cyan indigo",
        "vehicle": "car bus truck train bicycle boat plane tractor scooter tram ship van "
        "motorcycle helicopter taxi ambulance subway yacht jeep canoe",
    }.items()
}
LETTERS = tuple(f" {chr(ord('A') + i)}" for i in range(8))
WORD_LABELS = (" river", " chair", " cloud", " piano")
PARTS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class WordTask:
    """A classification task: ``inputs[c]`` are the texts of class ``c``.

    Attributes:
        name: ``<inputs>-<labels>``.
        inputs: per class, its input texts (at least two each).
        labels: per class, the label text with its leading space (it follows a colon).
        template: the prompt input, ``{text}`` filled with the input; the label follows
            it after a colon.
    """

    name: str
    inputs: tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]
    template: str

    def __post_init__(self):
        if len(self.inputs) != len(self.labels) or len(self.labels) < 2:
            raise ValueError(
                f"{self.name}: expected one label per class and at least two classes, got "
                f"{len(self.inputs)} classes and {len(self.labels)} labels"
            )
        if min(len(texts) for texts in self.inputs) < 2:
            raise ValueError(f"{self.name}: expected at least two inputs per class")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"{self.name}: expected distinct labels, got {self.labels}")

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def label_texts(self) -> tuple[str, ...]:
        return self.labels

    def prompt_input(self, text: str) -> str:
        return self.template.format(text=text)

    def part(self, which: str, seed: int) -> WordTask:
        """The task on one of three disjoint parts of every class's inputs, shuffled
        with ``seed``: ``"train"`` (the first half), ``"validation"`` (the next quarter)
        or ``"test"`` (the rest)."""
        if which not in PARTS:
            raise ValueError(f"which: expected one of {PARTS}, got {which!r}")
        index = PARTS.index(which)
        inputs = []
        for c, texts in enumerate(self.inputs):
            order = np.random.default_rng([seed, c]).permutation(len(texts))
            bounds = (0, len(texts) // 2, 3 * len(texts) // 4, len(texts))
            inputs.append(tuple(texts[i] for i in order[bounds[index] : bounds[index + 1]]))
        return dataclasses.replace(self, inputs=tuple(inputs))

    def sample(self, rng: np.random.Generator, count: int) -> tuple[list[str], np.ndarray]:
        """``count`` inputs, classes balanced and shuffled, and their classes; a class
        repeats an input only once all of its inputs are drawn."""
        classes = rng.permutation(np.arange(count) % self.num_classes)
        orders = [rng.permutation(len(texts)) for texts in self.inputs]
        drawn = np.zeros(self.num_classes, int)
        texts = []
        for c in classes:
            texts.append(self.inputs[c][orders[c][drawn[c] % len(orders[c])]])
            drawn[c] += 1
        return texts, classes


def _sentiment(labels: tuple[str, ...], name: str) -> WordTask:
    inputs = tuple(
        tuple(
            frame.format(noun=noun, adjective=adjective)
            for frame in SENTIMENT_FRAMES
            for noun in SENTIMENT_NOUNS
            for adjective in side
        )
        for side in (POSITIVE, NEGATIVE)
    )
    return WordTask(f"sentiment-{name}", inputs, labels, "Review: {text}\nSentiment")


def _category(labels: tuple[str, ...], name: str) -> WordTask:
    return WordTask(
        f"category-{name}", tuple(CATEGORIES.values()), labels, "Word: {text}\nCategory"
    )


def _case() -> WordTask:
    colours = CATEGORIES["colour"]
    things = [w for name, group in CATEGORIES.items() if name != "colour" for w in group]
    phrases = [f"{colour} {thing}" for colour in colours for thing in things]
    inputs = tuple(tuple(map(style, phrases)) for style in (str.lower, str.upper, str.title))
    return WordTask("case-letters", inputs, LETTERS[:3], "Words: {text}\nCase")


def _topic(labels: tuple[str, ...], name: str) -> WordTask:
    names = ("sports", "food", "weather", "music")
    inputs = tuple(
        tuple(
            " ".join(parts) + when + "."
            for when in TOPIC_TIMES
            for parts in itertools.product(*TOPICS[topic])
        )
        for topic in names
    )
    return WordTask(f"topic-{name}", inputs, labels, "Text: {text}\nTopic")


TASKS: dict[str, WordTask] = {
    task.name: task
    for task in (
        _sentiment(LETTERS[:2], "letters"),
        _sentiment((" blue", " green"), "words"),
        _sentiment((" negative", " positive"), "flipped"),
        _category(LETTERS[:4], "letters"),
        _category(WORD_LABELS, "words"),
        _category(tuple(f" {c}" for c in CATEGORIES), "names"),
        _case(),
        _topic(LETTERS[:4], "letters"),
        _topic((" food", " weather", " music", " sports"), "swapped"),
    )
}


def task(name: str) -> WordTask:
    """``TASKS[name]``, or ValueError naming the closest names."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=3, cutoff=0.3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"unknown word task {name!r}{hint} Known: {sorted(TASKS)}")
    return TASKS[name]
