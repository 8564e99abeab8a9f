"""TabICL's layers: torch-initialised dense projections, interleaved rotary embeddings,
key-masked softmax attention, the pre/post-norm attention block and the induced set
attention block (ISAB).

The rotary embedding and the attention here are TabICL's own (interleaved pairs; keys
hidden by a mask with a uniform fallback) and differ from ``lhc.nn``'s (half-split
pairs at token positions; position masks), hence their distinct names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lhc.nn import remat as remat_names
from lhc.tabicl.config import LAYER_NORM_EPS

# ----------------------------------------------------------------------------- helpers


def torch_linear_init(fan_in: int) -> nn.initializers.Initializer:
    """torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def trunc_normal_002(key, shape, dtype=jnp.float32):
    """torch.nn.init.trunc_normal_(std=0.02), which truncates at +-2 (absolute)."""
    return 0.02 * jax.random.truncated_normal(key, -100.0, 100.0, shape, dtype)


def _activation(name: str):
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    return jax.nn.relu


def module_fields(module: nn.Module, cls: type[nn.Module]) -> dict:
    """``module``'s values of the fields that ``cls`` declares (``parent`` and ``name``
    aside), as keyword arguments: a ``cls`` built from them has ``module``'s settings."""
    fields = dataclasses.fields(cls)
    return {f.name: getattr(module, f.name) for f in fields if f.name not in ("parent", "name")}


def layer_norm(dtype, param_dtype, name: str | None = None) -> nn.LayerNorm:
    # Two-pass variance as torch computes it; the fast E[x^2]-E[x]^2 form loses digits on
    # rows with large means (e.g. the -100 skip vectors).
    return nn.LayerNorm(
        epsilon=LAYER_NORM_EPS,
        use_fast_variance=False,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
        name=name,
    )


def interleaved_rope_tables(
    seq_len: int, head_dim: int, base: float
) -> tuple[jax.Array, jax.Array]:
    """Cosine and sine tables of interleaved rotary embeddings.

    Pair ``(2i, 2i+1)`` of a head rotates with frequency ``base ** (-2i / head_dim)``;
    the float32 arithmetic follows lucidrains' ``rotary-embedding-torch`` as vendored by
    TabICL.

    Returns:
        ``(cos, sin)``, each float32 ``[seq_len, head_dim]`` with every frequency repeated
        twice in a row.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(base) ** exponents)
    angles = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.repeat(angles, 2, axis=-1)
    return jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))


def rotate_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates interleaved pairs: ``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``.

    Args:
        x: ``[..., n, S, h]`` projected queries or keys.
        cos, sin: ``[S, h]`` from ``interleaved_rope_tables``.
    """
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def key_masked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    key_mask: jax.Array | None = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention with scores and softmax in float32.

    Args:
        query: ``[..., n, Q, h]``.
        key, value: ``[..., n, K, h]``.
        key_mask: bool, broadcastable to ``[..., K]``; False hides a key. Hidden keys
            get probability exactly 0; a query whose keys are all hidden gets uniform
            weights instead of NaN.
        dropout_rate: dropout on the attention probabilities (needs ``dropout_rng``).

    Returns:
        ``[..., n, Q, h]`` in the dtype of ``value``.
    """
    # The scale goes on the queries (Q x h) rather than the scores (Q x K): XLA's CPU
    # backend otherwise materialises a broadcast of it as large as the scores.
    query = query * jnp.asarray(1.0 / math.sqrt(query.shape[-1]), query.dtype)
    # Heads lead the query/key axes: XLA's CPU dots run about twice as fast this way.
    scores = jnp.einsum("...nqh,...nkh->...nqk", query, key, preferred_element_type=jnp.float32)
    if key_mask is not None:
        scores = jnp.where(key_mask[..., None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("...nqk,...nkh->...nqh", probs.astype(value.dtype), value)


# ----------------------------------------------------------------------------- layers


class Dense(nn.Module):
    """``y = x W + b`` with torch.nn.Linear's initialisation by default.

    With ``skip_value`` set, an input vector whose entries all equal it maps to the
    all-``skip_value`` output (TabICL's ``SkippableLinear``).

    Attributes:
        features: output width O.
        kernel_axes: logical names of the ``[in, O]`` kernel; the bias takes the second.
        zero_init: initialise kernel and bias to zero (TabICL's ``linear2``).
    """

    features: int
    kernel_axes: tuple[str | None, str | None] = ("embed", "mlp")
    zero_init: bool = False
    skip_value: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x: [..., in] -> [..., O]``."""
        fan_in = x.shape[-1]
        init = nn.initializers.zeros if self.zero_init else torch_linear_init(fan_in)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.kernel_axes),
            (fan_in, self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(init, (self.kernel_axes[1],)),
            (self.features,),
            self.param_dtype,
        )
        y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel.astype(self.dtype))
        y = y + bias.astype(self.dtype)
        if self.skip_value is not None:
            skipped = jnp.all(x == self.skip_value, axis=-1, keepdims=True)
            y = jnp.where(skipped, jnp.asarray(self.skip_value, y.dtype), y)
        return y


