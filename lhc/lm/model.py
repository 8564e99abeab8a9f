"""The decoder-only Transformer (Llama / Qwen2 / Mistral / Gemma 3 layouts) and its
causal-LM protocol.

``logits, cache = model.apply({"params": params}, tokens, positions, cache)``:

* ``tokens``, ``positions``: int32 ``[B, T]``. A token whose position is negative is
  padding: it is never attended to and its logits are meaningless. Left-padded batches
  give each prompt positions ``0 .. len-1`` in its last ``len`` columns and ``-1`` before.
* ``cache=None``: a plain (training) forward pass; the returned cache is ``None``.
* ``cache``: any cache of the protocol in ``lhc.lm.cache`` (``KVCache``,
  ``SlidingWindowKVCache``, or another implementation of its per-layer interface); the
  ``T`` tokens are appended and attend to what the cache holds; the updated cache is
  returned.
* ``logits``: float32 ``[B, T, V]`` (``[B, 1, V]``, the last column only, with
  ``last_only=True``: the last prompt token of a left-padded prompt).

Keyword inputs: ``embeddings`` float ``[B, T, D]`` replace the token embeddings (all of
them, with ``tokens=None``, or where ``embedding_mask`` ``[B, T]`` is set, interleaved
with token ids: image patches inside a text prompt); ``intervention`` (an
``lhc.nn.Intervention``) edits the residual stream or the attention output of chosen
layers and tokens. ``mutable=["intermediates"]`` records, per layer, the residual stream
after the block (``residual``) and the attention output (``attention_out``), both after any
intervention.

Parameter tree (``scan_layers=False``)::

    embed/embedding                         [V, D]
    layers_{i}/attention_norm/scale         [D]
    layers_{i}/attention/{query,key,value}/kernel  [D, N|K, H]  (+ bias [N|K, H])
    layers_{i}/attention/out/kernel         [N, H, D]
    layers_{i}/mlp_norm/scale               [D]
    layers_{i}/mlp/{gate,up}/kernel         [D, F]  (up only with mlp_type="gelu")
    layers_{i}/mlp/down/kernel              [F, D]
    final_norm/scale                        [D]
    lm_head/kernel                          [D, V]  (untied only)

Gemma 3 (``qk_norm``, ``post_norms``) adds ``layers_{i}/attention/{query,key}_norm/scale``
``[H]`` and ``layers_{i}/{post_attention,post_mlp}_norm/scale`` ``[D]``.

With ``scan_layers=True`` the ``layers_{i}`` subtrees become one ``layers`` subtree whose
leaves have a leading ``[L]`` axis; a model whose layers' windows differ (Gemma 3's five
local layers to one global) is scanned in groups of one period ``P``
(``config.layer_period``): ``layers/block_{j}`` with a leading ``[L // P]`` axis (layer
``g P + j`` at ``g``), the last ``L % P`` layers kept as ``layers_{i}``.
``stack_layer_params`` / ``unstack_layer_params`` convert between the layouts.
``switch_layers=True`` keeps the ``layers_{i}`` tree and runs it as one scanned block (or
group) that picks each layer's arrays by ``lax.switch`` (``lhc.nn.apply_switched``).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.lm.cache import (
    Cache,
    KVCache,
    SlidingWindowKVCache,
    init_cache,
    init_sliding_window_cache,
    is_concrete,
)
from lhc.lm.config import LMConfig
from lhc.lm.hybrid_cache import HybridKVCache, check_hybrid_cache, init_hybrid_cache
from lhc.lm.packing import PackedWriter
from lhc.nn.attention import Attention, LayerCache
from lhc.nn.config import register_model
from lhc.nn.intervention import Intervention, apply_edit
from lhc.nn.linear import Embed, output_logits
from lhc.nn.losses import chunked_token_nll
from lhc.nn.mlp import GeGLU, GeluMLP, SwiGLU
from lhc.nn.norms import LayerNorm, RMSNorm
from lhc.nn.remat import remat_policy
from lhc.nn.switch import apply_switched

_RESIDUAL_AXES = ("act_batch", "act_len", "act_emb")


def norm_layer(config: LMConfig, name: str) -> nn.Module:
    """The config's norm (``RMSNorm`` or bias-free ``LayerNorm``), named ``name``."""
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    if config.norm_type == "layernorm":
        return LayerNorm(epsilon=config.norm_eps, dtype=dtype, param_dtype=param_dtype, name=name)
    return RMSNorm(
        epsilon=config.norm_eps,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_offset=config.norm_scale_offset,
        name=name,
    )


