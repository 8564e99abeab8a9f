"""Iterative Vectors (Liu & Deng, ICML 2025): vectors added to the attention output of
every layer at the input-label separators of an in-context classification prompt,
extracted from the model itself with no gradients.

A prompt is demonstrations ``input SEP label`` joined by a block separator, then the
query ``input SEP``; the *separators* (io positions) are the SEP tokens. Per episode
of extraction (``extract``):

1. ``ext_shot`` demonstrations per class (shuffled) and a query with its label;
2. a positive pass over that prompt with the current vectors added (scaled by
   ``ext_strength``): each demonstration's class vector at its separator, the query
   vector at the query's; the attention outputs at every separator are read;
3. a negative pass over the query alone, zero-shot and unedited, read at its
   separator (``negative_shift=1``, the released code, reads one token earlier);
4. the differences positive - negative, averaged per class over the demonstrations,
   plus the query's own: ``[C + 1, L, D]``;
5. after the first episode, every ``ext_batch`` episodes and at the end, the vectors
   become the mean of all episodes' differences so far.

At inference (``predict``) a few-shot prompt gets ``strength`` x the class vectors at
its demonstrations' separators and the query vector at the query's; the prediction is
the label whose first token has the highest logit there. Hyperparameters (``ext_shot``,
``strength``, ``ext_strength``) are chosen on validation episodes by macro-F1
(``grid_search``). ``TaskVectors`` is the baseline of the released code: the residual
stream at the query separator averaged over few-shot prompts, replacing the residual
there at the layer best on validation.

Episodes within a batch of ``ext_batch`` use the same vectors, so they run as one
batched pass (the released code runs them one by one; the result is the same).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from lhc.icl.activations import edit_at, read_activations
from lhc.icl.scoring import pad_rows


@dataclasses.dataclass(frozen=True)
class Format:
    """How a classification prompt is laid out in tokens.

    Attributes:
        labels: per class, the label's token ids (first tokens must differ).
        separator: the token between input and label (its position is where vectors go).
        block: the tokens between demonstrations.
    """

    labels: tuple[tuple[int, ...], ...]
    separator: int
    block: tuple[int, ...]

    def __post_init__(self):
        firsts = [label[0] for label in self.labels]
        if len(set(firsts)) != len(firsts):
            raise ValueError(f"the labels' first tokens must differ, got {firsts}")

    @property
    def num_classes(self) -> int:
        return len(self.labels)


@dataclasses.dataclass
class Prompt:
    """Token ids and the separators (io positions): one per demonstration, then the
    query's (the last)."""

    tokens: np.ndarray
    separators: np.ndarray


def build_prompt(fmt: Format, support, query_input, query_label: int | None = None) -> Prompt:
    """``support``: ``(input tokens, class)`` pairs in prompt order; the query's label is
    appended when given (extraction reads its separator, which comes before it)."""
    tokens, separators = [], []
    for inputs, label in support:
        tokens += list(inputs)
        separators.append(len(tokens))
        tokens += [fmt.separator, *fmt.labels[label], *fmt.block]
    tokens += list(query_input)
    separators.append(len(tokens))
    tokens.append(fmt.separator)
    if query_label is not None:
        tokens += list(fmt.labels[query_label])
    return Prompt(np.asarray(tokens, np.int32), np.asarray(separators, np.int32))


class Examples:
    """Labelled inputs to sample episodes from: ``inputs`` (token id lists) and
    ``labels`` (class per input)."""

    def __init__(self, inputs: Sequence[Sequence[int]], labels: Sequence[int], num_classes: int):
        self.inputs = [np.asarray(x, np.int32) for x in inputs]
        self.labels = np.asarray(labels)
        if len(self.inputs) != len(self.labels):
            raise ValueError(f"{len(self.inputs)} inputs but {len(self.labels)} labels")
        self.by_class = [np.flatnonzero(self.labels == c) for c in range(num_classes)]
        short = [c for c, rows in enumerate(self.by_class) if len(rows) < 2]
        if short:
            raise ValueError(f"classes {short} have fewer than 2 examples")

    def episode(self, rng: np.random.Generator, shots: int, query_class: int | None = None):
        """``shots`` examples per class (shuffled) and a query from another row."""
        picks = [rng.choice(rows, shots, replace=False) for rows in self.by_class]
        support = [(int(i), c) for c, rows in enumerate(picks) for i in rows]
        support = [support[i] for i in rng.permutation(len(support))]
        used = {i for i, _ in support}
        query_class = int(rng.integers(len(self.by_class))) if query_class is None else query_class
        candidates = [i for i in self.by_class[query_class] if i not in used]
        query = int(rng.choice(candidates))
        return [(self.inputs[i], c) for i, c in support], (self.inputs[query], query_class)