class HeadsProjection(nn.Module):
    """Projection onto attention heads: ``[..., S, E] -> [..., n, S, h]``.

    One third of torch's packed ``in_proj`` (head-major, so the kernel is
    ``W.T.reshape(E, n, h)``), initialised like it: Xavier-uniform over the packed
    ``[3E, E]`` matrix, zero bias.
    """

    num_heads: int
    head_dim: int
    checkpoint_tag: str = remat_names.QUERY_PROJ
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        bound = math.sqrt(6.0 / (width + 3 * self.num_heads * self.head_dim))

        def xavier_packed(key, shape, dtype=jnp.float32):
            return jax.random.uniform(key, shape, dtype, -bound, bound)

        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(xavier_packed, ("embed", "heads", "kv")),
            (width, self.num_heads, self.head_dim),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv")),
            (self.num_heads, self.head_dim),
            self.param_dtype,
        )
        y = jnp.einsum("...se,enh->...nsh", x.astype(self.dtype), kernel.astype(self.dtype))
        y = y + bias.astype(self.dtype)[:, None, :]
        return checkpoint_name(y, self.checkpoint_tag)


class OutProjection(nn.Module):
    """Merge of the heads: ``[..., n, S, h] -> [..., S, E]``, zero-initialised as in TabICL."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv", "embed")),
            (x.shape[-3], x.shape[-1], self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            (self.features,),
            self.param_dtype,
        )
        y = jnp.einsum("...nsh,nhe->...se", x.astype(self.dtype), kernel.astype(self.dtype))
        return checkpoint_name(y + bias.astype(self.dtype), remat_names.ATTENTION_OUT)


class MultiHeadAttention(nn.Module):
    """The ``attn`` of a TabICL block: query/key/value projections and the output merge."""

    embed_dim: int
    num_heads: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        head_dim = self.embed_dim // self.num_heads
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.query = HeadsProjection(self.num_heads, head_dim, remat_names.QUERY_PROJ, **kw)
        self.key = HeadsProjection(self.num_heads, head_dim, remat_names.KEY_PROJ, **kw)
        self.value = HeadsProjection(self.num_heads, head_dim, remat_names.VALUE_PROJ, **kw)
        self.out = OutProjection(self.embed_dim, **kw)

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        key_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Attention over projected heads.

        Args:
            query: ``[..., n, Q, h]``; key, value: ``[..., n, K, h]`` (already projected,
                rotary embeddings already applied).
            key_mask: bool broadcastable to ``[..., K]``.

        Returns:
            ``[..., Q, E]``.
        """
        use_dropout = self.dropout_rate > 0.0 and not deterministic
        attended = key_masked_attention(
            query,
            key,
            value,
            key_mask,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.make_rng("dropout") if use_dropout else None,
        )
        return self.out(attended)


class BlockFields(nn.Module):
    """The fields of a TabICL transformer block: ``AttentionBlock``'s, and those of the
    ISAB's two blocks."""

    embed_dim: int
    num_heads: int
    ffn_dim: int
    dropout_rate: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32