def residual_dropout(module: nn.Module, config: LMConfig, x: jax.Array) -> jax.Array:
    """``x`` with nanoGPT's residual dropout, drawn from the ``"train"`` rng stream when
    the call has one (training) and the identity otherwise."""
    if not config.dropout_rate:
        return x
    return nn.Dropout(config.dropout_rate, rng_collection="train")(
        x, deterministic=not module.has_rng("train")
    )


# A sliding-window model's ring keeps this many tokens beyond its window, so that
# speculative rollback and prefill chunks of up to this many tokens stay exact.
RING_HEADROOM = 128


class Block(nn.Module):
    """Pre-norm Transformer block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    The call signature ``(carry, *per_call_inputs) -> (carry, None)`` is the scan
    signature of ``nn.scan``: the carry is the residual stream and the cache's stacked
    per-layer storage, which each block updates in place for its own layer.

    Attributes:
        config: the model's config.
        window: this layer's attention window (``None``: full causal attention).
    """

    config: LMConfig
    window: int | None = None

    @nn.compact
    def __call__(
        self,
        carry: tuple[jax.Array, Any],
        positions: jax.Array,
        writer: Any,
        probe: jax.Array | None,
        intervention: Intervention | None,
        layer: int | jax.Array,
    ) -> tuple[tuple[jax.Array, Any], None]:
        """One block.

        Args:
            carry: ``(x, layers)``: ``x`` ``[B, T, D]``, the residual stream, and the
                cache's per-layer storage stacked over layers (``None`` without a cache).
            positions: int32 ``[B, T]``.
            writer: the cache's writer for this call (``None`` without a cache).
            probe: ``None`` or int ``[B, Q]``: queries whose attention probabilities
                are sown (``lhc.nn.Attention``).
            intervention: this layer's slice of an ``Intervention``, or ``None``.
            layer: this block's index into the stacked storage.

        Returns:
            ``((x, layers), None)``.
        """
        x, layers = carry
        cfg = self.config
        # The residual stream entering each block: a forward pass can restart here
        # (``Transformer(..., start_layer=l)``).
        self.sow("intermediates", "layer_input", x)
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        norm = functools.partial(norm_layer, cfg)
        cache, part = None, None
        if writer is not None:
            part_writer, part, index = _layer_part(writer, layer, self.window)
            storage = layers if part is None else layers[part]
            cache = LayerCache(writer=part_writer, layers=storage, layer=index)
        local_rope = cfg.local_rope_theta is not None and self.window is not None
        attended, cache = Attention(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rope_theta=cfg.local_rope_theta if local_rope else cfg.rope_theta,
            rope_scaling=None if local_rope else cfg.rope_scaling,
            qkv_bias=cfg.qkv_bias,
            attention_impl=cfg.attention_impl,
            window=self.window,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_layout=cfg.kernel_layout,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            norm_scale_offset=cfg.norm_scale_offset,
            query_scale=cfg.query_scale,
            name="attention",
        )(norm(name="attention_norm")(x), positions, cache, probe)
        if cfg.post_norms:
            attended = norm(name="post_attention_norm")(attended)
        edits = intervention if intervention is not None else Intervention()
        attended = apply_edit(edits.attention, residual_dropout(self, cfg, attended))
        self.sow("intermediates", "attention_out", attended)
        x = nn.with_logical_constraint(x + attended, _RESIDUAL_AXES)
        mlp_class = {"gelu": GeluMLP, "geglu": GeGLU}.get(cfg.mlp_type, SwiGLU)
        mlp_out = mlp_class(
            cfg.mlp_dim,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_layout=cfg.kernel_layout,
            name="mlp",
        )(norm(name="mlp_norm")(x))
        if cfg.post_norms:
            mlp_out = norm(name="post_mlp_norm")(mlp_out)
        mlp_out = residual_dropout(self, cfg, mlp_out)
        x = nn.with_logical_constraint(x + mlp_out, _RESIDUAL_AXES)
        x = apply_edit(edits.residual, x)
        # Residual stream after each block, for probing and task vectors:
        # model.apply(..., mutable=["intermediates"]).
        self.sow("intermediates", "residual", x)
        if cache is not None:
            layers = cache.layers if part is None else _replace_part(layers, part, cache.layers)
        return (x, layers), None