def _pad(prompts: Sequence[Prompt], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts' tokens right-padded (``pad_rows``) and their lengths."""
    return pad_rows([p.tokens for p in prompts], max_len), np.array(
        [len(p.tokens) for p in prompts]
    )


def _vector_values(vectors: np.ndarray, classes: np.ndarray, strength: float) -> np.ndarray:
    """``[L, B, K, D]``: per row, the class vector of each demonstration and the query
    vector last (``vectors`` ``[C + 1, L, D]``, ``classes`` ``[B, K - 1]``)."""
    batch = classes.shape[0]
    query = np.full((batch, 1), vectors.shape[0] - 1)
    picked = vectors[np.concatenate([classes, query], axis=1)]  # [B, K, L, D]
    return strength * np.transpose(picked, (2, 0, 1, 3))


def _edited(model, width, prompts, classes, vectors, strength):
    if vectors is None or strength == 0:
        return None
    at = np.stack([p.separators for p in prompts])
    values = _vector_values(vectors, classes, strength)
    return edit_at(model.config.num_layers, width, at, values, per_layer=True, site="attention")


@dataclasses.dataclass
class ExtractConfig:
    """``ext_shot`` demonstrations per class, ``ext_strength``, ``episodes`` (200 in the
    paper's code), ``ext_batch`` (10), ``negative_shift`` (1 as released: the zero-shot
    read is one token before the separator; 0 reads at it), ``seed``."""

    ext_shot: int = 1
    ext_strength: float = 0.5
    episodes: int = 200
    ext_batch: int = 10
    negative_shift: int = 1
    seed: int = 0


def episode_differences(model, params, fmt: Format, episodes, vectors, config: ExtractConfig):
    """``[E, C + 1, L, D]``: each episode's per-class (and query) mean differences.

    ``episodes``: ``(support, (query input, query class))`` pairs, all with the same
    number of demonstrations; ``vectors``: ``[C + 1, L, D]`` or ``None``.
    """
    max_len = model.config.max_len
    positive = [build_prompt(fmt, s, q[0], q[1]) for s, q in episodes]
    classes = np.array([[c for _, c in s] for s, _ in episodes])
    tokens, lengths = _pad(positive, max_len)
    at = np.stack([p.separators for p in positive])
    edit = _edited(model, tokens.shape[1], positive, classes, vectors, config.ext_strength)
    pos, _ = read_activations(
        model, params, tokens, at, site="attention", lengths=lengths, intervention=edit
    )
    negative = [build_prompt(fmt, [], q[0], q[1]) for _, q in episodes]
    neg_tokens, neg_lengths = _pad(negative, max_len)
    neg_at = np.stack([p.separators for p in negative]) - config.negative_shift
    neg, _ = read_activations(
        model, params, neg_tokens, neg_at, site="attention", lengths=neg_lengths
    )
    diff = np.asarray(pos, np.float64) - np.asarray(neg, np.float64)  # [L, B, K, D]
    diff = np.transpose(diff, (1, 2, 0, 3))  # [B, K, L, D]
    out = np.zeros((len(episodes), fmt.num_classes + 1, *diff.shape[2:]))
    for c in range(fmt.num_classes):
        mask = classes == c
        out[:, c] = (diff[:, :-1] * mask[..., None, None]).sum(1) / mask.sum(1)[:, None, None]
    out[:, -1] = diff[:, -1]
    return out


def extract(model, params, fmt: Format, train: Examples, config: ExtractConfig) -> np.ndarray:
    """Iterative Vectors ``[C + 1, L, D]`` (class vectors, then the query vector)."""
    if config.episodes < 1 or config.ext_batch < 1 or config.ext_shot < 1:
        raise ValueError(f"episodes, ext_batch and ext_shot must be >= 1, got {config}")
    rng = np.random.default_rng(config.seed)
    vectors, collected = None, []
    # Updates after episode 0, after every ext_batch-th episode, and after the last.
    updates = sorted(
        {0, *range(config.ext_batch, config.episodes, config.ext_batch), config.episodes - 1}
    )
    start = 0
    for stop in updates:
        episodes = [train.episode(rng, config.ext_shot) for _ in range(start, stop + 1)]
        collected.append(episode_differences(model, params, fmt, episodes, vectors, config))
        vectors = np.concatenate(collected).mean(0)
        start = stop + 1
    return vectors


def predict(
    model,
    params,
    fmt: Format,
    episodes,
    vectors=None,
    strength: float = 0.0,
    patch=None,
    batch_size: int = 64,
) -> np.ndarray:
    """The predicted class of each episode's query: argmax over the labels' first tokens
    of the logits at the query's separator, with ``strength`` x ``vectors`` added (or
    ``patch(width, prompts) -> Intervention`` applied), in batches."""
    label_tokens = jnp.asarray([label[0] for label in fmt.labels])
    out = []
    for start in range(0, len(episodes), batch_size):
        group = episodes[start : start + batch_size]
        prompts = [build_prompt(fmt, s, q[0]) for s, q in group]
        classes = np.array([[c for _, c in s] for s, _ in group])
        tokens, lengths = _pad(prompts, model.config.max_len)
        if patch is not None:
            edit = patch(tokens.shape[1], prompts)
        else:
            edit = _edited(model, tokens.shape[1], prompts, classes, vectors, strength)
        query_at = np.array([[p.separators[-1]] for p in prompts])
        _, logits = read_activations(
            model, params, tokens, query_at, site="residual", lengths=lengths, intervention=edit
        )
        out.append(np.asarray(jnp.argmax(logits[:, 0][:, label_tokens], axis=-1)))
    return np.concatenate(out)


def macro_f1(predicted, true, num_classes: int) -> float:
    """The mean over classes of F1 = 2 TP / (2 TP + FP + FN); a class with no true
    positive scores 0 (scikit-learn's ``f1_score(average="macro")``)."""
    predicted, true = np.asarray(predicted), np.asarray(true)
    scores = []
    for c in range(num_classes):
        tp = np.sum((predicted == c) & (true == c))
        fp = np.sum((predicted == c) & (true != c))
        fn = np.sum((predicted != c) & (true == c))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


def evaluation_episodes(examples: Examples, shots: int, count: int, seed: int):
    rng = np.random.default_rng(seed)
    return [examples.episode(rng, shots) for _ in range(count)]


def grid_search(
    model,
    params,
    fmt: Format,
    train: Examples,
    validation,
    *,
    ext_shots=(1, 2, 3, 4),
    strengths=(0.1, 0.3, 0.5, 0.7, 0.9),
    ext_strengths=(0.1, 0.3, 0.5, 0.7, 0.9),
    episodes: int = 200,
    ext_batch: int = 10,
    negative_shift: int = 1,
    seed: int = 0,
) -> tuple[dict, list[dict]]:
    """Every (ext_shot, ext_strength) extraction, each evaluated at every strength on
    the ``validation`` episodes; returns the best setting (by macro-F1, with its
    vectors) and every row."""
    true = np.array([q[1] for _, q in validation])
    rows, best = [], None
    for ext_shot, ext_strength in itertools.product(ext_shots, ext_strengths):
        config = ExtractConfig(ext_shot, ext_strength, episodes, ext_batch, negative_shift, seed)
        vectors = extract(model, params, fmt, train, config)
        for strength in strengths:
            predicted = predict(model, params, fmt, validation, vectors, strength)
            row = dict(
                ext_shot=ext_shot,
                ext_strength=ext_strength,
                strength=strength,
                macro_f1=macro_f1(predicted, true, fmt.num_classes),
            )
            rows.append(row)
            if best is None or row["macro_f1"] > best["macro_f1"]:
                best = dict(row, vectors=vectors)
    return best, rows


@dataclasses.dataclass
class TaskVectors:
    """The Task Vectors baseline: ``vectors`` ``[L, D]`` and the chosen ``layer``."""

    vectors: np.ndarray
    layer: int = 0

    @classmethod
    def extract(
        cls,
        model,
        params,
        fmt: Format,
        train: Examples,
        shots: int,
        episodes: int,
        seed: int = 0,
        batch_size: int = 64,
    ) -> TaskVectors:
        """The residual stream at the query's separator, mean over ``episodes``
        few-shot prompts of ``shots`` demonstrations per class."""
        rng = np.random.default_rng(seed)
        sums = None
        for start in range(0, episodes, batch_size):
            group = [train.episode(rng, shots) for _ in range(min(batch_size, episodes - start))]
            prompts = [build_prompt(fmt, s, q[0]) for s, q in group]
            tokens, lengths = _pad(prompts, model.config.max_len)
            at = np.array([[p.separators[-1]] for p in prompts])
            acts, _ = read_activations(model, params, tokens, at, lengths=lengths)
            total = np.asarray(acts, np.float64)[:, :, 0].sum(1)
            sums = total if sums is None else sums + total
        return cls(sums / episodes)

    def patch(self, model, layer: int | None = None):
        """``predict``'s ``patch``: replace the residual at the query's separator."""
        layer = self.layer if layer is None else layer

        def make(width, prompts):
            at = np.array([[p.separators[-1]] for p in prompts])
            return edit_at(
                model.config.num_layers,
                width,
                at,
                self.vectors[layer][None],
                layers=[layer],
                per_layer=True,
                mode="replace",
            )

        return make

    def choose_layer(self, model, params, fmt: Format, validation) -> list[float]:
        """Sets ``layer`` to the best by macro-F1 on ``validation``; the F1 per layer."""
        true = np.array([q[1] for _, q in validation])
        scores = []
        for layer in range(model.config.num_layers):
            predicted = predict(model, params, fmt, validation, patch=self.patch(model, layer))
            scores.append(macro_f1(predicted, true, fmt.num_classes))
        self.layer = int(np.argmax(scores))
        return scores
