"""The decoder-only Transformer (Llama / Qwen2 layout) and its causal-LM protocol.

``logits, cache = model.apply({"params": params}, tokens, positions, cache)``:

* ``tokens``, ``positions``: int32 ``[B, T]``. A token whose position is negative is
  padding: it is never attended to and its logits are meaningless. Left-padded batches
  give each prompt positions ``0 .. len-1`` in its last ``len`` columns and ``-1`` before.
* ``cache=None``: a plain (training) forward pass; the returned cache is ``None``.
* ``cache``: a ``KVCache`` (from ``init_cache`` or ``model.init_cache``); the ``T``
  tokens are appended at each sequence's own length and attend to everything cached
  before them; the updated cache is returned.
* ``logits``: float32 ``[B, T, V]``.

Parameter tree (``scan_layers=False``)::

    embed/embedding                         [V, D]
    layers_{i}/attention_norm/scale         [D]
    layers_{i}/attention/{query,key,value}/kernel  [D, N|K, H]  (+ bias [N|K, H])
    layers_{i}/attention/out/kernel         [N, H, D]
    layers_{i}/mlp_norm/scale               [D]
    layers_{i}/mlp/{gate,up}/kernel         [D, F]
    layers_{i}/mlp/down/kernel              [F, D]
    final_norm/scale                        [D]
    lm_head/kernel                          [D, V]  (untied only)

With ``scan_layers=True`` the ``layers_{i}`` subtrees become one ``layers`` subtree whose
leaves have a leading ``[L]`` axis; ``stack_layer_params`` / ``unstack_layer_params``
convert between the two.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.lm.cache import KVCache, init_cache
from lhc.lm.config import LMConfig
from lhc.nn.attention import Attention, write_slots
from lhc.nn.linear import Einsum, Embed
from lhc.nn.mlp import SwiGLU
from lhc.nn.norms import RMSNorm
from lhc.nn.remat import remat_policy

_RESIDUAL_AXES = ("act_batch", "act_len", "act_emb")


class Block(nn.Module):
    """Pre-norm Transformer block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    The call signature ``(x, *per_layer_inputs) -> (x, per_layer_outputs)`` is the
    carry/scan signature of ``nn.scan``.
    """

    config: LMConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        key_positions: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array] | None,
        write_index: jax.Array | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """One block.

        Args:
            x: ``[B, T, D]`` residual stream.
            positions: int32 ``[B, T]``.
            key_positions: int32 ``[B, S]`` (``S = T`` without a cache).
            kv_cache: this layer's ``(keys, values)``, each ``[B, S, K, H]``, or ``None``.
            write_index: int32 ``[B]`` first slot written per sequence, or ``None``.

        Returns:
            ``(x, kv_cache)``.
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        norm = functools.partial(
            RMSNorm, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype
        )
        attended, kv_cache = Attention(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            qkv_bias=cfg.qkv_bias,
            attention_impl=cfg.attention_impl,
            dtype=dtype,
            param_dtype=param_dtype,
            name="attention",
        )(norm(name="attention_norm")(x), positions, key_positions, kv_cache, write_index)
        x = nn.with_logical_constraint(x + attended, _RESIDUAL_AXES)
        mlp_out = SwiGLU(cfg.mlp_dim, dtype=dtype, param_dtype=param_dtype, name="mlp")(
            norm(name="mlp_norm")(x)
        )
        x = nn.with_logical_constraint(x + mlp_out, _RESIDUAL_AXES)
        # Residual stream after each block, for probing and task vectors:
        # model.apply(..., mutable=["intermediates"]).
        self.sow("intermediates", "residual", x)
        return x, kv_cache


def _block_class(config: LMConfig):
    if config.remat_policy == "none":
        return Block
    # Inside nn.scan the loop already prevents CSE across iterations; outside, keep
    # prevent_cse so XLA does not merge the recomputation with the forward pass.
    return nn.remat(
        Block, policy=remat_policy(config.remat_policy), prevent_cse=not config.scan_layers
    )


