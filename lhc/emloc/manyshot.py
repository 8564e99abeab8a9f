"""Many-shot in-context classification, generated: EMLoC's experiment in miniature.

Every sequence is a new episode: ``classes`` classes, each with a label drawn from the
capital letters and, for ``modality="text"``, ``keywords`` lower-case letters of its
own, or, for ``modality="image"``, a random binary ``image_size`` x ``image_size``
prototype. An input is ``input_length`` tokens drawn from its class's keywords (each
replaced by any lower-case letter with probability ``noise``), or an image: its class's
prototype with every pixel flipped with probability ``noise``, plus Gaussian noise of
standard deviation ``pixel_noise``, cut into ``patch`` x ``patch`` patches. A
demonstration is the input, the label and a newline (byte tokens: the label follows
the input directly, so that the last input token, which names the class, is what a
query's answer is read against); an image input is one placeholder token per patch, whose input embedding a small patch encoder
computes (``PatchLM``). Which letter names which class, and which keywords or prototype
it has, is only in the context: the model must learn it there.

``lhc.emloc.task.ManyShotTask`` trains a model on sequences of ``shots`` demonstrations, with the loss
on every label (from the second demonstration of a class on, only the context can tell
it). ``episode`` makes evaluation episodes: demonstrations and held-out queries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc import lm
from lhc.emloc.examples import Example
from lhc.nn.config import register_model
from lhc.nn.linear import dense

NEWLINE = ord("\n")
LABELS = np.arange(ord("A"), ord("Z") + 1)
WORDS = np.arange(ord("a"), ord("z") + 1)
IMAGE_TOKEN = 259  # after the 256 bytes and ByteTokenizer's three special ids
VOCAB_SIZE = 260


@dataclasses.dataclass(frozen=True)
class ManyShot:
    """The episode distribution (see the module docstring)."""

    modality: str = "text"
    classes: int = 5
    keywords: int = 3
    input_length: int = 4
    noise: float = 0.2
    image_size: int = 8
    patch: int = 4
    pixel_noise: float = 0.3

    def __post_init__(self):
        if self.modality not in ("text", "image"):
            raise ValueError(f"modality must be 'text' or 'image', got {self.modality!r}")
        if not 2 <= self.classes <= len(LABELS):
            raise ValueError(f"classes must be in [2, {len(LABELS)}], got {self.classes}")
        if self.modality == "text" and self.classes * self.keywords > len(WORDS):
            raise ValueError(
                f"classes x keywords = {self.classes * self.keywords} exceeds the "
                f"{len(WORDS)} lower-case letters"
            )
        if self.image_size % self.patch:
            raise ValueError(f"patch {self.patch} must divide image_size {self.image_size}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {self.noise}")

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def feature_dim(self) -> int:
        """Per image token: the patch's pixels and a one-hot of its index."""
        return self.patch * self.patch + self.patches

    @property
    def demo_length(self) -> int:
        body = self.input_length if self.modality == "text" else self.patches
        return body + 2


@dataclasses.dataclass
class Episode:
    """Demonstrations and queries of one episode."""

    demonstrations: list[Example]
    queries: list[Example]  # inputs; the answer is the next token
    answers: np.ndarray  # int [Q], the label token of each query
    features: list[np.ndarray]  # per demonstration, then per query: [n, feature_dim]


def _class_draws(rng: np.random.Generator, task: ManyShot) -> dict[str, Any]:
    labels = rng.choice(LABELS, task.classes, replace=False)
    if task.modality == "text":
        words = rng.choice(WORDS, task.classes * task.keywords, replace=False)
        return dict(labels=labels, keywords=words.reshape(task.classes, task.keywords))
    shape = (task.classes, task.image_size, task.image_size)
    return dict(labels=labels, prototypes=rng.random(shape) < 0.5)


