"""Generated in-context classification in the prompt format of Iterative Vectors.

A task has ``classes`` classes; each class owns ``keywords`` upper-case letters and a
label word (five lower-case letters, first letters all different), so inputs and labels
are different tokens. An input is ``input_length`` letters, each one of its class's
keywords, or with probability ``noise`` any upper-case letter. A demonstration is
``input\\nlabel``, demonstrations are joined by ``\\n\\n\\n`` and the query is ``input\\n``
(the released code's layout; byte tokens).

``lhc.icl.task.PretrainTask`` trains a decoder on prompts that each draw a new task (2 to
``max_classes`` classes, 1 to ``max_shots`` demonstrations per class, shuffled, then a
query of a random class), the loss on the label words: in-context classification in
general, optionally through a curriculum of easier prompts first. ``fixed_task`` draws
one task from a seed and ``split`` its labelled inputs, the analogue of a dataset's
train, validation and test splits for the Iterative Vectors experiment.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lhc.icl.iterative import Examples, Format, build_prompt

LABEL_WORDS = (
    "apple",
    "bread",
    "chair",
    "dance",
    "eagle",
    "flame",
    "grape",
    "house",
    "igloo",
    "juice",
    "knife",
    "lemon",
    "mango",
    "noble",
    "ocean",
    "piano",
    "queen",
    "river",
    "stone",
    "tiger",
    "uncle",
    "vivid",
    "whale",
    "xenon",
    "yacht",
    "zebra",
)
LETTERS = np.arange(ord("A"), ord("Z") + 1, dtype=np.int32)  # of the inputs
SEPARATOR = ord("\n")
BLOCK = (ord("\n"),) * 3


@dataclasses.dataclass(frozen=True)
class ClassificationTask:
    """One classification task: per class its keywords ``[C, keywords]`` and label."""

    keywords: np.ndarray
    labels: tuple[str, ...]
    input_length: int = 4
    noise: float = 0.2

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def format(self) -> Format:
        return Format(tuple(tuple(w.encode()) for w in self.labels), SEPARATOR, BLOCK)

    def sample(self, rng: np.random.Generator, label: int) -> np.ndarray:
        tokens = rng.choice(self.keywords[label], self.input_length)
        noisy = rng.random(self.input_length) < self.noise
        return np.where(noisy, rng.choice(LETTERS, self.input_length), tokens).astype(np.int32)


def random_task(rng, classes: int, keywords: int = 2, input_length: int = 4, noise: float = 0.2):
    """A task with fresh keywords (disjoint between classes) and label words."""
    if not 2 <= classes <= len(LABEL_WORDS) or classes * keywords > len(LETTERS):
        raise ValueError(f"classes {classes} x keywords {keywords} do not fit the alphabet")
    words = rng.choice(LETTERS, classes * keywords, replace=False).reshape(classes, keywords)
    labels = tuple(LABEL_WORDS[i] for i in rng.choice(len(LABEL_WORDS), classes, replace=False))
    return ClassificationTask(words, labels, input_length, noise)


def fixed_task(seed: int, classes: int = 4, **kwargs) -> ClassificationTask:
    return random_task(np.random.default_rng(seed), classes, **kwargs)


def split(task: ClassificationTask, count: int, seed: int) -> Examples:
    """``count`` labelled inputs (classes balanced, drawn with ``seed``)."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % task.num_classes
    return Examples([task.sample(rng, c) for c in labels], labels, task.num_classes)


# Natural-language tasks for pretrained models (``lhc.data.topics.TopicTask``,
# ``lhc.data.word_tasks.WordTask``): "<input>: <label>\n\n" per demonstration, e.g.
# "Text: <sentence>\nTopic: A\n\n".


def text_format(tokenizer, task) -> Format:
    """The Iterative Vectors layout of a natural-language ``task`` in a pretrained
    model's tokens: the input (``task.prompt_input``), the separator ``:``, the label
    (``task.label_texts()``), demonstrations joined by a blank line, after the BOS
    token when the tokenizer adds one.

    Raises:
        ValueError: ``:`` is not one token of ``tokenizer``, or two labels start with
            the same token.
    """
    separator = tokenizer.encode(":")
    if len(separator) != 1:
        raise ValueError(f"the separator ':' must be one token, got {separator}")
    labels = tuple(tuple(tokenizer.encode(label)) for label in task.label_texts())
    adds_bos = getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_id is not None
    bos = (tokenizer.bos_id,) if adds_bos else ()
    return Format(labels, separator[0], tuple(tokenizer.encode("\n\n")), prefix=bos)


def text_split(tokenizer, task, count: int, seed: int) -> Examples:
    """``count`` labelled inputs of ``task`` (classes balanced) as input tokens."""
    texts, classes = task.sample(np.random.default_rng(seed), count)
    inputs = [tokenizer.encode(task.prompt_input(text)) for text in texts]
    return Examples(inputs, classes, task.num_classes)


def training_row(
    rng, max_classes: int, max_shots: int, width: int, separator: bool | float = True, **task_kwargs
):
    """One pretraining prompt, right-padded to ``width``: ``tokens``, ``targets``,
    ``weights`` (1 on the label words), each ``[1, width - 1]``. Without ``separator``
    the labels follow their inputs directly (``input label``), the easier prompts that
    a curriculum (``lhc.icl.task.PretrainTask``'s ``stages``) starts from; a ``separator`` strictly
    between 0 and 1 is the probability of the separator in this prompt."""
    if not 0 <= float(separator) <= 1:
        raise ValueError(f"separator must be a bool or a probability in [0, 1], got {separator}")
    if 0 < float(separator) < 1:
        separator = bool(rng.random() < float(separator))
    task = random_task(rng, int(rng.integers(2, max_classes + 1)), **task_kwargs)
    shots = int(rng.integers(1, max_shots + 1))
    classes = rng.permutation(np.repeat(np.arange(task.num_classes), shots))
    fmt = task.format()
    # The layout of the test episodes: every class shown, then a query of any class (so
    # the query's label is always in the context).
    support = [(task.sample(rng, c), int(c)) for c in classes]
    query = int(rng.integers(task.num_classes))
    prompt = build_prompt(fmt, support, task.sample(rng, query), query)
    tokens, starts = prompt.tokens, prompt.separators + 1
    if not separator:  # each separator out, the tokens after it one place earlier
        tokens = np.delete(tokens, prompt.separators)
        starts = prompt.separators - np.arange(len(prompt.separators))
    if len(tokens) > width:
        raise ValueError(f"a prompt of {len(tokens)} tokens exceeds width {width}")
    weights = np.zeros(width, np.float32)
    for start in starts:
        weights[start : start + len(fmt.labels[0])] = 1
    padded = np.zeros(width, np.int32)
    padded[: len(tokens)] = tokens
    return {"tokens": padded[None, :-1], "targets": padded[None, 1:], "weights": weights[None, 1:]}


def query_targets(targets: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a batch of ``training_row``: the index of the query's first label
    target (the start of the last weighted run) and the number of classes in the prompt
    (distinct first label tokens), from ``targets, weights: [B, T]``."""
    weights = np.asarray(weights) > 0
    starts = weights & ~np.pad(weights, ((0, 0), (1, 0)))[:, :-1]
    query = np.array([np.flatnonzero(row)[-1] for row in starts])
    classes = np.array([len(set(t[s].tolist())) for t, s in zip(np.asarray(targets), starts)])
    return query.astype(np.int32), classes.astype(np.float32)