def _check_inputs(config: LMConfig, tokens, positions, cache: KVCache | None) -> None:
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(
            f"tokens and positions must both be int [B, T]; got {tokens.shape=} {positions.shape=}"
        )
    if not (
        jnp.issubdtype(tokens.dtype, jnp.integer) and jnp.issubdtype(positions.dtype, jnp.integer)
    ):
        raise ValueError(
            f"tokens and positions must be integer; got {tokens.dtype=} {positions.dtype=}"
        )
    batch_size, length = tokens.shape
    if length > config.max_len:
        raise ValueError(
            f"input length {length} exceeds the model's max_len {config.max_len} (tokens {tokens.shape})"
        )
    if not isinstance(tokens, jax.core.Tracer):
        tokens_np = np.asarray(tokens)
        if tokens_np.size and (tokens_np.min() < 0 or tokens_np.max() >= config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={config.vocab_size}); got min "
                f"{tokens_np.min()} max {tokens_np.max()}"
            )
    if not isinstance(positions, jax.core.Tracer):
        positions_np = np.asarray(positions)
        if positions_np.size and positions_np.max() >= config.max_len:
            raise ValueError(
                f"positions must be below max_len {config.max_len}; got max {positions_np.max()}"
            )
    if cache is None:
        return
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache or None, got {type(cache).__name__}")
    expected = (config.num_layers, batch_size, cache.capacity, config.num_kv_heads, config.head_dim)
    if cache.keys.shape != expected or cache.values.shape != expected:
        raise ValueError(
            f"cache keys/values must be [L, B, S, K, H] = {expected}; got "
            f"{cache.keys.shape} and {cache.values.shape}"
        )
    if length > cache.capacity:
        raise ValueError(f"appending {length} tokens exceeds the cache capacity {cache.capacity}")
    if not isinstance(cache.lengths, jax.core.Tracer):
        lengths = np.asarray(cache.lengths)
        if (lengths + length > cache.capacity).any():
            raise ValueError(
                f"appending {length} tokens to cache lengths {lengths.tolist()} exceeds the "
                f"cache capacity {cache.capacity}"
            )