def _input(rng: np.random.Generator, task: ManyShot, draws, label: int):
    """Tokens ``[n]`` and features ``[n, feature_dim]`` of one input of class ``label``."""
    if task.modality == "text":
        tokens = rng.choice(draws["keywords"][label], task.input_length)
        noisy = rng.random(task.input_length) < task.noise
        tokens = np.where(noisy, rng.choice(WORDS, task.input_length), tokens)
        return tokens.astype(np.int32), np.zeros((task.input_length, task.feature_dim), np.float32)
    image = draws["prototypes"][label] ^ (rng.random(draws["prototypes"][label].shape) < task.noise)
    image = image.astype(np.float32) * 2 - 1 + task.pixel_noise * rng.normal(size=image.shape)
    side, p = task.image_size // task.patch, task.patch
    patches = image.reshape(side, p, side, p).transpose(0, 2, 1, 3).reshape(task.patches, p * p)
    features = np.concatenate([patches, np.eye(task.patches)], axis=1).astype(np.float32)
    return np.full(task.patches, IMAGE_TOKEN, np.int32), features


def _demonstration(rng, task, draws, label):
    tokens, features = _input(rng, task, draws, label)
    tokens = np.concatenate([tokens, [draws["labels"][label], NEWLINE]]).astype(np.int32)
    features = np.concatenate([features, np.zeros((2, task.feature_dim), np.float32)])
    answer = np.zeros(tokens.size, bool)
    answer[-2] = True
    return tokens, answer, features


def training_row(
    rng: np.random.Generator, task: ManyShot, shots: int, min_shots: int | None = None
) -> dict[str, np.ndarray]:
    """One training sequence of ``shots`` demonstrations: ``tokens``, ``targets``,
    ``weights`` (1 on the labels) and ``features``, each with a leading axis of 1.

    With ``min_shots``, the sequence holds a number of demonstrations uniform in
    [``min_shots``, ``shots``], right-padded (token 0, weight 0) to the length of
    ``shots``: short episodes, where attention has few places to look, teach the
    matching early; long ones teach it at the lengths of evaluation.
    """
    draws = _class_draws(rng, task)
    count = shots if min_shots is None else int(rng.integers(min_shots, shots + 1))
    parts = [_demonstration(rng, task, draws, rng.integers(task.classes)) for _ in range(count)]
    pad = (shots - count) * task.demo_length
    tokens = np.concatenate([p[0] for p in parts] + [np.zeros(pad, np.int32)])
    answer = np.concatenate([p[1] for p in parts] + [np.zeros(pad, bool)])
    features = np.concatenate(
        [p[2] for p in parts] + [np.zeros((pad, task.feature_dim), np.float32)]
    )
    return {
        "tokens": tokens[None, :-1],
        "targets": tokens[None, 1:],
        "weights": answer[None, 1:].astype(np.float32),
        "features": features[None, :-1],
    }


def episode(rng: np.random.Generator, task: ManyShot, shots: int, queries: int) -> Episode:
    """``shots`` demonstrations (classes balanced, shuffled) and ``queries`` queries."""
    draws = _class_draws(rng, task)
    labels = rng.permutation(np.arange(shots) % task.classes)
    demonstrations, features = [], []
    for label in labels:
        tokens, answer, feats = _demonstration(rng, task, draws, label)
        demonstrations.append(Example(tokens, answer))
        features.append(feats)
    query_list, answers = [], []
    for label in rng.integers(task.classes, size=queries):
        tokens, feats = _input(rng, task, draws, label)
        query_list.append(Example(tokens, np.zeros(tokens.size, bool)))
        features.append(feats)
        answers.append(draws["labels"][label])
    return Episode(demonstrations, query_list, np.asarray(answers, np.int32), features)