def _layer_part(writer, layer, window):
    """``(writer, part, index)`` that serve ``layer``: a cache that keeps the layers of
    each window apart (``HybridKVCache``) names the part of its storage and the layer's
    index there; any other serves every layer itself (``part`` None)."""
    if hasattr(writer, "part"):
        return writer.part(layer, window)
    return writer, None, layer


def _replace_part(layers, part, storage):
    return tuple(storage if i == part else old for i, old in enumerate(layers))


class BlockGroup(nn.Module):
    """One period of the layer pattern (Gemma 3: five local blocks and a global one),
    the unit that ``nn.scan`` repeats over a model whose layers' windows differ.

    Attributes:
        config: the model's config.
        windows: the window of each block of the group.
    """

    config: LMConfig
    windows: tuple[int | None, ...]

    @nn.compact
    def __call__(self, carry, positions, writer, probe, intervention, group):
        """``Block.__call__``'s, for the group's blocks in order; ``group`` is the
        group's index, so its block ``j`` is layer ``group * P + j``."""
        block_class = _block_class(self.config)
        period = len(self.windows)
        for j, window in enumerate(self.windows):
            layer = group * period + j
            edits = None if intervention is None else intervention.layer(layer)
            carry, _ = block_class(self.config, window=window, name=f"block_{j}")(
                carry, positions, writer, probe, edits, layer
            )
        return carry, None


def _switched_layers(model: nn.Module, carry, positions, writer, intervention):
    """``model``'s groups of one period (its layers with ``period == 1``) as one scanned
    ``BlockGroup`` whose parameters, an array per layer, are chosen by
    ``lhc.nn.apply_switched``: layer ``g P + j`` is block ``j`` of group ``g``."""
    cfg = model.config
    params, period = model.variables["params"], cfg.layer_period
    groups = cfg.num_layers // period
    trees = [
        {f"block_{j}": params[f"layers_{g * period + j}"] for j in range(period)}
        for g in range(groups)
    ]
    group_module = BlockGroup(cfg, tuple(cfg.layer_window(j) for j in range(period)))

    def body(carry, group):
        return apply_switched(
            group_module, trees, group, carry, positions, writer, None, intervention, group
        )

    return jax.lax.scan(body, carry, jnp.arange(groups, dtype=jnp.int32))[0]


def _block_class(config: LMConfig):
    if config.remat_policy == "none":
        return Block
    # Inside nn.scan the loop already prevents CSE across iterations; outside, keep
    # prevent_cse so XLA does not merge the recomputation with the forward pass.
    return nn.remat(
        Block, policy=remat_policy(config.remat_policy), prevent_cse=not config.scan_layers
    )


def _check_concrete_ids(config: LMConfig, tokens, positions) -> None:
    if tokens is not None and is_concrete(tokens):
        tokens_np = np.asarray(tokens)
        if tokens_np.size and (tokens_np.min() < 0 or tokens_np.max() >= config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={config.vocab_size}); got min "
                f"{tokens_np.min()} max {tokens_np.max()}"
            )
    if is_concrete(positions):
        positions_np = np.asarray(positions)
        if positions_np.size and positions_np.max() >= config.max_len:
            raise ValueError(
                f"positions must be below max_len {config.max_len}; got max {positions_np.max()}"
            )