class AttentionBlock(BlockFields):
    """A TabICL transformer block (``MultiheadAttentionBlock``) with separate key/values.

    Pre-norm: ``x = q + Attn(LN1(q), LN1(kv), LN1(kv)); x = x + FF(LN2(x))``; post-norm:
    ``x = LN1(q + Attn(q, kv, kv)); x = LN2(x + FF(x))``. The key/value projection
    (``key_value``) is separate from the query side (``attend``) so that a sequence of
    queries can be processed in chunks against keys and values computed once.
    """

    def setup(self):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.norm1 = layer_norm(self.dtype, self.param_dtype)
        self.norm2 = layer_norm(self.dtype, self.param_dtype)
        self.attn = MultiHeadAttention(self.embed_dim, self.num_heads, self.dropout_rate, **kw)
        self.linear1 = Dense(self.ffn_dim, ("embed", "mlp"), **kw)
        self.linear2 = Dense(self.embed_dim, ("mlp", "embed"), zero_init=True, **kw)
        self.dropout_attn = nn.Dropout(self.dropout_rate)
        self.dropout_ffn = nn.Dropout(self.dropout_rate)
        self.dropout_out = nn.Dropout(self.dropout_rate)

    def key_value(
        self, kv: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Keys and values of ``kv: [..., K, E]`` -> two ``[..., n, K, h]`` arrays."""
        x = self.norm1(kv) if self.norm_first else kv
        key, value = self.attn.key(x), self.attn.value(x)
        if rope is not None:
            key = rotate_interleaved(key, *rope)
        return key, value

    def attend(
        self,
        q: jax.Array,
        key: jax.Array,
        value: jax.Array,
        key_mask: jax.Array | None = None,
        rope: tuple[jax.Array, jax.Array] | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Block output for the queries ``q: [..., Q, E]`` -> ``[..., Q, E]``.

        With ``rope`` (tables for the K key positions), the queries are the first Q of
        those positions.
        """
        x = self.norm1(q) if self.norm_first else q
        query = self.attn.query(x)
        if rope is not None:
            num_queries = q.shape[-2]
            query = rotate_interleaved(query, rope[0][:num_queries], rope[1][:num_queries])
        attended = self.attn(query, key, value, key_mask, deterministic)
        attended = self.dropout_attn(attended, deterministic=deterministic)
        if self.norm_first:
            x = q + attended
            return x + self._feed_forward(self.norm2(x), deterministic)
        x = self.norm1(q + attended)
        return self.norm2(x + self._feed_forward(x, deterministic))

    def __call__(
        self,
        q: jax.Array,
        kv: jax.Array | None = None,
        key_mask: jax.Array | None = None,
        rope: tuple[jax.Array, jax.Array] | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """``q: [..., Q, E]`` attends to ``kv: [..., K, E]`` (itself when None).

        ``rope`` holds the tables of the K key positions; the queries take the first Q.
        """
        key, value = self.key_value(q if kv is None else kv, rope)
        return self.attend(q, key, value, key_mask, rope, deterministic)

    def _feed_forward(self, x: jax.Array, deterministic: bool) -> jax.Array:
        hidden = checkpoint_name(self.linear1(x), remat_names.MLP_UP)
        hidden = self.dropout_ffn(_activation(self.activation)(hidden), deterministic=deterministic)
        out = checkpoint_name(self.linear2(hidden), remat_names.MLP_OUT)
        return self.dropout_out(out, deterministic=deterministic)


def block_class(remat_policy: str):
    """``AttentionBlock``, rematerialised in the backward pass unless the policy is "none".

    Only ``__call__`` (the training path) is wrapped; callers pass ``deterministic`` as
    its fifth positional argument, which stays static.
    """
    if remat_policy == "none":
        return AttentionBlock
    return nn.remat(
        AttentionBlock, policy=remat_names.remat_policy(remat_policy), static_argnums=(5,)
    )


class InducedSelfAttentionBlock(BlockFields, kw_only=True):
    """ISAB: I inducing points read the training rows, then every row reads them.

    Its two blocks take its ``BlockFields``; ``num_inds`` (I) and ``remat_policy`` are
    keyword-only.
    """

    num_inds: int
    remat_policy: str = "none"

    def setup(self):
        block = block_class(self.remat_policy)
        self.multihead_attn1 = block(**module_fields(self, BlockFields))
        self.multihead_attn2 = block(**module_fields(self, BlockFields))
        self.ind_vectors = self.param(
            "ind_vectors",
            nn.with_logical_partitioning(trunc_normal_002, (None, "embed")),
            (self.num_inds, self.embed_dim),
            self.param_dtype,
        )

    def induce(
        self, src_train: jax.Array, train_mask: jax.Array | None = None, deterministic=True
    ) -> jax.Array:
        """Inducing summary of the training rows: ``[..., N, E] -> [..., I, E]``.

        ``train_mask`` (broadcastable to ``[..., N]``) hides padded training rows.
        """
        inducing = jnp.broadcast_to(
            self.ind_vectors.astype(src_train.dtype),
            (*src_train.shape[:-2], self.num_inds, self.embed_dim),
        )
        return self.multihead_attn1(inducing, src_train, train_mask, None, deterministic)

    def distribute(self, src: jax.Array, summary: jax.Array, deterministic=True) -> jax.Array:
        """Rows read the summary: ``src: [..., T, E]``, ``summary: [..., I, E] -> [..., T, E]``."""
        return self.multihead_attn2(src, summary, None, None, deterministic)
