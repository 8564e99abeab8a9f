"""The Grouped Cross Attention LM (Hu et al., ICML 2025; the official code's "DRT").

``logits, cache = model.apply({"params": params}, tokens, positions, cache)`` follows
lhc's causal-LM protocol (``lhc.lm``): ``tokens, positions`` int32 ``[B, T]`` of plain
text (-1: padding), ``logits`` float32 ``[B, T, V]``. The model inserts the landmarks
itself: the layers run on the *stream*, the text with a landmark token closing every
``S - 1`` text tokens (``S = chunk_size``), and the landmarks' outputs are dropped (the
landmark id's logit is the float32 minimum: it is never predicted as text).

Layout, as the official code wires it:

* a lower decoder of ``lower_layers`` sliding-window self-attention layers with ALiBi;
* a chunk encoder: for each completed chunk, ``encoder_layers`` bidirectional layers
  with within-chunk RoPE on ``enc_prenorm(lower output)``, then a final norm; the
  encoder output at the landmark is the chunk's landmark key; ``chunk_key`` /
  ``chunk_value`` project it to the chunk memory shared by every GCA layer, with the
  landmark slot zeroed (a zero key adds ``exp(0)`` to every softmax with no value: the
  "+1" of the official code);
* retrieval groups (``upper_layers``): each takes the hidden state at every landmark
  (through ``landmark_norm_{g}``) as the chunk's query, scores it against the landmark
  keys of strictly earlier chunks (``/ sqrt(D)``), keeps the top ``top_k`` (Gumbel noise
  on the selection when an rng ``"train"`` is given, as in training), and fuses them
  with the softmax of their scores. Chunk ``i``'s retrieval serves the tokens of chunk
  ``i + 1``; the fusion weights are how the retriever learns (indices get no gradient);
* upper layers: ``h = x + SWA(norm(x))``, ``g = GCA(h)``, ``out = h + MLP(norm(h + g))``
  (GCA reaches the residual stream only through the MLP input).

A plain forward pass (``cache=None``) needs each row's real positions to be
``0 .. n - 1`` (padding anywhere); with a cache they continue from
``cache.next_positions()``. Appending tokens in any pieces gives the logits of one full
forward pass: the cache (``lhc.gca.cache``) keeps the sliding windows, the lower
outputs of the current chunk, the chunk memory and the retrievals serving the current
chunk, so the cost of a token does not grow with the context (retrieval scores one
vector per stored chunk).

Where lhc differs from the official code:

* Any length: the model inserts the landmarks, so a sequence need not be a whole
  number of chunks (a partial last chunk is simply not yet encoded or retrievable).
* Top-k larger than the history (the first chunks): the missing slots are empty (index
  -1, weight 0), as the official kernel treats them; it is not an error.
* Decoding is exact: appending in any pieces equals the full forward pass (the official
  evaluation runs long inputs in 16K-token segments with a truncated window cache).
* Offload (``GCAConfig.offload_memory``): the official ``ChunkKVManager`` copies the
  top-k chunks to the GPU once per retrieval; here each call gathers, on the host, the
  chunks its retrieval table names (at most ``2 * top_k`` per group for one decoded
  token), so a step moves a constant number of chunks whatever the context.

Parameter tree::

    embed/embedding                                 [V, D]
    lower_{i}/{attention_norm,mlp_norm}/scale       [D]
    lower_{i}/attention/{query,key,value,out}/kernel
    lower_{i}/mlp/{gate,up,down}/kernel
    enc_prenorm/scale                               [D]
    encoder/layers_{j}/...                          (as lower_{i}, with RoPE)
    encoder/final_norm/scale                        [D]
    chunk_key/kernel, chunk_value/kernel            [D, K, H]
    landmark_norm_{g}/scale                         [D]
    upper_{g}_{i}/...                               (as lower_{i}, plus)
    upper_{g}_{i}/gca/{norm/scale, query/kernel [D, N, H], out/kernel [N, H, D]}
    final_norm/scale                                [D]
    lm_head/kernel                                  [D, V] (untied only)
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.chunk_retrieval import chunk_retrieval
from lhc.gca.cache import (
    GCACache,
    StreamLayout,
    StreamWriter,
    cache_after_call,
    init_gca_cache,
    ring_slots,
    stream_layout,
)
from lhc.gca.config import GCAConfig
from lhc.lm.cache import is_concrete
from lhc.nn.attention import Attention, LayerCache
from lhc.nn.config import build_model, register_model
from lhc.nn.linear import Einsum, Embed, output_logits
from lhc.nn.mlp import SwiGLU
from lhc.nn.norms import RMSNorm
from lhc.nn.ring_attention import refuse_sequence_axis
from lhc.nn.rope import apply_rope, rope_frequencies
from lhc.parallel.mesh import map_over_batch
from lhc.parallel.offload import host_put_rows, host_take_rows

_RESIDUAL_AXES = ("act_batch", "act_len", "act_emb")
# The softmax temperature of the cosine similarities of ``retriever="mean_pool"``.
MEAN_POOL_TEMPERATURE = 0.1


def _norm(cfg: GCAConfig, name: str) -> RMSNorm:
    return RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)


class WindowAttentionLayer(nn.Module):
    """``x + SWA(norm(x))``: sliding-window self-attention with ALiBi, over the stream."""

    config: GCAConfig

    @nn.compact
    def __call__(self, x, positions, cache: LayerCache | None):
        cfg = self.config
        attended, cache = Attention(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            window=cfg.window,
            position_encoding="alibi",
            # The stream of a plain forward pass has contiguous positions.
            banded=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="attention",
        )(_norm(cfg, "attention_norm")(x), positions, cache)
        return nn.with_logical_constraint(x + attended, _RESIDUAL_AXES), cache


class Mlp(nn.Module):
    """SwiGLU of ``norm(x)`` (the caller adds the residual)."""

    config: GCAConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        return SwiGLU(cfg.mlp_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="mlp")(
            _norm(cfg, "mlp_norm")(x)
        )


class LowerBlock(nn.Module):
    """A lower-decoder layer: sliding-window attention with ALiBi, then the MLP."""

    config: GCAConfig

    @nn.compact
    def __call__(self, x, positions, cache: LayerCache | None):
        x, cache = WindowAttentionLayer(self.config, name="window")(x, positions, cache)
        x = x + Mlp(self.config, name="ffn")(x)
        return nn.with_logical_constraint(x, _RESIDUAL_AXES), cache


class EncoderLayer(nn.Module):
    """A bidirectional layer over whole chunks ``[M, S, D]`` with within-chunk RoPE."""

    config: GCAConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        embed_dim, heads, head_dim = x.shape[-1], cfg.num_heads, cfg.head_dim

        def projection(shape, axes, name, **kwargs):
            return Einsum(
                shape=shape,
                logical_axes=axes,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                name=name,
                **kwargs,
            )

        h = _norm(cfg, "attention_norm")(x)
        shape, axes = (embed_dim, heads, head_dim), ("embed", "heads", "kv")
        q = projection(shape, axes, "query")("BTD,DNH->BTNH", h)
        k = projection(shape, axes, "key")("BTD,DNH->BTNH", h)
        v = projection(shape, axes, "value")("BTD,DNH->BTNH", h)
        positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        inv_frequencies = rope_frequencies(head_dim, cfg.rope_theta)
        q, k = apply_rope(q, positions, inv_frequencies), apply_rope(k, positions, inv_frequencies)
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * head_dim**-0.5, axis=-1)
        attended = jnp.einsum("BNTS,BSNH->BTNH", probs.astype(v.dtype), v)
        out = projection((heads, head_dim, embed_dim), ("heads", "kv", "embed"), "out", in_dims=2)(
            "BTNH,NHD->BTD", attended
        )
        x = x + out
        return x + Mlp(cfg, name="ffn")(x)


class ChunkEncoder(nn.Module):
    """The encoder layers and the final norm, over chunks ``[M, S, D]``."""

    config: GCAConfig

    @nn.compact
    def __call__(self, x):
        for layer in range(self.config.encoder_layers):
            x = EncoderLayer(self.config, name=f"layers_{layer}")(x)
        return _norm(self.config, "final_norm")(x)


class GroupedCrossAttention(nn.Module):
    """``out(sum_k w_k softmax(q K_k^T) V_k)`` with ``q = query(norm(h))``; no positions."""

    config: GCAConfig

    @nn.compact
    def __call__(self, h, memory_keys, memory_values, indices, weights, *, grid: bool):
        """GCA of the call's stream entries.

        Args:
            h: ``[B, T', D]``.
            memory_keys, memory_values: ``[B, N, S, K, H]``.
            indices, weights: the retrieval serving each query chunk: ``[B, C, top_k]``
                with ``grid`` (the entries are ``C`` whole chunks, ``T' = C * S``), else
                ``[B, T', top_k]`` (one query chunk per entry).
            grid: the layout, see above.

        Returns:
            ``[B, T', D]``.
        """
        cfg = self.config
        batch, length, embed_dim = h.shape
        q = Einsum(
            shape=(embed_dim, cfg.num_heads, cfg.head_dim),
            logical_axes=("embed", "heads", "kv"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="query",
        )("BTD,DNH->BTNH", _norm(cfg, "norm")(h))
        if grid:
            q = q.reshape(batch, length // cfg.chunk_size, cfg.chunk_size, *q.shape[2:])
        else:
            q = q[:, :, None]
        retrieval = functools.partial(chunk_retrieval, impl=cfg.gca_impl)
        # A Pallas kernel runs per device over the batch under a multi-device mesh.
        attended = (map_over_batch if cfg.gca_impl == "pallas" else _call)(
            retrieval,
            q,
            memory_keys.astype(q.dtype),
            memory_values.astype(q.dtype),
            indices,
            weights,
        )
        attended = attended.reshape(batch, length, cfg.num_heads, cfg.head_dim)
        return Einsum(
            shape=(cfg.num_heads, cfg.head_dim, embed_dim),
            logical_axes=("heads", "kv", "embed"),
            in_dims=2,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="out",
        )("BTNH,NHD->BTD", attended)


def _call(fn, *args):
    return fn(*args)


class UpperBlock(nn.Module):
    """``h = x + SWA(norm(x))``, then ``h + MLP(norm(h + GCA(h)))``."""

    config: GCAConfig

    @nn.compact
    def __call__(self, x, positions, cache, memory, retrieval, *, grid: bool):
        h, cache = WindowAttentionLayer(self.config, name="window")(x, positions, cache)
        g = GroupedCrossAttention(self.config, name="gca")(h, *memory, *retrieval, grid=grid)
        out = h + Mlp(self.config, name="ffn")(h + g)
        return nn.with_logical_constraint(out, _RESIDUAL_AXES), cache


def retrieve(
    queries: jax.Array,
    landmark_keys: jax.Array,
    query_chunks: jax.Array,
    valid: jax.Array,
    *,
    top_k: int,
    noise_rng: jax.Array | None = None,
    scale: float | None = None,
    learned: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Top-k retrieval of strictly earlier chunks by landmark scores.

    Args:
        queries: ``[B, M, D]``, the (normed) landmark hidden states of ``M`` chunks.
        landmark_keys: ``[B, N, D]``, chunk ``j``'s landmark key at index ``j``.
        query_chunks: int ``[B, M]``, the chunk each query closes; it sees chunks
            ``j < query_chunks``.
        valid: bool ``[B, M]``; an invalid query retrieves nothing.
        top_k: slots per query.
        noise_rng: Gumbel noise ``-log(Exp(1))`` on the selection scores when given (the
            official training setting); the weights use the scores without noise.
        scale: multiplies the dot products; default ``1 / sqrt(D)``.
        learned: the weights pass gradients to the scores (``False``: stopped).

    Returns:
        ``(indices int32 [B, M, top_k], weights float32 [B, M, top_k])``: -1 and weight 0
        for slots with no visible chunk; the weights are the softmax of the selected
        scores ``q . l_j * scale`` (differentiable in both when ``learned``).
    """
    num_chunks = landmark_keys.shape[1]
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum(
        "BMD,BND->BMN", queries, landmark_keys, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    if not learned:
        scores = jax.lax.stop_gradient(scores)
    visible = (jnp.arange(num_chunks)[None, None, :] < query_chunks[..., None]) & valid[..., None]
    selection = jnp.where(visible, scores, -jnp.inf)
    if noise_rng is not None:
        selection = selection - jnp.log(jax.random.exponential(noise_rng, selection.shape))
    k = min(top_k, num_chunks)
    _, indices = jax.lax.top_k(jax.lax.stop_gradient(selection), k)
    chosen = jnp.take_along_axis(scores, indices, axis=-1)
    ok = jnp.take_along_axis(visible, indices, axis=-1)
    chosen = jnp.where(ok, chosen, 0.0)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(ok, chosen, -jnp.inf), axis=-1, keepdims=True))
    exps = jnp.where(ok, jnp.exp(chosen - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(exps, axis=-1, keepdims=True)
    weights = exps / jnp.where(total > 0, total, 1.0)
    indices = jnp.where(ok, indices, -1).astype(jnp.int32)
    if k < top_k:
        pad = ((0, 0), (0, 0), (0, top_k - k))
        indices = jnp.pad(indices, pad, constant_values=-1)
        weights = jnp.pad(weights, pad)
    return indices, weights


def _rows_take(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[b, index[b, ...]]`` for ``x [B, L, ...]`` and int ``index [B, ...]``."""
    flat = index.reshape(index.shape[0], -1)
    taken = jnp.take_along_axis(x, flat.reshape(flat.shape + (1,) * (x.ndim - 2)), axis=1)
    return taken.reshape(index.shape + x.shape[2:])


def _check_inputs(cfg: GCAConfig, tokens, positions, cache) -> None:
    if tokens is None or getattr(tokens, "ndim", None) != 2:
        raise ValueError(f"tokens must be int [B, T], got {getattr(tokens, 'shape', None)}")
    if positions.shape != tokens.shape:
        raise ValueError(
            f"tokens and positions must both be int [B, T]; got {tokens.shape=} {positions.shape=}"
        )
    for name, array in (("tokens", tokens), ("positions", positions)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must have an integer dtype, got {array.dtype}")
    if cache is not None and not isinstance(cache, GCACache):
        raise ValueError(
            f"cache must be None or a GCACache (model.init_cache), got {type(cache).__name__}"
        )
    if is_concrete(tokens):
        values = np.asarray(tokens)[np.asarray(positions) >= 0] if is_concrete(positions) else None
        if values is not None and values.size:
            if values.min() < 0 or values.max() >= cfg.vocab_size:
                raise ValueError(
                    f"token ids must lie in [0, vocab_size={cfg.vocab_size}); got min "
                    f"{values.min()} max {values.max()}"
                )
            if (values == cfg.landmark_id).any():
                raise ValueError(
                    f"text tokens must not be the landmark id {cfg.landmark_id}: the model "
                    "inserts landmarks itself"
                )
    if is_concrete(positions) and (cache is None or is_concrete(cache.stream_lengths)):
        start = np.zeros(tokens.shape[0], np.int64)
        if cache is not None:
            start = np.asarray(cache.text_lengths())
        for row, (row_positions, first) in enumerate(zip(np.asarray(positions), start)):
            real = row_positions[row_positions >= 0]
            expected = np.arange(first, first + real.size)
            if not np.array_equal(real, expected):
                where = "from 0" if cache is None else f"from the cache's next position {first}"
                raise ValueError(
                    f"positions of row {row} must run contiguously {where} (padding -1 "
                    f"anywhere); got {real.tolist()[:8]}{'...' if real.size > 8 else ''}"
                )
            if real.size and real[-1] >= cfg.max_len:
                raise ValueError(
                    f"positions must be below max_len {cfg.max_len}; got {real[-1]} in row {row}"
                )
    if cache is not None:
        cache.validate_append(tokens.shape[0], tokens.shape[1])


def _layer_handle(writer: StreamWriter | None, layers, layer: int) -> LayerCache | None:
    return None if writer is None else LayerCache(writer=writer, layers=layers, layer=layer)


def _write_memory(
    cfg: GCAConfig, cache: GCACache | None, stream: StreamLayout, new_memory, landmarks
):
    """The chunk memory (keys, values) and landmark keys with the call's chunks stored."""
    if cache is None:
        # Chunk j of the call is chunk j of the sequence (it starts at 0).
        return new_memory, landmarks
    rows = jnp.arange(landmarks.shape[0])[:, None]
    slot = jnp.where(stream.chunk_valid, stream.chunk_ids, cache.memory_keys.shape[1])
    stores = tuple(zip((cache.memory_keys, cache.memory_values), new_memory))
    if cfg.offload_memory:
        memory = tuple(host_put_rows(stored, slot, new) for stored, new in stores)
    else:
        memory = tuple(
            stored.at[rows, slot].set(new.astype(stored.dtype), mode="drop")
            for stored, new in stores
        )
    memory_landmarks = cache.landmark_keys.at[rows, slot].set(
        landmarks.astype(cache.landmark_keys.dtype), mode="drop"
    )
    return memory, memory_landmarks


def _retrieval_table(cfg, cache, stream: StreamLayout, group: int, indices, weights):
    """``(indices, weights)`` ``[B, 1 + M, top_k]``: row 0 the retrieval serving chunk
    ``first_chunk`` (made by the previous call, kept in the cache), then this call's."""
    batch = indices.shape[0]
    rows = jnp.arange(batch)[:, None]
    first_chunk = stream.first_chunk
    if cache is None:
        before = (
            jnp.full((batch, 1, cfg.top_k), -1, jnp.int32),
            jnp.zeros((batch, 1, cfg.top_k), jnp.float32),
        )
    else:
        held = jnp.mod(first_chunk - 1, 2)
        serves = cache.retrieval_chunks[rows[:, 0], held] == first_chunk - 1
        before_indices = cache.retrieval_indices[rows[:, 0], group, held]
        before = (
            jnp.where(serves[:, None], before_indices, -1)[:, None],
            cache.retrieval_weights[rows[:, 0], group, held][:, None],
        )
    return (
        jnp.concatenate([before[0], indices], axis=1),
        jnp.concatenate([before[1], weights], axis=1),
    )


def _compact_memory(memory, table, top_k: int):
    """Only the chunks ``table`` names, brought from the host to the device as a compact
    memory whose chunk ``r * top_k + k`` is the table's ``[r, k]``; the table re-indexed."""
    batch = table[0].shape[0]
    group_memory = tuple(host_take_rows(stored, table[0]) for stored in memory)
    group_memory = tuple(m.reshape(batch, -1, *m.shape[3:]) for m in group_memory)
    compact = jnp.arange(table[0].shape[1] * top_k, dtype=jnp.int32)
    compact = compact.reshape(table[0].shape[1:])
    return group_memory, (jnp.where(table[0] >= 0, compact, -1), table[1])


@register_model("gca", GCAConfig)
class GCA(nn.Module):
    """The Grouped Cross Attention causal LM (see the module docstring).

    ``__call__`` runs the parts in order: the stream layout (``stream_layout``), the
    lower decoder (``_lower``), the chunk encoder (``_encode_chunks``) and the memory
    write (``_write_memory``), the retrieval groups and upper layers (``_upper``), the
    logits (``_logits``). The parts are plain methods inside the one compact call, so
    every parameter keeps its path under the model (see the module docstring).

    Attributes:
        config: the model's ``GCAConfig``.
    """

    config: GCAConfig

    @nn.nowrap
    def init_cache(self, batch_size: int, max_len: int) -> GCACache:
        """An empty cache for up to ``max_len`` text tokens per sequence."""
        return init_gca_cache(self.config, batch_size, max_len)

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: GCACache | None = None,
        *,
        last_only: bool = False,
    ) -> tuple[jax.Array, GCACache | None]:
        """Runs the model on ``T`` new text tokens per sequence.

        Args:
            tokens: int32 ``[B, T]`` text token ids (never the landmark id).
            positions: int32 ``[B, T]``; -1 marks padding. Without a cache, each row's
                real positions are ``0 .. n - 1``; with one, they continue from
                ``cache.next_positions()``.
            cache: ``None`` or the ``GCACache`` the tokens are appended to.
            last_only: the logits of the last column only (``[B, 1, V]``).

        Returns:
            ``(logits float32 [B, T, V], cache)``.

        Raises:
            ValueError: malformed shapes; with concrete values, token ids outside the
                vocabulary or equal to the landmark id, positions that do not continue
                the sequence, or a cache that cannot take the tokens.
        """
        cfg = self.config
        refuse_sequence_axis("GCA")  # chunk retrieval reads every earlier chunk
        _check_inputs(cfg, tokens, positions, cache)
        positions = positions.astype(jnp.int32)
        stream = stream_layout(cfg, tokens, positions, cache)
        embed = Embed(
            cfg.vocab_size,
            cfg.embed_dim,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="embed",
        )
        x = nn.with_logical_constraint(embed.encode(stream.tokens), _RESIDUAL_AXES)

        writer = layers = None
        if cache is not None:
            writer = StreamWriter(
                slots=ring_slots(stream.positions, stream.end, cache.ring_size),
                positions=cache.window_positions,
                new_positions=stream.positions,
            )
            layers = (cache.window_keys, cache.window_values)
        lower_out, layers = self._lower(x, stream, writer, layers)
        keys, values, landmarks = self._encode_chunks(lower_out, stream, cache)
        memory, memory_landmarks = _write_memory(cfg, cache, stream, (keys, values), landmarks)
        x, layers, fresh = self._upper(
            lower_out, stream, cache, writer, layers, memory, memory_landmarks
        )
        text_entries = jnp.where(positions >= 0, stream.text_index, 0)
        logits = self._logits(x, embed, text_entries[:, -1:] if last_only else text_entries)
        if cache is None:
            return logits, None

        fits = cache.can_append(tokens.shape[1])
        logits = jnp.where(fits[:, None, None], logits, jnp.nan)
        return logits, cache_after_call(
            cache, stream, layers, lower_out, positions, memory, memory_landmarks, fresh
        )

    @nn.nowrap
    def _lower(self, x, stream: StreamLayout, writer: StreamWriter | None, layers):
        """The lower decoder over the stream; returns its output and the window rings."""
        for layer in range(self.config.lower_layers):
            x, layer_cache = LowerBlock(self.config, name=f"lower_{layer}")(
                x, stream.positions, _layer_handle(writer, layers, layer)
            )
            layers = None if layer_cache is None else layer_cache.layers
        return x, layers

    @nn.nowrap
    def _encode_chunks(self, x, stream: StreamLayout, cache: GCACache | None):
        """Encodes the completed chunks from the lower outputs ``x`` (earlier entries of
        the current chunk come from the cache).

        Returns:
            ``(keys, values, landmark_keys)``: ``[B, M, S, K, H]`` for the chunk memory
            (the landmark slot zeroed) and ``[B, M, D]``.
        """
        cfg, size = self.config, self.config.chunk_size
        start = stream.start
        chunk_positions = stream.chunk_ids[..., None] * size + jnp.arange(size, dtype=jnp.int32)
        if cache is None:
            source, source_index = x, chunk_positions - start[:, None, None]
        else:
            history = cache.hidden.shape[1]
            source = jnp.concatenate([cache.hidden.astype(x.dtype), x], axis=1)
            source_index = jnp.where(
                chunk_positions >= start[:, None, None],
                history + chunk_positions - start[:, None, None],
                jnp.mod(chunk_positions, history),
            )
        source_index = jnp.clip(source_index, 0, source.shape[1] - 1)
        chunk_hidden = _rows_take(source, source_index)  # [B, M, S, D]
        encoded = ChunkEncoder(cfg, name="encoder")(
            _norm(cfg, "enc_prenorm")(chunk_hidden).reshape(-1, size, cfg.embed_dim)
        ).reshape(chunk_hidden.shape)
        landmark_keys = encoded[:, :, -1]
        if cfg.retriever == "mean_pool":  # the chunk's text tokens, pooled, unit length
            pooled = jnp.mean(chunk_hidden[:, :, :-1].astype(jnp.float32), axis=2)
            norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
            pooled = pooled / jnp.maximum(norm, 1e-6)
            landmark_keys = jax.lax.stop_gradient(pooled).astype(landmark_keys.dtype)

        def chunk_projection(name):
            projected = Einsum(
                shape=(cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim),
                logical_axes=("embed", "kv_heads", "kv"),
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                name=name,
            )("BMSD,DKH->BMSKH", encoded)
            keep = (jnp.arange(size) < size - 1)[None, None, :, None, None]
            return jnp.where(keep, projected, 0)  # the landmark slot: the softmax's "+1"

        return chunk_projection("chunk_key"), chunk_projection("chunk_value"), landmark_keys

    @nn.nowrap
    def _upper(self, x, stream: StreamLayout, cache, writer, layers, memory, memory_landmarks):
        """The retrieval groups, each followed by its upper layers.

        Returns:
            ``(x, layers, fresh)``: the output ``[B, T'', D]`` (``T''``: the stream padded
            to whole chunks without a cache), the window rings and the call's retrieval
            ``(indices, weights)`` of each group.
        """
        cfg, size = self.config, self.config.chunk_size
        batch, buffer_len = stream.positions.shape
        # GCA layout: whole chunks when the call starts at chunk 0 (a plain forward
        # pass), else one query chunk per entry. The retrieval serving chunk i is row
        # i - first_chunk of a table whose row 0 is the cached one (chunk first_chunk - 1).
        grid = cache is None
        padded_len = -(-buffer_len // size) * size if grid else buffer_len
        entry_positions = jnp.pad(
            stream.positions, ((0, 0), (0, padded_len - buffer_len)), constant_values=-1
        )
        if grid:
            table_rows = jnp.broadcast_to(
                jnp.arange(padded_len // size), (batch, padded_len // size)
            )
        else:
            table_rows = entry_positions // size - stream.first_chunk[:, None]
        table_rows = jnp.clip(table_rows, 0, stream.chunk_ids.shape[1])
        x = jnp.pad(x, ((0, 0), (0, padded_len - buffer_len), (0, 0)))
        noise_rng = self.make_rng("train") if self.has_rng("train") else None

        fresh = []
        layer = cfg.lower_layers
        for group, num_layers in enumerate(cfg.upper_layers):
            if cfg.retriever == "mean_pool":  # the closing chunk's own pooled key
                closing = jnp.clip(stream.chunk_ids, 0, memory_landmarks.shape[1] - 1)
                queries, scale = _rows_take(memory_landmarks, closing), 1 / MEAN_POOL_TEMPERATURE
            else:
                queries = _rows_take(x, stream.landmark_entry)
                queries, scale = _norm(cfg, f"landmark_norm_{group}")(queries), None
            rng = None if noise_rng is None else jax.random.fold_in(noise_rng, group)
            indices, weights = retrieve(
                queries,
                memory_landmarks,
                stream.chunk_ids,
                stream.chunk_valid,
                top_k=cfg.top_k,
                noise_rng=rng,
                scale=scale,
                learned=cfg.retriever == "learned",
            )
            fresh.append((indices, weights))
            table = _retrieval_table(cfg, cache, stream, group, indices, weights)
            group_memory = memory
            if cache is not None and cfg.offload_memory:
                group_memory, table = _compact_memory(memory, table, cfg.top_k)
            retrieval = tuple(_rows_take(part, table_rows) for part in table)
            for index in range(num_layers):
                x, layer_cache = UpperBlock(cfg, name=f"upper_{group}_{index}")(
                    x,
                    entry_positions,
                    _layer_handle(writer, layers, layer),
                    group_memory,
                    retrieval,
                    grid=grid,
                )
                layers = None if layer_cache is None else layer_cache.layers
                layer += 1
        return x, layers, fresh

    @nn.nowrap
    def _logits(self, x, embed: Embed, text_entries):
        """float32 ``[B, T, V]`` logits of the stream entries ``text_entries`` ``[B, T]``."""
        cfg = self.config
        x = _rows_take(x, text_entries)
        x = _norm(cfg, "final_norm")(x)
        logits = output_logits(embed, x, tie=cfg.tie_embeddings)
        # The landmark is never a text token: it gets no probability.
        is_landmark = jnp.arange(cfg.vocab_size) == cfg.landmark_id
        logits = jnp.where(is_landmark, jnp.finfo(jnp.float32).min, logits)
        return nn.with_logical_constraint(logits, ("act_batch", "act_len", "act_vocab"))


def init_params(config: GCAConfig, rng: jax.Array):
    """Randomly initialised parameters (unboxed), for tests and training from scratch."""
    return nn.meta.unbox(_init_params_jit(config, rng))


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(config: GCAConfig, rng: jax.Array):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return GCA(config).init(rng, tokens, tokens)["params"]


def gca_from_config(model_config) -> GCA:
    """``GCA`` from a ConfigDict of ``GCAConfig`` fields (``build_model("gca", ...)``; the
    factory path ``"lhc.gca:gca_from_config"`` that runs recorded before the model
    registry name in their ``config.json``).

    Raises:
        ValueError: naming ``config.model``, for a field unknown to ``GCAConfig``.
    """
    return build_model(GCA, model_config)
