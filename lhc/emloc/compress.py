"""EMLoC's context compression: chunk by chunk, layer by layer, under a JS bound.

For each chunk of demonstrations (``EMLoCConfig.chunk_size`` examples):

1. the chunk is prefilled after the memory so far (every kept token visible, positions
   continuing after every token seen, pruned or not);
2. each of the chunk's examples is fed again after the memory and the whole chunk (the
   examples packed in one row, each seeing the memory and its own tokens, as if alone):
   the *teacher* pass. It gives the distributions of the answer tokens,
   the residual stream entering every layer, and the attention probabilities of the
   queries that predict answer tokens;
3. the importance of each chunk token in layer ``l`` and key/value head ``k``: those
   probabilities, renormalised over the chunk and the row's own tokens (the memory left
   out), summed over the queries and over the query heads of the group, average-pooled
   over tokens (kernel ``pool``, zero padding counted), plus ``answer_bonus`` on the
   chunk's answer tokens;
4. from the top layer down, keep ratios ``ratios`` are tried in order: each head of the
   layer keeps its ``floor(C r)`` best tokens, the examples are run again from that
   layer's stored input (layers above keep their decisions, layers below are still
   whole), and the first ratio whose mean Jensen-Shannon divergence (natural log,
   float32) to the teacher over all answer predictions is at most ``delta`` is
   accepted; if none is, the layer keeps the whole chunk;
5. the kept tokens join the memory.

Compared with the official code (Qwen2-VL only): the scored queries are the positions
that *predict* answer tokens (the official code takes the positions of the answer
tokens of its chat template, which include the newline before the answer); softmax and
JS run in float32 (there bfloat16); a one-example chunk works.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc.emloc.config import EMLoCConfig
from lhc.emloc.examples import Example, join_examples, pooled_head_scores, top_tokens
from lhc.emloc.memory import LayerwiseMemory, append_kept, capacity_slots, empty_memory

# Rows are padded to a multiple of ROW_BUCKET tokens, a chunk's prefill to a multiple of
# CHUNK_BUCKET: one compiled program for rows and chunks of similar lengths.
ROW_BUCKET = 16
CHUNK_BUCKET = 64


@dataclasses.dataclass
class LayerDecision:
    """What one layer kept of one chunk."""

    chunk: int
    layer: int
    ratio: float  # 1.0: kept whole
    kept: int  # tokens per head
    js: float  # mean JS of the accepted ratio (nan when kept whole)
    tried: list[tuple[float, float]]  # (ratio, JS) of every trial, in order
    scores: np.ndarray  # [K, C] the importance of the chunk's tokens
    tokens: np.ndarray  # [K, kept] the indices (into the chunk) each head keeps


@dataclasses.dataclass
class Compression:
    """A compressed context and how it was made."""

    memory: LayerwiseMemory
    decisions: list[LayerDecision]
    context_tokens: int
    seconds: float

    def kept_fraction(self) -> float:
        """Tokens kept over the layers and heads, as a fraction of the context."""
        return float(np.mean(self.memory.sizes()) / self.context_tokens)


# Sequences and rows ---------------------------------------------------------------------


def _used(example: Example) -> int:
    """Tokens up to the last one that predicts an answer token (all, if none does)."""
    predicting = np.flatnonzero(np.asarray(example.answer)[1:])
    return int(predicting[-1]) + 1 if predicting.size else len(example)


def _rows(examples: Sequence[Example], embed_dim: int, first_position: int):
    """The examples as rows right-padded to a multiple of ``ROW_BUCKET`` tokens, each
    starting at ``first_position``: tokens, positions, embeddings, embedding mask."""
    width = ROW_BUCKET * math.ceil(max(len(e) for e in examples) / ROW_BUCKET)
    rows = len(examples)
    tokens = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    embeddings = np.zeros((rows, width, embed_dim), np.float32)
    embedded = np.zeros((rows, width), bool)
    for r, e in enumerate(examples):
        t, _, emb, mask = join_examples([e], embed_dim)
        tokens[r, : len(e)], embeddings[r, : len(e)], embedded[r, : len(e)] = t, emb, mask
        positions[r, : len(e)] = first_position + np.arange(len(e))
    return tokens, positions, embeddings, embedded


def _packed(examples: Sequence[Example], embed_dim: int, first_position: int):
    """The examples re-fed after a chunk, packed into one row: each cut at its last
    query (what follows cannot change what the queries see), each at positions from
    ``first_position``, one segment id per example, the row right-padded to a multiple
    of ``ROW_BUCKET``. Returns ``[1, T]`` tokens, positions, ``[1, T, D]`` embeddings,
    embedding mask, segment ids, and ``[1, Q]`` the queries predicting answer tokens."""
    used = [_used(e) for e in examples]
    width = ROW_BUCKET * math.ceil(sum(used) / ROW_BUCKET)
    tokens = np.zeros((1, width), np.int32)
    positions = np.full((1, width), -1, np.int32)
    embeddings = np.zeros((1, width, embed_dim), np.float32)
    embedded = np.zeros((1, width), bool)
    segments = np.full((1, width), -1, np.int32)
    queries, begin = [], 0
    for r, (e, n) in enumerate(zip(examples, used)):
        t, _, emb, mask = join_examples([e], embed_dim)
        span = slice(begin, begin + n)
        tokens[0, span], embeddings[0, span], embedded[0, span] = t[:n], emb[:n], mask[:n]
        positions[0, span] = first_position + np.arange(n)
        segments[0, span] = r
        queries.append(begin + np.flatnonzero(np.asarray(e.answer)[1:]))  # t predicts t + 1
        begin += n
    queries = np.concatenate(queries)
    if not queries.size:
        raise ValueError("no example of the chunk has an answer token after its first token")
    return tokens, positions, embeddings, embedded, segments, queries[None].astype(np.int32)


# The model calls --------------------------------------------------------------------------


def _apply(model, params, memory, tokens, positions, embeddings, embedded, **kwargs):
    """The model on tokens whose ``embedded`` columns take ``embeddings`` (images)."""
    return model.apply(
        {"params": params},
        tokens,
        positions,
        memory,
        embeddings=embeddings,
        embedding_mask=embedded,
        **kwargs,
    )


def js_divergence(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """Jensen-Shannon divergence (natural log) of distributions given as log
    probabilities over the last axis, in float32."""
    log_p, log_q = log_p.astype(jnp.float32), log_q.astype(jnp.float32)
    log_m = jnp.logaddexp(log_p, log_q) - jnp.log(2.0)
    kl = lambda a: jnp.sum(jnp.where(a > -jnp.inf, jnp.exp(a) * (a - log_m), 0.0), axis=-1)
    return 0.5 * (kl(log_p) + kl(log_q))


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill(model, params, memory, tokens, positions, embeddings, embedded):
    _, memory = _apply(
        model, params, memory, tokens, positions, embeddings, embedded, last_only=True
    )
    return memory


@functools.partial(jax.jit, static_argnames=("model",))
def _teacher(model, params, memory, tokens, positions, embeddings, embedded, probe):
    (logits, _), state = _apply(
        model,
        params,
        memory,
        tokens,
        positions,
        embeddings,
        embedded,
        probe=probe,
        logits_at=probe,
        mutable=["intermediates"],
    )
    inter = state["intermediates"]
    layers = [inter[f"layers_{i}"] for i in range(model.config.num_layers)]
    inputs = [layer["layer_input"][0] for layer in layers]
    probs = [layer["attention"]["attention_probs"][0] for layer in layers]
    return jax.nn.log_softmax(logits, axis=-1), inputs, probs


@functools.partial(jax.jit, static_argnames=("model",))
def _student(model, params, memory, positions, hidden, probe, start, teacher):
    """The mean JS divergence to ``teacher`` of the answer distributions of the examples
    run again from layer ``start`` (traced: one program for every layer)."""
    logits, _ = model.apply(
        {"params": params},
        None,
        positions,
        memory,
        embeddings=hidden,
        start_layer=start,
        logits_at=probe,
    )
    return jnp.mean(js_divergence(teacher, jax.nn.log_softmax(logits, axis=-1)))


def importance(
    probs: np.ndarray,
    valid: np.ndarray,
    chunk_slots: slice,
    own_slots: slice,
    num_kv_heads: int,
    answer: np.ndarray,
    pool: int,
    answer_bonus: float,
) -> np.ndarray:
    """EMLoC's importance of each chunk token for one layer.

    Args:
        probs: float ``[R, N, Q, S]``, the probed attention probabilities of the rows.
        valid: bool ``[R, Q]``: which probed queries predict an answer token.
        chunk_slots: the columns of the chunk's tokens.
        own_slots: the columns of the rows' own tokens.
        num_kv_heads: K.
        answer: bool ``[C]``: the chunk's answer tokens.
        pool: average-pooling kernel (zero padding counted).
        answer_bonus: added on answer tokens.

    Returns:
        float64 ``[K, C]``.
    """
    probs = np.asarray(probs, np.float64)
    chunk = probs[..., chunk_slots]
    total = chunk.sum(-1, keepdims=True) + probs[..., own_slots].sum(-1, keepdims=True)
    chunk = np.where(total > 0, chunk / np.where(total > 0, total, 1), 0)
    summed = np.einsum("rnqc,rq->nc", chunk, valid.astype(np.float64))  # [N, C]
    pooled = pooled_head_scores(summed, num_kv_heads, pool)
    return pooled + answer_bonus * np.asarray(answer, np.float64)[None]


# Compression ------------------------------------------------------------------------------


def _with_kept(memory: LayerwiseMemory, layer: int, offset: int, kept: np.ndarray | None):
    """``memory`` with layer ``layer``'s chunk slots ``offset:`` reduced to ``kept`` per
    head (``None``: all of them)."""
    if kept is None:
        return memory
    positions = np.asarray(memory.positions[layer])
    chunk = positions[:, :, offset:]
    mask = np.zeros(chunk.shape[1:], bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    chunk = np.where(mask[None], chunk, -1)
    positions = np.concatenate([positions[:, :, :offset], chunk], axis=-1)
    layers = list(memory.positions)
    layers[layer] = jnp.asarray(positions)
    return memory.replace(positions=tuple(layers))


def compress(
    model: Any,
    params: Any,
    examples: Sequence[Example],
    config: EMLoCConfig = EMLoCConfig(),
    *,
    memory: LayerwiseMemory | None = None,
) -> Compression:
    """Compresses ``examples`` into a ``LayerwiseMemory`` with EMLoC.

    Args:
        model: an ``lhc.lm.Transformer`` with ``scan_layers=False``.
        params: its parameters.
        examples: the demonstrations, in order.
        config: ``EMLoCConfig``.
        memory: a memory of one sequence to continue (default: an empty one).

    Returns:
        The ``Compression``: the memory (one sequence; ``broadcast`` it for a batch) and
        every layer's decision.
    """
    cfg = model.config
    if not examples:
        raise ValueError("compress: no examples")
    if config.chunk_size > len(examples):
        raise ValueError(
            f"compress: chunk_size {config.chunk_size} is larger than the context "
            f"({len(examples)} examples)"
        )
    began = time.perf_counter()
    context = sum(len(e) for e in examples)
    memory = empty_memory(cfg) if memory is None else memory
    decisions = []
    chunks = [
        examples[i : i + config.chunk_size] for i in range(0, len(examples), config.chunk_size)
    ]
    for index, chunk in enumerate(chunks):
        memory, chunk_decisions = _compress_chunk(model, params, memory, chunk, config, index)
        decisions += chunk_decisions
    return Compression(memory, decisions, context, time.perf_counter() - began)


def _search_layer(scores, length, config, trial, chunk, layer) -> LayerDecision:
    """One layer's decision: the first keep ratio whose ``trial(top [K, n]) -> mean JS``
    is within ``config.delta``, else the whole chunk (``ratio`` 1)."""
    tried = []
    for ratio in config.ratios:
        count = int(length * ratio)
        if count < 1:
            tried.append((ratio, float("nan")))
            continue
        top = top_tokens(scores, count)
        js = trial(top)
        tried.append((ratio, js))
        if js <= config.delta:
            return LayerDecision(chunk, layer, ratio, count, js, tried, scores, top)
    everything = np.tile(np.arange(length), (scores.shape[0], 1))
    return LayerDecision(chunk, layer, 1.0, length, float("nan"), tried, scores, everything)


def _compress_chunk(model, params, memory, chunk, config, index):
    cfg = model.config
    tokens, answer, embeddings, embedded = join_examples(chunk, cfg.embed_dim)
    length = tokens.size
    # Every layer gets the same slots, grown in coarse steps (``capacity_slots``) to
    # hold what is kept and this chunk: chunks of similar lengths run the same programs,
    # and attention reads about as many slots as are held.
    slots = capacity_slots(int(memory.sizes().max()) + length)
    memory = memory.padded(max(slots, *(p.shape[-1] for p in memory.positions)))
    first = int(np.asarray(memory.next_positions())[0])
    last = first + length + max(len(e) for e in chunk)
    if last > cfg.max_len:
        raise ValueError(
            f"compress: the context and its re-fed examples reach position {last}, beyond "
            f"the model's max_len {cfg.max_len}"
        )
    positions = first + np.arange(length, dtype=np.int32)
    # The chunk right-padded (its first slots hold it).
    padded = min(CHUNK_BUCKET * math.ceil(length / CHUNK_BUCKET), cfg.max_len) - length
    filled = _prefill(
        model,
        params,
        memory.with_tail(cfg, length + padded),
        jnp.asarray(np.pad(tokens, (0, padded))[None]),
        jnp.asarray(np.pad(positions, (0, padded), constant_values=-1)[None]),
        jnp.asarray(np.pad(embeddings, ((0, padded), (0, 0)))[None]),
        jnp.asarray(np.pad(embedded, (0, padded))[None]),
    )
    everything = np.tile(np.arange(length), (cfg.num_kv_heads, 1))
    combined = append_kept(
        memory,
        [k[:, :, :length] for k in filled.tail.keys],
        [v[:, :, :length] for v in filled.tail.values],
        positions,
        [everything] * cfg.num_layers,
        start=first + length,
    )
    offsets = [int(np.sum(np.asarray(p)[0, 0] >= 0)) for p in memory.positions]

    # The chunk's examples are fed again after it, packed in one row (each reads the
    # memory and itself only, as if alone).
    rows, row_positions, row_embeddings, row_embedded, segments, probe = _packed(
        chunk, cfg.embed_dim, first + length
    )
    valid = np.ones(probe.shape, bool)  # every packed query predicts an answer token
    width = rows.shape[1]
    batch = combined.with_tail(cfg, width).packed(segments)
    probe_j = jnp.asarray(probe)
    teacher, inputs, probs = _teacher(
        model,
        params,
        batch,
        jnp.asarray(rows),
        jnp.asarray(row_positions),
        jnp.asarray(row_embeddings),
        jnp.asarray(row_embedded),
        probe_j,
    )

    def mean_js(top, *, batch, layer, offset):
        """The mean JS with layer ``layer`` reduced to ``top`` of the chunk."""
        return float(
            _student(
                model,
                params,
                _with_kept(batch, layer, offset, top),
                jnp.asarray(row_positions),
                inputs[layer],
                probe_j,
                jnp.int32(layer),
                teacher,
            )
        )

    decisions, kept = [], {}
    for layer in reversed(range(cfg.num_layers)):
        slots = combined.positions[layer].shape[-1]
        offset = offsets[layer]
        scores = importance(
            probs[layer],
            valid,
            slice(offset, offset + length),
            slice(slots + width, slots + 2 * width),
            cfg.num_kv_heads,
            answer,
            config.pool,
            config.answer_bonus,
        )
        trial = functools.partial(mean_js, batch=batch, layer=layer, offset=offset)
        decision = _search_layer(scores, length, config, trial, index, layer)
        kept[layer] = decision.tokens
        if decision.ratio < 1:
            batch = _with_kept(batch, layer, offset, decision.tokens)
        decisions.append(decision)

    memory = append_kept(
        memory,
        [k[:, :, :length] for k in filled.tail.keys],
        [v[:, :, :length] for v in filled.tail.values],
        positions,
        [kept[layer] for layer in range(cfg.num_layers)],
        start=first + length,
    )
    return memory, decisions[::-1]


@functools.partial(jax.jit, static_argnames=("model",))
def _query_logits(model, params, memory, tokens, positions, embeddings, embedded, last):
    logits, _ = _apply(
        model, params, memory, tokens, positions, embeddings, embedded, logits_at=last[:, None]
    )
    return logits[:, 0]


def next_token_logits(
    model: Any, params: Any, memory: LayerwiseMemory, queries: Sequence[Example]
) -> jax.Array:
    """float32 ``[Q, V]``: the logits after each query, each read on ``memory`` (a
    memory of one sequence) in a batch of its own row."""
    if not queries:
        raise ValueError("next_token_logits: no queries")
    cfg = model.config
    start = int(np.asarray(memory.next_positions())[0])
    tokens, positions, embeddings, embedded = _rows(queries, cfg.embed_dim, start)
    last = np.array([len(q) - 1 for q in queries], np.int32)
    # Every layer padded to one capacity: one program for memories of similar sizes.
    slots = capacity_slots(max(p.shape[-1] for p in memory.positions))
    batch = memory.padded(slots).broadcast(len(queries)).with_tail(cfg, tokens.shape[1])
    return _query_logits(
        model,
        params,
        batch,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.asarray(embeddings),
        jnp.asarray(embedded),
        jnp.asarray(last),
    )