class Transformer(nn.Module):
    """Decoder-only causal LM following the protocol in this module's docstring.

    Attributes:
        config: the model's ``LMConfig``.
    """

    config: LMConfig

    @nn.nowrap
    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty ``KVCache`` for this model (works on an unbound module)."""
        return init_cache(self.config, batch_size, max_len)

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        """Runs the model on ``T`` new tokens per sequence.

        Args:
            tokens: int32 ``[B, T]``.
            positions: int32 ``[B, T]``; negative marks padding.
            cache: ``None`` or the ``KVCache`` the tokens are appended to.

        Returns:
            ``(logits, cache)``: float32 ``[B, T, V]`` and the updated cache (``None`` if
            none was given).

        Raises:
            ValueError: malformed shapes, ``T > max_len``, or (with concrete values) a
                cache that would overflow, token ids outside the vocabulary, positions
                ``>= max_len``. Under ``jit``, where lengths are not known, a sequence
                that overflows its cache gets NaN logits.
        """
        cfg = self.config
        _check_inputs(cfg, tokens, positions, cache)
        tokens = tokens.astype(jnp.int32)
        positions = positions.astype(jnp.int32)
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)

        embed = Embed(
            cfg.vocab_size, cfg.embed_dim, dtype=dtype, param_dtype=param_dtype, name="embed"
        )
        x = nn.with_logical_constraint(embed.encode(tokens), _RESIDUAL_AXES)

        if cache is None:
            key_positions, write_index, layer_caches = positions, None, None
        else:
            write_index = cache.lengths
            key_positions = write_slots(cache.positions, positions, write_index)
            layer_caches = (cache.keys, cache.values)

        block_class = _block_class(cfg)
        if cfg.scan_layers:
            x, layer_caches = nn.scan(
                block_class,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="layers")(x, positions, key_positions, layer_caches, write_index)
        else:
            keys, values = (None, None) if cache is None else layer_caches
            for layer in range(cfg.num_layers):
                layer_cache = None if cache is None else (keys[layer], values[layer])
                x, layer_cache = block_class(cfg, name=f"layers_{layer}")(
                    x, positions, key_positions, layer_cache, write_index
                )
                if cache is not None:
                    keys = keys.at[layer].set(layer_cache[0])
                    values = values.at[layer].set(layer_cache[1])
            layer_caches = None if cache is None else (keys, values)

        x = RMSNorm(epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, name="final_norm")(
            x
        )
        if cfg.tie_embeddings:
            logits = embed.decode(x)
        else:
            head = Einsum(
                shape=(cfg.embed_dim, cfg.vocab_size),
                logical_axes=("embed", "vocab"),
                dtype=dtype,
                out_dtype=jnp.float32,
                param_dtype=param_dtype,
                name="lm_head",
            )
            logits = head("BTD,DV->BTV", x)
        logits = nn.with_logical_constraint(logits, ("act_batch", "act_len", "act_vocab"))

        if cache is None:
            return logits, None
        # Under jit the overflow check above cannot see the lengths, and the slot writes
        # would clamp onto the last slots. A sequence that overflowed gets NaN logits
        # instead of silently wrong ones.
        overflow = cache.lengths + tokens.shape[1] > cache.capacity
        logits = jnp.where(overflow[:, None, None], jnp.nan, logits)
        new_cache = KVCache(
            keys=layer_caches[0],
            values=layer_caches[1],
            positions=key_positions,
            lengths=cache.lengths + tokens.shape[1],
        )
        return logits, new_cache


def stack_layer_params(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Converts ``layers_{i}`` subtrees (``scan_layers=False``) into one stacked ``layers``.

    Raises:
        ValueError: a ``layers_{i}`` subtree is missing.
    """
    params = dict(params)
    per_layer = []
    for layer in range(num_layers):
        name = f"layers_{layer}"
        if name not in params:
            raise ValueError(f"params have no {name!r} (expected {num_layers} layers)")
        per_layer.append(params.pop(name))
    params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    return params


def unstack_layer_params(params: dict[str, Any]) -> dict[str, Any]:
    """Converts a stacked ``layers`` subtree (``scan_layers=True``) into ``layers_{i}``."""
    params = dict(params)
    if "layers" not in params:
        raise ValueError("params have no stacked 'layers' subtree")
    stacked = params.pop("layers")
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    for layer in range(num_layers):
        params[f"layers_{layer}"] = jax.tree.map(lambda x, i=layer: x[i], stacked)
    return params


def abstract_params(config: LMConfig) -> Any:
    """``ShapeDtypeStruct`` tree of the parameters, boxed with their logical axis names."""
    model = Transformer(config)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda rng: model.init(rng, tokens, tokens), jax.random.key(0))["params"]


def init_params(config: LMConfig, rng: jax.Array) -> Any:
    """Randomly initialised parameters (unboxed), for tests and training from scratch.

    For sharded initialisation use ``lhc.parallel.sharded_init`` with
    ``Transformer(config).init`` instead: this function builds the whole tree on one device.
    """
    return nn.meta.unbox(_init_params_jit(config, rng))


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(config: LMConfig, rng: jax.Array) -> Any:
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(rng, tokens, tokens)["params"]


def param_shardings(config: LMConfig, mesh: jax.sharding.Mesh, rules) -> Any:
    """``NamedSharding`` tree matching the parameters, from their logical axis names."""
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_params(config)), mesh, rules)


@functools.lru_cache(maxsize=64)
def count_params(config: LMConfig) -> int:
    """Number of parameters of a model with ``config``."""
    return sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nn.meta.unbox(abstract_params(config)))
    )