def _check_cache(config: LMConfig, cache, batch_size: int, length: int) -> None:
    if not isinstance(cache, Cache) or not hasattr(cache, "begin_update"):
        raise ValueError(
            "cache must be None or a cache of the protocol in lhc.lm.cache with the "
            f"per-layer interface (begin_update / finish_update); got {type(cache).__name__}"
        )
    if isinstance(cache, (KVCache, SlidingWindowKVCache)):
        expected = (config.num_kv_heads, config.head_dim)
        if cache.num_layers != config.num_layers or cache.head_shape != expected:
            raise ValueError(
                f"cache keys/values must be [L, B, K, S, H] with L={config.num_layers}, "
                f"(K, H)={expected}; got {cache.shape}"
            )
    if isinstance(cache, HybridKVCache):
        check_hybrid_cache(cache, config)
    if isinstance(cache, SlidingWindowKVCache):
        if config.sliding_window is None or config.full_attention_layers:
            raise ValueError(
                "a SlidingWindowKVCache needs a model whose layers all attend within a "
                f"window; this one has sliding_window={config.sliding_window}, "
                f"full_attention_layers={config.full_attention_layers}"
            )
        if cache.window < config.sliding_window:
            raise ValueError(
                f"the cache serves a window of {cache.window} tokens, the model attends "
                f"within {config.sliding_window}"
            )
    cache.validate_append(batch_size, length)


def _check_start(config: LMConfig, tokens, positions, embeddings, start_layer, probe) -> None:
    traced = isinstance(start_layer, jax.Array)
    if traced:
        if start_layer.ndim or not jnp.issubdtype(start_layer.dtype, jnp.integer):
            raise ValueError(
                f"start_layer must be an int or an int scalar array, got {start_layer.dtype} "
                f"{start_layer.shape}"
            )
    elif isinstance(start_layer, bool) or not isinstance(start_layer, int):
        raise ValueError(f"start_layer must be an int, got {start_layer!r}")
    if is_concrete(start_layer) and not 0 <= int(start_layer) < config.num_layers:
        raise ValueError(
            f"start_layer must be in [0, num_layers={config.num_layers}), got {start_layer}"
        )
    if (traced or start_layer) and (tokens is not None or embeddings is None):
        raise ValueError(
            "start_layer > 0 runs from the residual stream entering that layer: give it as "
            "embeddings, with tokens=None"
        )
    if (traced or start_layer) and config.scan_layers:
        raise ValueError(
            "start_layer > 0 needs a model that loops over its layers (scan_layers=False; "
            "lhc.lm.unstack_layer_params converts scanned parameters)"
        )
    _check_columns("probe", probe, positions)


