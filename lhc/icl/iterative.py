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
import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lhc.icl.activations import edit_at, read_activations
from lhc.icl.config import ExtractConfig
from lhc.icl.scoring import pad_rows, padded_width
from lhc.lm.decoding import prefill_chunks
from lhc.lm.prompts import left_pad, left_padded_positions
from lhc.lm.rules import empty_cache
from lhc.nn.intervention import Edit, Intervention


@dataclasses.dataclass(frozen=True)
class Format:
    """How a classification prompt is laid out in tokens.

    Attributes:
        labels: per class, the label's token ids (first tokens must differ).
        separator: the token between input and label (its position is where vectors go).
        block: the tokens between demonstrations.
        prefix: the tokens every prompt starts with (a BOS token for a model trained
            with one, e.g. Gemma).
    """

    labels: tuple[tuple[int, ...], ...]
    separator: int
    block: tuple[int, ...]
    prefix: tuple[int, ...] = ()

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
    tokens, separators = list(fmt.prefix), []
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

    def episode(
        self,
        rng: np.random.Generator,
        shots: int,
        query_class: int | None = None,
        query: int | None = None,
    ):
        """``shots`` examples per class (shuffled) and a query from another row (the
        row ``query`` when given, its class then the query's)."""
        picks = [
            rng.choice(rows if query is None else rows[rows != query], shots, replace=False)
            for rows in self.by_class
        ]
        support = [(int(i), c) for c, rows in enumerate(picks) for i in rows]
        support = [support[i] for i in rng.permutation(len(support))]
        if query is not None:
            query_class = int(self.labels[query])
        else:
            used = {i for i, _ in support}
            if query_class is None:
                query_class = int(rng.integers(len(self.by_class)))
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
        model,
        params,
        tokens,
        at,
        site="attention",
        lengths=lengths,
        intervention=edit,
        logits=False,
    )
    negative = [build_prompt(fmt, [], q[0], q[1]) for _, q in episodes]
    neg_tokens, neg_lengths = _pad(negative, max_len)
    neg_at = np.stack([p.separators for p in negative]) - config.negative_shift
    neg, _ = read_activations(
        model, params, neg_tokens, neg_at, site="attention", lengths=neg_lengths, logits=False
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
    batch_size = min(batch_size, len(episodes))
    out = []
    for start in range(0, len(episodes), batch_size):
        # The last batch is filled up with its first episode: one shape, one program.
        group = [
            episodes[i if i < len(episodes) else start] for i in range(start, start + batch_size)
        ]
        prompts = [build_prompt(fmt, s, q[0]) for s, q in group]
        classes = np.array([[c for _, c in s] for s, _ in group])
        # Left-padded, so that every query separator is the last column: the logits of
        # that column only.
        width = padded_width(max(len(p.tokens) for p in prompts), model.config.max_len)
        tokens, lengths = left_pad([p.tokens for p in prompts], width=width)
        prompts = [Prompt(p.tokens, p.separators + width - n) for p, n in zip(prompts, lengths)]
        if patch is not None:
            edit = patch(width, prompts)
        else:
            edit = _edited(model, width, prompts, classes, vectors, strength)
        positions = left_padded_positions(lengths, width)
        logits = _last_logits(model, params, tokens, positions, edit, label_tokens)
        kept = min(batch_size, len(episodes) - start)
        out.append(np.asarray(jnp.argmax(logits, axis=-1))[:kept])
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(model, params, tokens, positions, intervention, labels):
    extra = {} if intervention is None else {"intervention": intervention}
    logits, _ = model.apply({"params": params}, tokens, positions, last_only=True, **extra)
    return logits[:, 0, labels]


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


def evaluation_episodes(examples: Examples, shots: int, count: int | None, seed):
    """``count`` episodes of ``examples`` drawn with ``seed``, or with ``count`` None one
    per input, each input the query once (in a shuffled order), so that every input is
    scored and two methods can be compared input by input."""
    rng = np.random.default_rng(seed)
    if count is None:
        order = rng.permutation(len(examples.inputs))
        return [examples.episode(rng, shots, query=int(i)) for i in order]
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
            acts, _ = read_activations(model, params, tokens, at, lengths=lengths, logits=False)
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

    def layer_logits(self, model, params, fmt: Format, episodes, layers=None) -> np.ndarray:
        """float32 ``[1 + K, E, C]``: ``separator_logits`` of the plain prompts, then
        with this patch at each of ``layers`` (default every layer)."""
        layers = range(model.config.num_layers) if layers is None else layers
        return separator_logits(model, params, fmt, episodes, self.vectors, layers)

    def choose_layer(self, model, params, fmt: Format, validation) -> list[float]:
        """Sets ``layer`` to the best by macro-F1 on ``validation``; the F1 per layer."""
        true = np.array([q[1] for _, q in validation])
        predicted = self.layer_logits(model, params, fmt, validation)[1:].argmax(-1)
        scores = [macro_f1(p, true, fmt.num_classes) for p in predicted]
        self.layer = int(np.argmax(scores))
        return scores


def separator_logits(
    model, params, fmt: Format, episodes, vectors=None, layers=(), batch_size: int = 64
) -> np.ndarray:
    """float32 ``[1 + K, E, C]``: the labels' first-token logits at each episode's query
    separator, of the plain prompt and then with the residual there replaced after each
    of ``layers`` by ``vectors[layer]`` (``vectors`` ``[L, D]``, Task Vectors' patch).

    The patch changes the residual at the separator, the prompt's last token, so the
    prompt before it is prefilled into a cache once per batch and only the separator
    runs again per layer: what ``predict`` with ``TaskVectors.patch`` computes for each
    layer, at the cost of about one prompt pass."""
    layers = jnp.asarray([-1, *layers], jnp.int32)  # -1: no patch
    if vectors is None:
        vectors = np.zeros((model.config.num_layers, model.config.embed_dim), np.float32)
    label_tokens = jnp.asarray([label[0] for label in fmt.labels])
    prompts = [build_prompt(fmt, s, q[0]).tokens for s, q in episodes]
    # The prompts but their separators; the cache keeps one slot more for it.
    width = padded_width(max(len(p) for p in prompts) - 1, model.config.max_len - 1)
    batch_size = min(batch_size, len(episodes))
    out = np.zeros((len(layers), len(episodes), fmt.num_classes), np.float32)
    for start in range(0, len(episodes), batch_size):
        # The last batch is filled up with its first prompt: one shape, one program.
        rows = [i if i < len(prompts) else start for i in range(start, start + batch_size)]
        tokens, lengths = left_pad([prompts[i][:-1] for i in rows], width=width)
        separators = np.array([prompts[i][-1] for i in rows], np.int32)
        logits = _patched_separator_logits(
            model,
            params,
            tokens,
            lengths,
            separators,
            jnp.asarray(vectors, jnp.float32),
            label_tokens,
            layers,
        )
        kept = min(batch_size, len(episodes) - start)
        out[:, start : start + kept] = np.asarray(logits)[:, :kept]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _patched_separator_logits(
    model, params, prefixes, lengths, separators, vectors, labels, layers
):
    """float32 ``[K, B, C]``: the labels' logits at the separator appended to the
    left-padded ``prefixes``, with the residual there replaced after layer ``layers[k]``
    by ``vectors[layers[k]]`` (none for -1): a traced layer mask, so one program."""
    batch, width = prefixes.shape
    num_layers = model.config.num_layers
    cache = empty_cache(model, batch, width + 1)
    positions = left_padded_positions(lengths, width)
    _, cache = prefill_chunks(model, params, prefixes, positions, cache, chunk_size=width)

    def patched(layer):
        edit = Edit(
            values=vectors[:, None, None, :],
            mask=(jnp.arange(num_layers) == layer)[:, None, None],
            replace=jnp.ones((num_layers,), bool),
        )
        logits, _ = model.apply(
            {"params": params},
            separators[:, None],
            lengths[:, None],
            cache,
            intervention=Intervention(residual=edit),
        )
        return logits[:, 0, labels]

    return jax.lax.map(patched, layers)