def text_episode(
    rng: np.random.Generator,
    tokenizer,
    task,
    shots: int,
    queries: int,
    query_task=None,
) -> tuple[list[Example], list[Example], np.ndarray]:
    """Text classification in a pretrained model's tokens: ``shots`` demonstrations
    ``<input>: <label>\n\n`` (``task.prompt_input``; classes balanced, shuffled; the
    answer is the label's first token), ``queries`` queries ``<input>:`` and their
    answers, the label's first token.

    Args:
        task: a task with ``sample``, ``label_texts`` and ``prompt_input``
            (``lhc.data.word_tasks.WordTask``, ``lhc.data.topics.TopicTask``).
        query_task: where the queries come from (default: ``task``; e.g. the test part
            of a ``WordTask`` whose train part gives the demonstrations).

    Raises:
        ValueError: two labels that start with the same token.
    """
    labels = [tokenizer.encode(label) for label in task.label_texts()]
    firsts = [label[0] for label in labels]
    if len(set(firsts)) != len(firsts):
        raise ValueError(f"the labels {task.label_texts()} must start with different tokens")
    newline = tokenizer.encode("\n\n")
    texts, classes = task.sample(rng, shots)
    demonstrations = []
    for text, label in zip(texts, classes):
        prompt = tokenizer.encode(f"{task.prompt_input(text)}:")
        tokens = np.asarray([*prompt, *labels[label], *newline], np.int32)
        answer = np.zeros(tokens.size, bool)
        answer[len(prompt)] = True
        demonstrations.append(Example(tokens, answer))
    texts, classes = (query_task or task).sample(rng, queries)
    query_list = []
    for text in texts:
        tokens = np.asarray(tokenizer.encode(f"{task.prompt_input(text)}:"), np.int32)
        query_list.append(Example(tokens, np.zeros(tokens.size, bool)))
    return demonstrations, query_list, np.asarray([firsts[c] for c in classes], np.int32)


class PatchEncoder(nn.Module):
    """Patch pixels (and the patch's index, one-hot) to input embeddings: two dense
    layers with a GELU between."""

    embed_dim: int

    @nn.compact
    def __call__(self, features: jax.Array) -> jax.Array:
        hidden = nn.gelu(dense(self.embed_dim, ("patch", "mlp"), "in")(features))
        return dense(self.embed_dim, ("mlp", "embed"), "out")(hidden)


@register_model("emloc_patch_lm", lm.LMConfig)
class PatchLM(nn.Module):
    """An ``lhc.lm.Transformer`` (``lm``) whose image placeholder tokens take their input
    embeddings from a ``PatchEncoder`` (``encoder``) of per-token ``features``.

    Called like the Transformer (the causal-LM protocol), plus ``features`` ``[B, T, F]``;
    without them it is the plain Transformer (text only).
    """

    config: lm.LMConfig
    image_token: int = IMAGE_TOKEN

    def setup(self):
        self.lm = lm.Transformer(self.config)
        self.encoder = PatchEncoder(self.config.embed_dim)

    @nn.nowrap
    def init_cache(self, batch_size: int, max_len: int):
        return lm.Transformer(self.config).init_cache(batch_size, max_len)

    def embed_features(self, features: jax.Array) -> jax.Array:
        return self.encoder(features)

    def __call__(self, tokens, positions, cache=None, *, features=None, **kwargs):
        if features is None:
            return self.lm(tokens, positions, cache, **kwargs)
        return self.lm(
            tokens,
            positions,
            cache,
            embeddings=self.encoder(features),
            embedding_mask=tokens == self.image_token,
            **kwargs,
        )


def with_embeddings(model: PatchLM, params, examples: list[Example], features) -> list[Example]:
    """``examples`` with their image tokens' input embeddings from the trained encoder."""
    out = []
    for example, feats in zip(examples, features):
        embedded = np.asarray(example.tokens) == model.image_token
        if not embedded.any():
            out.append(example)
            continue
        embeddings = model.apply(
            {"params": params}, jnp.asarray(feats), method=PatchLM.embed_features
        )
        out.append(Example(example.tokens, example.answer, np.asarray(embeddings), embedded))
    return out
