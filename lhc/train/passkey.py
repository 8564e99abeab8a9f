"""Passkey retrieval: the examples, the accuracy of any causal LM over lengths and
depths, and the training task.

A number hidden at some depth of long filler, asked for at the end. One example, as
text::

    <filler> The pass key is 40715. Remember it. 40715 is the pass key. <filler>
    What is the pass key? The pass key is 40715

The needle sits after a fraction ``depth`` of the filler; the loss counts only the
answer digits. Filler is generated (the repeated sentences of the usual passkey test)
or drawn from text files a user supplies (random snippets, in order). Text becomes
tokens through any tokenizer with ``encode(str) -> list[int]`` (``lhc.lm.ByteTokenizer``
for models trained here); the sequence is exactly ``length`` tokens.

**Accuracy** (``passkey_accuracy``): each example is run with a cache, the context up
to the answer prefilled in chunks (``lhc.lm.decoding.prefill``), so memory is bounded by
what the model's cache keeps; the answer tokens are then scored teacher-forced: an
example counts as retrieved when the argmax at every answer position is the key's token.

**The task** (``config.task = "passkey"``): the model comes from ``config.model_factory``
as in the causal-LM task (a GCA, recurrent or dense ``lhc.lm`` model). Training
sequences are examples of ``config.data.length`` byte tokens (``lhc.lm.ByteTokenizer``,
ids 0-258) with the needle at a uniform depth; the loss counts the answer digits, plus
``config.data.lm_loss_weight`` (default 0) times the next-token loss over the whole
sequence (filler, needle and question too: a language modelling signal on every token,
from which copying is learnt long before the sparse answer loss alone teaches it).
``evaluate`` reports the loss and digit accuracy on held-out batches of the training
length and, when ``config.passkey_eval.lengths`` is not empty, the passkey accuracy over
``lengths`` x ``depths``, with a markdown table and a heat map written to
``config.passkey_eval.output_dir`` when that is set, and every example's hit appended
to ``config.passkey_eval.results`` (JSON lines, one record per length and depth, with
``passkey_eval.label`` and the run's seed) when that is set. With ``config.data.min_length`` each
sequence has its own length, uniform in [``min_length``, ``length``], and is
right-padded to ``length`` (padding weighs nothing in either loss: ``lm_weights`` marks
the real tokens). A model trained on one length only learns where the question sits at
that length and may fail on shorter prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lhc import plots, stats
from lhc.data.iterators import row_rngs, stack_rows
from lhc.lm.decoding import prefill
from lhc.lm.tokenizers import ByteTokenizer
from lhc.train.causal_lm import CausalLMTask, weighted_cross_entropy

# Examples ------------------------------------------------------------------------------


GENERATED_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "


class Filler:
    """A source of filler text: generated, or the concatenated text of files.

    Args:
        paths: text files (UTF-8) to draw snippets from; ``None`` for the generated
            filler. Each snippet starts at a random offset of the concatenated text and
            wraps around at its end.

    Raises:
        ValueError: a path that is not a readable file, or files with no text.
    """

    def __init__(self, paths: Sequence[str] | None = None):
        if paths is None:
            self.text = GENERATED_FILLER
            self.generated = True
            return
        texts = []
        for path in paths:
            if not os.path.isfile(path):
                raise ValueError(f"filler paths: {path!r} is not a file")
            with open(path, encoding="utf-8") as handle:
                texts.append(handle.read())
        self.text = " ".join(" ".join(t.split()) for t in texts)
        if not self.text.strip():
            raise ValueError(f"filler paths {list(paths)} hold no text")
        self.generated = False

    def _snippet(self, offset: int, chars: int) -> tuple[str, int]:
        """``chars`` characters from ``offset`` on, wrapping around; and the next offset."""
        parts = []
        while chars > 0:
            part = self.text[offset : offset + chars]
            parts.append(part)
            chars -= len(part)
            offset = (offset + len(part)) % len(self.text)
        return "".join(parts), offset

    def tokens(self, tokenizer, rng: np.random.Generator, count: int) -> list[int]:
        """``count`` filler tokens (the generated filler starts at a sentence)."""
        if count <= 0:
            return []
        offset = 0 if self.generated else int(rng.integers(len(self.text)))
        ids: list[int] = []
        while len(ids) < count:
            # A few characters per missing token; tokenized, then cut to `count` tokens.
            piece, offset = self._snippet(offset, 8 * (count - len(ids)) + 64)
            new = list(tokenizer.encode(piece))
            if not new:
                raise ValueError("the filler text tokenizes to no tokens")
            ids.extend(new)
        return ids[:count]


def passkey_example(
    rng: np.random.Generator,
    *,
    length: int,
    tokenizer,
    filler: Filler | None = None,
    depth: float | None = None,
    digits: int = 5,
) -> dict[str, np.ndarray]:
    """One passkey sequence of exactly ``length`` tokens.

    Args:
        rng: randomness for the key, the depth (when not given) and the filler.
        length: tokens in the sequence (inputs plus the last target).
        tokenizer: any object with ``encode(str) -> list[int]``.
        filler: a ``Filler``; the generated one by default.
        depth: where the needle goes, as a fraction of the filler before it (0: at the
            start, 1: just before the question); uniform in [0, 1] when ``None``.
        digits: digits of the key (no leading zero).

    Returns:
        ``tokens``, ``targets`` int32 ``[length - 1]`` and ``weights`` float32
        ``[length - 1]`` (1 on the positions that predict the answer's tokens), plus
        ``key`` (int) and ``needle_start`` (the needle's first token index).

    Raises:
        ValueError: a length too short for the needle, question and answer, or a depth
            outside [0, 1].
    """
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    filler = filler or Filler()
    key = int(rng.integers(10 ** (digits - 1), 10**digits))
    needle = list(tokenizer.encode(NEEDLE.format(key=key)))
    question = list(tokenizer.encode(QUESTION))
    answer = list(tokenizer.encode(str(key)))
    fixed = len(needle) + len(question) + len(answer)
    if length < fixed + 1:
        raise ValueError(
            f"length {length} is too short for the needle, question and answer ({fixed} tokens)"
        )
    filler_count = length - fixed
    depth = float(rng.random()) if depth is None else depth
    before = int(round(depth * filler_count))
    text = filler.tokens(tokenizer, rng, filler_count)
    sequence = text[:before] + needle + text[before:] + question + answer
    sequence = np.asarray(sequence, np.int32)
    weights = np.zeros(length - 1, np.float32)
    weights[length - 1 - len(answer) :] = 1.0
    return {
        "tokens": sequence[:-1],
        "targets": sequence[1:],
        "weights": weights,
        "key": key,
        "needle_start": before,
    }


def passkey_batch(rng: np.random.Generator, batch_size: int, **kwargs) -> dict[str, np.ndarray]:
    """``batch_size`` examples of ``passkey_example`` stacked (``tokens, targets, weights``)."""
    examples = [passkey_example(rng, **kwargs) for _ in range(batch_size)]
    return {
        name: np.stack([example[name] for example in examples])
        for name in ("tokens", "targets", "weights")
    }


# Accuracy over lengths and depths ---------------------------------------------------


@dataclasses.dataclass
class PasskeyResult:
    """Accuracy per (length, depth): ``accuracy[i, j]`` for ``lengths[i]``, ``depths[j]``;
    NaN where the model cannot take the length (beyond its ``max_len``)."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    accuracy: np.ndarray
    samples: int
    # Each cell's examples, found (True) or not: ``hits[i][j]``, empty where NaN.
    hits: list = dataclasses.field(default_factory=list)

    def table(self) -> str:
        """A markdown table: one row per length, one column per depth, and the mean."""
        head = "| length | " + " | ".join(f"depth {d:g}" for d in self.depths) + " | mean |"
        rule = "|---:|" + "---:|" * (len(self.depths) + 1)
        rows = [head, rule]
        for length, row in zip(self.lengths, self.accuracy):
            cells = ["n/a" if np.isnan(a) else f"{a:.2f}" for a in row]
            mean = "n/a" if np.isnan(row).all() else f"{np.nanmean(row):.2f}"
            rows.append(f"| {length} | " + " | ".join(cells) + f" | {mean} |")
        return "\n".join(rows)

    def metrics(self, prefix: str = "passkey") -> dict[str, float]:
        out = {}
        for length, row in zip(self.lengths, self.accuracy):
            for depth, value in zip(self.depths, row):
                if not np.isnan(value):
                    out[f"{prefix}/accuracy/{length}/{depth:g}"] = float(value)
        return out

    def plot(self, path: str, title: str = "passkey accuracy") -> None:
        """Writes a heat map (depth x length) as a PNG."""
        plots.length_depth_heatmap(path, self.accuracy, self.lengths, self.depths, title)


@functools.partial(jax.jit, static_argnums=0)
def _predict(model, params, tokens, positions, cache):
    logits, _ = model.apply({"params": params}, tokens, positions, cache)
    return jnp.argmax(logits, axis=-1)


def passkey_accuracy(
    model,
    params,
    tokenizer,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int = 0,
    filler: Filler | None = None,
    prefill_chunk: int = 1024,
    batch_size: int | None = None,
) -> PasskeyResult:
    """Passkey accuracy of ``model`` over ``lengths`` x ``depths``.

    Args:
        model: a causal-LM protocol module (``init_cache``, ``config.max_len``).
        params: its parameters.
        tokenizer: the tokenizer of the examples (``encode``).
        lengths: sequence lengths in tokens.
        depths: needle depths in [0, 1].
        samples: examples per cell (different keys and filler).
        seed: seeds the examples; cell (i, j) draws from ``(seed, i, j)``.
        filler: the filler source (generated by default).
        prefill_chunk: tokens per prefill call.
        batch_size: examples run together (default: ``samples``).

    Returns:
        A ``PasskeyResult``.
    """
    batch_size = batch_size or samples
    max_len = getattr(model.config, "max_len", None)
    accuracy = np.full((len(lengths), len(depths)), np.nan)
    cells = [[[] for _ in depths] for _ in lengths]
    for i, length in enumerate(lengths):
        if max_len is not None and length > max_len:
            continue
        for j, depth in enumerate(depths):
            rng = np.random.default_rng([seed, i, j])
            examples = [
                passkey_example(rng, length=length, tokenizer=tokenizer, filler=filler, depth=depth)
                for _ in range(samples)
            ]
            hits = []
            for start in range(0, samples, batch_size):
                group = examples[start : start + batch_size]
                predicted = answer_predictions(model, params, group, prefill_chunk=prefill_chunk)
                for example, guess in zip(group, predicted):
                    scored = example["weights"] > 0
                    hits.append(bool(np.all(guess == example["targets"][scored])))
            accuracy[i, j] = float(np.mean(hits))
            cells[i][j] = hits
    depths = tuple(float(d) for d in depths)
    return PasskeyResult(tuple(lengths), depths, accuracy, samples, cells)


def answer_predictions(model, params, examples, *, prefill_chunk: int = 1024) -> np.ndarray:
    """The model's argmax at the answer positions of same-length passkey examples.

    The context before the first answer-predicting position is prefilled in chunks of
    ``prefill_chunk`` into ``model.init_cache``; the rest is one call.

    Returns:
        int ``[len(examples), digits]``: the predicted token at each position whose
        ``weights`` is 1.
    """
    tokens = np.stack([e["tokens"] for e in examples])
    weights = np.stack([e["weights"] for e in examples])
    batch, width = tokens.shape
    head = int(np.argmax(weights[0] > 0))
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (batch, width))
    cache = model.init_cache(batch, width)
    if head:
        _, cache = prefill(
            model,
            params,
            jnp.asarray(tokens[:, :head]),
            jnp.asarray(positions[:, :head]),
            cache,
            chunk_size=min(prefill_chunk, head),
        )
    predicted = np.asarray(
        _predict(
            model, params, jnp.asarray(tokens[:, head:]), jnp.asarray(positions[:, head:]), cache
        )
    )
    return predicted[weights[:, head:] > 0].reshape(batch, -1)


# The training task ---------------------------------------------------------------------


def right_pad(row: dict[str, np.ndarray], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """A ``[1, n]`` row of tokens / targets / weights right-padded to ``length``, with
    ``lm_weights`` marking its n real positions (padding weighs nothing in either loss)."""
    pad = length - row["tokens"].shape[1]
    fill = lambda x, value: np.pad(x, ((0, 0), (0, pad)), constant_values=value)
    return {
        "tokens": fill(row["tokens"], pad_id),
        "targets": fill(row["targets"], pad_id),
        "weights": fill(row["weights"], 0.0),
        "lm_weights": fill(np.ones_like(row["weights"]), 0.0),
    }


class PasskeyTask(CausalLMTask):
    """Config keys: those of ``CausalLMTask`` with ``data`` = ``length`` (tokens per
    training sequence), ``min_length`` (optional: lengths vary from it up to
    ``length``), ``filler_paths`` (``None`` for the generated filler, or a list of
    text files), ``digits``, ``lm_loss_weight``; and ``passkey_eval`` = ``lengths``, ``depths``, ``samples``,
    ``batch_size``, ``prefill_chunk``, ``output_dir`` (optional)."""

    tokenizer = ByteTokenizer()

    def _filler(self) -> Filler:
        paths = self.config.data.get("filler_paths")
        return Filler(None if paths is None else list(paths))

    def _generator_kwargs(self) -> dict:
        data = self.config.data
        return dict(
            length=int(data.length) + 1,  # inputs plus the last target
            tokenizer=self.tokenizer,
            filler=self._filler(),
            digits=int(data.get("digits", 5)),
        )

    def _make_batch(self, seed, index, rows):
        kwargs = self._generator_kwargs()
        min_length = self.config.data.get("min_length")
        if min_length is None:

            def row(rng):
                batch = passkey_batch(rng, 1, **kwargs)
                return {**batch, "lm_weights": np.ones_like(batch["weights"])}

        else:
            longest = kwargs["length"] - 1
            if not 1 <= int(min_length) <= longest:
                raise ValueError(
                    f"config.data.min_length must lie in [1, length={longest}], got {min_length}"
                )

            def row(rng):
                length = int(rng.integers(int(min_length), longest + 1))
                batch = passkey_batch(rng, 1, **{**kwargs, "length": length + 1})
                return right_pad(batch, longest, self.tokenizer.pad_id)

        return stack_rows(row, row_rngs(seed, index, rows))

    def loss(self, params, batch, rng):
        """The answer digits' loss, plus ``lm_loss_weight`` times every token's."""
        return self.loss_from_logits(self._logits(params, batch, rng), batch)

    def loss_from_logits(self, logits, batch):
        """``loss``'s ``(loss, metrics)`` from the model's logits of ``batch``."""
        lm_weight = float(self.config.data.get("lm_loss_weight", 0.0))
        if lm_weight < 0:
            raise ValueError(f"config.data.lm_loss_weight must be >= 0, got {lm_weight}")
        loss, accuracy, _ = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
        metrics = {"accuracy": accuracy, "answer_loss": loss}
        if lm_weight:
            every = batch.get("lm_weights", jnp.ones_like(batch["weights"]))
            lm_loss, _, _ = weighted_cross_entropy(logits, batch["targets"], every)
            metrics["lm_loss"] = lm_loss
            loss = loss + lm_weight * lm_loss
        return loss, metrics

    def evaluate(self, params):
        metrics = super().evaluate(params)
        # Uniform guessing of the digits (the first is never 0).
        digits = int(self.config.data.get("digits", 5))
        metrics["eval/chance_loss"] = (math.log(9) + (digits - 1) * math.log(10)) / digits
        settings = self.config.get("passkey_eval")
        if settings is None or not settings.get("lengths"):
            return metrics
        result = passkey_accuracy(
            self.model,
            params,
            self.tokenizer,
            lengths=[int(n) for n in settings.lengths],
            depths=[float(d) for d in settings.depths],
            samples=int(settings.samples),
            seed=int(self.config.seed) + 2_000_003,
            filler=self._filler(),
            prefill_chunk=int(settings.get("prefill_chunk", 1024)),
            batch_size=settings.get("batch_size"),
        )
        metrics.update(result.metrics())
        results = settings.get("results")
        if results and jax.process_index() == 0:  # one record per cell, every example's hit
            run = dict(label=settings.get("label", ""), seed=int(self.config.seed))
            stats.append_records(
                results,
                [
                    dict(run, length=length, depth=depth, hits=result.hits[i][j])
                    for i, length in enumerate(result.lengths)
                    for j, depth in enumerate(result.depths)
                    if result.hits[i][j]
                ],
            )
        output_dir = settings.get("output_dir")
        if output_dir and jax.process_index() == 0:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, "passkey_table.md"), "w") as handle:
                handle.write(result.table() + "\n")
            result.plot(os.path.join(output_dir, "passkey_heatmap.png"))
        print(result.table())
        return metrics