def _check_columns(name: str, columns, positions) -> None:
    """``columns``: ``None`` or int ``[B, Q]`` indices into the ``T`` columns of ``positions``."""
    if columns is None:
        return
    if (
        columns.ndim != 2
        or columns.shape[0] != positions.shape[0]
        or not jnp.issubdtype(columns.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{name} must be int [B, Q] with B={positions.shape[0]}, got {columns.shape} "
            f"{columns.dtype}"
        )
    if is_concrete(columns):
        values = np.asarray(columns)
        if values.size and (values.min() < 0 or values.max() >= positions.shape[1]):
            raise ValueError(
                f"{name} indices must lie in [0, T={positions.shape[1]}), got min {values.min()} "
                f"max {values.max()}"
            )


def _check_inputs(
    config: LMConfig, tokens, positions, cache, embeddings, embedding_mask, intervention
) -> None:
    if positions.ndim != 2 or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be int [B, T]; got {positions.shape=} {positions.dtype=}")
    if tokens is None:
        if embeddings is None:
            raise ValueError("give tokens, embeddings, or both (with an embedding_mask)")
    elif tokens.shape != positions.shape or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens and positions must both be int [B, T]; got {tokens.shape=} "
            f"{positions.shape=} {tokens.dtype=}"
        )
    batch_size, length = positions.shape
    if (embedding_mask is not None) != (tokens is not None and embeddings is not None):
        raise ValueError(
            "embedding_mask [B, T] chooses between tokens and embeddings: give it exactly when "
            f"both are given (tokens: {tokens is not None}, embeddings: "
            f"{embeddings is not None}, embedding_mask: {embedding_mask is not None})"
        )
    if embeddings is not None:
        expected = (batch_size, length, config.embed_dim)
        if embeddings.shape != expected or not jnp.issubdtype(embeddings.dtype, jnp.floating):
            raise ValueError(
                f"embeddings must be float [B, T, D] = {expected}; got {embeddings.shape=} "
                f"{embeddings.dtype=}"
            )
    if embedding_mask is not None and embedding_mask.shape != (batch_size, length):
        raise ValueError(f"{embedding_mask.shape=} must be {(batch_size, length)}")
    if length > config.max_len:
        raise ValueError(
            f"input length {length} exceeds the model's max_len {config.max_len} "
            f"(positions {positions.shape})"
        )
    _check_concrete_ids(config, tokens, positions)
    if intervention is not None:
        if not isinstance(intervention, Intervention):
            raise ValueError(
                f"intervention must be an lhc.nn.Intervention, got {type(intervention).__name__}"
            )
        if intervention.num_layers not in (0, config.num_layers):
            raise ValueError(
                f"the intervention covers {intervention.num_layers} layers, the model has "
                f"{config.num_layers}"
            )
    if cache is not None:
        _check_cache(config, cache, batch_size, length)


@register_model("transformer", LMConfig)
class Transformer(nn.Module):
    """Decoder-only causal LM following the protocol in this module's docstring.

    Attributes:
        config: the model's ``LMConfig``.
    """

    config: LMConfig

    @nn.nowrap
    def init_cache(self, batch_size: int, max_len: int) -> Cache:
        """An empty cache for up to ``max_len`` tokens per sequence (works unbound).

        Where ``window + RING_HEADROOM`` slots are fewer than ``max_len``, a model whose
        layers all attend within a sliding window gets a ``SlidingWindowKVCache`` of that
        many, and a model that mixes windowed and full layers (Gemma 3) a
        ``HybridKVCache``: rings in the windowed layers, ``max_len`` slots in the others.
        Otherwise a ``KVCache`` of ``max_len`` slots.
        """
        cfg = self.config
        window = cfg.sliding_window
        if window is not None:
            if not 0 < max_len <= cfg.max_len:
                raise ValueError(
                    f"init_cache: max_len must be in [1, config.max_len={cfg.max_len}], "
                    f"got {max_len}"
                )
            ring = window + RING_HEADROOM
            if max_len > ring and cfg.full_attention_layers:
                return init_hybrid_cache(cfg, batch_size, max_len, ring)
            if max_len > ring:
                return init_sliding_window_cache(cfg, batch_size, window, ring)
        return init_cache(cfg, batch_size, max_len)

    def _switches(self, cache, probe, start_layer) -> bool:
        """Whether this call runs its layers through ``_switched_layers``."""
        cfg = self.config
        return (
            cfg.switch_layers
            and not self.is_initializing()
            and not (cfg.dropout_rate and self.has_rng("train"))
            and probe is None
            and not isinstance(start_layer, jax.Array)
            and not start_layer
            and not self.is_mutable_collection("intermediates")
            and (cache is None or getattr(cache, "stacked_layers", False))
        )

    def _target_nll(self, embed, x, targets, chunk):
        """``(nll, hit)`` of ``targets`` (see ``__call__``), from the head's weight."""
        cfg = self.config
        if cfg.tie_embeddings:
            weight, outputs_first = embed.embedding, True
        else:
            head = self.variables["params"]["lm_head"]
            if "lora_a" in head:
                raise ValueError(
                    "targets: the chunked loss multiplies by the head's kernel alone; "
                    "adapters on lm_head need the full logits (loss_chunk=0 in the task)"
                )
            weight, outputs_first = head["kernel"], cfg.kernel_layout == "out_in"
        return chunked_token_nll(
            x, weight, targets, outputs_first=outputs_first, chunk=chunk, dtype=cfg.dtype
        )

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array | None,
        positions: jax.Array,
        cache: Cache | None = None,
        *,
        embeddings: jax.Array | None = None,
        embedding_mask: jax.Array | None = None,
        intervention: Intervention | None = None,
        last_only: bool = False,
        start_layer: int | jax.Array = 0,
        probe: jax.Array | None = None,
        logits_at: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        targets: jax.Array | None = None,
        loss_chunk: int = 1024,
    ) -> tuple[jax.Array, Cache | None]:
        """Runs the model on ``T`` new tokens per sequence.

        Args:
            tokens: int32 ``[B, T]``, or ``None`` when ``embeddings`` give every input.
            positions: int32 ``[B, T]``; negative marks padding.
            cache: ``None`` or the cache the tokens are appended to.
            embeddings: float ``[B, T, D]`` input embeddings (see the module docstring).
            embedding_mask: bool ``[B, T]``: where set, ``embeddings`` replace the
                embeddings of ``tokens``.
            intervention: edits of activations (``lhc.nn.Intervention``).
            last_only: compute the logits of the last column only (``[B, 1, V]``).
            start_layer: run layers ``start_layer ..`` only, from ``embeddings`` (with
                ``tokens=None``): the residual stream entering that layer, as sown in
                ``intermediates`` / ``layer_input`` by an earlier call. Layers below
                are skipped, so a cache given here receives this call's keys in layers
                ``>= start_layer`` only: attend to it, do not decode on with the
                returned cache. Needs ``scan_layers=False`` (``unstack_layer_params``
                converts the parameters). An int scalar array (traced under ``jit``)
                gives one compiled program for every start: each layer runs under a
                ``lax.cond`` (intermediates cannot be collected then).
            probe: ``None`` or int ``[B, Q]`` indices into ``T``: each layer sows the
                attention probabilities of those queries (``intermediates`` /
                ``attention_probs``, float32 ``[B, N, Q, S]``, over the cache's keys
                then this call's; see ``lhc.nn.KVView.probabilities``).
            logits_at: ``None`` or int ``[B, Q]`` indices into ``T``: compute the logits
                of those columns only (``[B, Q, V]``; scoring a few answer tokens of
                long rows).
            segment_ids: ``None`` or int32 ``[B, T]``, without a cache: rows that pack
                several documents, each token attending only to those with its id
                (``lhc.lm.packing``; ``attention_impl="xla"``).
            targets: ``None`` or int ``[B, T]``, without a cache: instead of the logits,
                return ``(nll, hit)``, each token's float32 negative log-likelihood of
                its target and whether the target is the argmax, the head applied
                ``loss_chunk`` positions at a time (``lhc.nn.losses``: no ``[B, T, V]``
                logits are held, in training either).

        Returns:
            ``(logits, cache)``: float32 ``[B, T, V]`` and the updated cache (``None`` if
            none was given).

        Raises:
            ValueError: malformed shapes, ``T > max_len``, or (with concrete values) a
                cache that would overflow, token ids outside the vocabulary, positions
                ``>= max_len``. Under ``jit``, where lengths are not known, a sequence
                that overflows its cache gets NaN logits.
        """
        # Long for its docstring (every argument's contract); the body, about 85 lines,
        # is the forward pass in order: checks, embeddings, the layers (scanned, looped,
        # or restarted under lax.cond), the final norm and the logits.
        cfg = self.config
        _check_inputs(cfg, tokens, positions, cache, embeddings, embedding_mask, intervention)
        _check_start(cfg, tokens, positions, embeddings, start_layer, probe)
        _check_columns("logits_at", logits_at, positions)
        if last_only and logits_at is not None:
            raise ValueError("give last_only or logits_at, not both")
        positions = positions.astype(jnp.int32)
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)

        embed = Embed(
            cfg.vocab_size,
            cfg.embed_dim,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_first_decode=cfg.kernel_layout == "out_in",
            name="embed",
        )
        if tokens is not None:
            x = embed.encode(tokens.astype(jnp.int32))
            if cfg.embed_scale:
                x = x * jnp.asarray(cfg.embed_dim**0.5, x.dtype)
        if embeddings is not None:
            given = embeddings.astype(dtype)
            x = given if tokens is None else jnp.where(embedding_mask[..., None], given, x)
        x = nn.with_logical_constraint(residual_dropout(self, cfg, x), _RESIDUAL_AXES)

        writer, layers = (None, None) if cache is None else cache.begin_update(positions)
        if segment_ids is not None:
            if cache is not None or segment_ids.shape != positions.shape:
                raise ValueError(
                    f"segment_ids: expected int [B, T] = {tuple(positions.shape)} and no cache, "
                    f"got shape {tuple(segment_ids.shape)} and cache {type(cache).__name__}"
                )
            writer = PackedWriter(positions, segment_ids.astype(jnp.int32))
        block_class = _block_class(cfg)
        period = cfg.layer_period
        rest = range(cfg.num_layers // period * period, cfg.num_layers)  # after the groups
        if self._switches(cache, probe, start_layer):
            x, layers = _switched_layers(self, (x, layers), positions, writer, intervention)
        elif cfg.scan_layers and period == 1:
            (x, layers), _ = nn.scan(
                block_class,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "train": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, 0),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, window=cfg.sliding_window, name="layers")(
                (x, layers),
                positions,
                writer,
                probe,
                intervention,
                jnp.arange(cfg.num_layers, dtype=jnp.int32),
            )
        elif cfg.scan_layers:
            # Groups of one period scanned (one compiled group), the rest in a loop.
            groups = cfg.num_layers // period
            (x, layers), _ = nn.scan(
                BlockGroup,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "train": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=groups,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, tuple(cfg.layer_window(j) for j in range(period)), name="layers")(
                (x, layers),
                positions,
                writer,
                probe,
                intervention,
                jnp.arange(groups, dtype=jnp.int32),
            )
        else:
            rest = range(0)
            # A traced start_layer: every layer is compiled, those below it are skipped
            # at run time (one program serves every start).
            traced = isinstance(start_layer, jax.Array)
            if traced and self.is_mutable_collection("intermediates"):
                raise ValueError(
                    "start_layer as an array skips layers at run time and sows nothing: "
                    "collect intermediates with an int start_layer"
                )
            for layer in range(0 if traced else start_layer, cfg.num_layers):
                block = block_class(cfg, window=cfg.layer_window(layer), name=f"layers_{layer}")
                args = (
                    positions,
                    writer,
                    probe,
                    None if intervention is None else intervention.layer(layer),
                    layer,
                )
                if traced:
                    x, layers = nn.cond(
                        layer >= start_layer,
                        lambda mdl, carry, args=args: mdl(carry, *args)[0],
                        lambda mdl, carry: carry,
                        block,
                        (x, layers),
                    )
                else:
                    (x, layers), _ = block((x, layers), *args)
        for layer in rest:
            block = block_class(cfg, window=cfg.layer_window(layer), name=f"layers_{layer}")
            edits = None if intervention is None else intervention.layer(layer)
            (x, layers), _ = block((x, layers), positions, writer, probe, edits, layer)

        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, :, None], axis=1)
        x = norm_layer(cfg, "final_norm")(x)
        if targets is not None:
            if cache is not None:
                raise ValueError("targets: the per-token loss is computed without a cache")
            return self._target_nll(embed, x, targets, loss_chunk), None
        logits = output_logits(embed, x, tie=cfg.tie_embeddings, kernel_layout=cfg.kernel_layout)
        logits = nn.with_logical_constraint(logits, ("act_batch", "act_len", "act_vocab"))

        if cache is None:
            return logits, None
        # Under jit the checks above cannot see the lengths, and writes past the end are
        # dropped. A sequence that overflowed gets NaN logits instead of wrong ones.
        fits = cache.can_append(positions.shape[1])
        logits = jnp.where(fits[:, None, None], logits, jnp.nan)
        return logits, cache.finish_update(writer, layers)
