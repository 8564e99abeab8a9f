"""TabICL (ICML 2025) in Flax: column embedding, row interaction, in-context learning.

The network maps a table ``X: [B, T, H]`` (B tables, T rows of which the first N are
training rows, H features) and the training labels ``y_train: [B, N]`` to class logits
for the T - N test rows, in three stages:

1. **Column embedding** (``ColumnEmbedding``): every cell is lifted to E dimensions and
   each column runs through an induced set transformer (ISAB) whose I inducing points
   attend to the column's *training* rows only; the result sets a per-cell affine map
   ``x * LN(W h) + LN(B h)``. Columns never see each other.
2. **Row interaction** (``RowInteraction``): C learned CLS tokens are prepended to each
   row's H cell embeddings; a transformer with interleaved rotary embeddings (base 1e5)
   mixes them, and the C CLS outputs are concatenated into a row vector of D = C * E.
3. **In-context learning** (``ICLearning``): the label embedding is added to the training
   rows, and a transformer in which *every* row attends only to the training rows
   produces logits through a two-layer GELU decoder.

Numerics follow ``tabicl==0.1.4`` exactly: LayerNorm eps 1e-5 (two-pass variance),
exact erf GELU, the same ``norm1`` applied to queries, keys and values (this matters in
the cross-attention of the ISAB), torch's packed-QKV head-major layout and torch's
default initialisation (with zero-initialised ``out`` and ``linear2`` projections).

The cell value -100 is the reference's skip marker: a cell equal to -100 lifts to the
all -100 vector, a column whose cells are all -100 skips the set transformer, and an
all -100 row skips the output projections. This port reproduces that behaviour so that
edge cases agree with the reference too.

``TabICL.__call__`` is the training forward (jittable, differentiable, with masks for
padded features and padded training rows). The chunked, memory-bounded inference
forward is built in ``lhc.tabicl.inference`` from the methods below it.

Shape letters: B tables (or ensemble members), G base tables, T rows, N training rows,
H features, C CLS tokens, S = C + H tokens of a row, E column/row width, D = C * E ICL
width, I inducing points, L blocks; inside attention Q/K query/key lengths, n heads,
h head dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lhc.nn import remat as remat_names

SKIP_VALUE = -100.0
LAYER_NORM_EPS = 1e-5
ACTIVATIONS = ("gelu", "relu")


@dataclasses.dataclass(frozen=True)
class TabICLConfig:
    """Architecture of a TabICL model: the 15 constructor arguments of ``tabicl.TabICL``.

    Attributes:
        max_classes: classes the decoder predicts natively; more use the class hierarchy.
        embed_dim: E, width of the column and row stages. The ICL width is
            ``embed_dim * row_num_cls``.
        col_num_blocks: induced self-attention blocks of the column set transformer.
        col_nhead: attention heads of the column stage.
        col_num_inds: I, inducing points per ISAB block.
        row_num_blocks: transformer blocks of the row stage.
        row_nhead: attention heads of the row stage.
        row_num_cls: C, CLS tokens per row.
        row_rope_base: rotary-embedding base of the row stage.
        icl_num_blocks: transformer blocks of the ICL stage.
        icl_nhead: attention heads of the ICL stage.
        ff_factor: feed-forward width as a multiple of the block width.
        dropout: dropout rate (attention probabilities, residual branches, feed-forward).
        activation: feed-forward activation of all blocks, "gelu" (exact) or "relu".
            The decoder always uses GELU.
        norm_first: pre-norm blocks (True) or post-norm blocks (False).
    """

    max_classes: int = 10
    embed_dim: int = 128
    col_num_blocks: int = 3
    col_nhead: int = 4
    col_num_inds: int = 128
    row_num_blocks: int = 3
    row_nhead: int = 8
    row_num_cls: int = 4
    row_rope_base: float = 100000
    icl_num_blocks: int = 12
    icl_nhead: int = 4
    ff_factor: int = 2
    dropout: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True

    def __post_init__(self):
        positive = (
            "max_classes",
            "embed_dim",
            "col_num_blocks",
            "col_nhead",
            "col_num_inds",
            "row_num_blocks",
            "row_nhead",
            "row_num_cls",
            "icl_num_blocks",
            "icl_nhead",
            "ff_factor",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TabICLConfig.{name} must be a positive int, got {value!r}")
        if self.max_classes < 2:
            raise ValueError(f"TabICLConfig.max_classes must be >= 2, got {self.max_classes}")
        for name, heads, width in (
            ("col_nhead", self.col_nhead, self.embed_dim),
            ("row_nhead", self.row_nhead, self.embed_dim),
            ("icl_nhead", self.icl_nhead, self.icl_dim),
        ):
            if width % heads:
                raise ValueError(f"TabICLConfig.{name}={heads} must divide the block width {width}")
        if (self.embed_dim // self.row_nhead) % 2:
            raise ValueError(
                "rotary embeddings rotate pairs: embed_dim // row_nhead must be even, got "
                f"{self.embed_dim} // {self.row_nhead} = {self.embed_dim // self.row_nhead}"
            )
        if not (isinstance(self.row_rope_base, (int, float)) and self.row_rope_base > 0):
            raise ValueError(f"TabICLConfig.row_rope_base must be > 0, got {self.row_rope_base!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"TabICLConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"TabICLConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        if not isinstance(self.norm_first, bool):
            raise ValueError(f"TabICLConfig.norm_first must be a bool, got {self.norm_first!r}")

    @property
    def icl_dim(self) -> int:
        """D, the ICL width: the C CLS outputs of width E concatenated."""
        return self.embed_dim * self.row_num_cls

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TabICLConfig:
        """Builds a config from a checkpoint's ``config`` dict; unknown keys are an error."""
        if not isinstance(values, Mapping):
            raise ValueError(f"a TabICL config must be a mapping, got {type(values).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown TabICL config keys {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- helpers


def _torch_linear_init(fan_in: int) -> nn.initializers.Initializer:
    """torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _trunc_normal_002(key, shape, dtype=jnp.float32):
    """torch.nn.init.trunc_normal_(std=0.02), which truncates at +-2 (absolute)."""
    return 0.02 * jax.random.truncated_normal(key, -100.0, 100.0, shape, dtype)


def _activation(name: str):
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    return jax.nn.relu


def _layer_norm(dtype, param_dtype, name: str | None = None) -> nn.LayerNorm:
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


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
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


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates interleaved pairs: ``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``.

    Args:
        x: ``[..., n, S, h]`` projected queries or keys.
        cos, sin: ``[S, h]`` from ``rope_tables``.
    """
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def dot_product_attention(
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
    scale = 1.0 / math.sqrt(query.shape[-1])
    # Heads lead the query/key axes: XLA's CPU dots run about twice as fast this way.
    scores = jnp.einsum("...nqh,...nkh->...nqk", query, key, preferred_element_type=jnp.float32)
    scores = scores * scale
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
        init = nn.initializers.zeros if self.zero_init else _torch_linear_init(fan_in)
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
        attended = dot_product_attention(
            query,
            key,
            value,
            key_mask,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.make_rng("dropout") if use_dropout else None,
        )
        return self.out(attended)


class AttentionBlock(nn.Module):
    """A TabICL transformer block (``MultiheadAttentionBlock``) with separate key/values.

    Pre-norm: ``x = q + Attn(LN1(q), LN1(kv), LN1(kv)); x = x + FF(LN2(x))``; post-norm:
    ``x = LN1(q + Attn(q, kv, kv)); x = LN2(x + FF(x))``. The key/value projection
    (``key_value``) is separate from the query side (``attend``) so that a sequence of
    queries can be processed in chunks against keys and values computed once.
    """

    embed_dim: int
    num_heads: int
    ffn_dim: int
    dropout_rate: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.norm1 = _layer_norm(self.dtype, self.param_dtype)
        self.norm2 = _layer_norm(self.dtype, self.param_dtype)
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
            key = apply_rope(key, *rope)
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
        """Block output for the queries ``q: [..., Q, E]`` -> ``[..., Q, E]``."""
        x = self.norm1(q) if self.norm_first else q
        query = self.attn.query(x)
        if rope is not None:
            query = apply_rope(query, *rope)
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
        """``q: [..., Q, E]`` attends to ``kv: [..., K, E]`` (itself when None)."""
        key, value = self.key_value(q if kv is None else kv, rope)
        return self.attend(q, key, value, key_mask, rope, deterministic)

    def _feed_forward(self, x: jax.Array, deterministic: bool) -> jax.Array:
        hidden = checkpoint_name(self.linear1(x), remat_names.MLP_UP)
        hidden = self.dropout_ffn(_activation(self.activation)(hidden), deterministic=deterministic)
        out = checkpoint_name(self.linear2(hidden), remat_names.MLP_OUT)
        return self.dropout_out(out, deterministic=deterministic)


def _block_class(remat_policy: str):
    """``AttentionBlock``, rematerialised in the backward pass unless the policy is "none".

    Only ``__call__`` (the training path) is wrapped; callers pass ``deterministic`` as
    its fifth positional argument, which stays static.
    """
    if remat_policy == "none":
        return AttentionBlock
    return nn.remat(
        AttentionBlock, policy=remat_names.remat_policy(remat_policy), static_argnums=(5,)
    )


class InducedSelfAttentionBlock(nn.Module):
    """ISAB: I inducing points read the training rows, then every row reads them."""

    embed_dim: int
    num_heads: int
    ffn_dim: int
    num_inds: int
    dropout_rate: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        kw = dict(
            embed_dim=self.embed_dim,
            num_heads=self.num_heads,
            ffn_dim=self.ffn_dim,
            dropout_rate=self.dropout_rate,
            activation=self.activation,
            norm_first=self.norm_first,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        block = _block_class(self.remat_policy)
        self.multihead_attn1 = block(**kw)
        self.multihead_attn2 = block(**kw)
        self.ind_vectors = self.param(
            "ind_vectors",
            nn.with_logical_partitioning(_trunc_normal_002, (None, "embed")),
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


# ----------------------------------------------------------------------------- stages


class ColumnEmbedding(nn.Module):
    """Distribution-aware embedding of each cell from its column (``ColEmbedding``)."""

    config: TabICLConfig
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        width = cfg.embed_dim
        self.in_linear = Dense(width, (None, "embed"), skip_value=SKIP_VALUE, **kw)
        self.blocks = [
            InducedSelfAttentionBlock(
                embed_dim=width,
                num_heads=cfg.col_nhead,
                ffn_dim=width * cfg.ff_factor,
                num_inds=cfg.col_num_inds,
                dropout_rate=cfg.dropout,
                activation=cfg.activation,
                norm_first=cfg.norm_first,
                remat_policy=self.remat_policy,
                **kw,
            )
            for _ in range(cfg.col_num_blocks)
        ]
        self.out_w = Dense(width, ("embed", None), skip_value=SKIP_VALUE, **kw)
        self.out_b = Dense(width, ("embed", None), skip_value=SKIP_VALUE, **kw)
        if cfg.norm_first:
            self.ln_w = _layer_norm(self.dtype, self.param_dtype)
            self.ln_b = _layer_norm(self.dtype, self.param_dtype)

    def __call__(
        self,
        x_cols: jax.Array,
        train_size: int,
        train_mask: jax.Array | None = None,
        col_skip: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Embeds whole columns: ``x_cols: [..., T] -> [..., T, E]``.

        Args:
            x_cols: ``[..., T]`` cells of columns (any leading column/table dims); the
                first ``train_size`` rows are training rows.
            train_mask: bool broadcastable to ``[..., N]``, False for padded training rows.
            col_skip: bool ``[...]``, columns to treat as skipped; by default the columns
                whose cells are all -100.
        """
        if col_skip is None:
            col_skip = jnp.all(x_cols == SKIP_VALUE, axis=-1)
        src = self.in_linear(x_cols[..., None])
        for block in self.blocks:
            summary = block.induce(src[..., :train_size, :], train_mask, deterministic)
            src = block.distribute(src, summary, deterministic)
        return self._finish(x_cols, src, col_skip)

    def summaries(self, x_train_cols: jax.Array, train_mask: jax.Array | None = None) -> jax.Array:
        """Inducing summaries of every block from the training rows alone.

        Args:
            x_train_cols: ``[..., N]`` training cells of columns.
            train_mask: bool broadcastable to ``[..., N]``.

        Returns:
            ``[..., L, I, E]``: what block l's rows attend to; with it, any row of the
            column embeds without the other rows (``embed``).
        """
        src = self.in_linear(x_train_cols[..., None])
        summaries = []
        for block in self.blocks:
            summary = block.induce(src, train_mask)
            summaries.append(summary)
            src = block.distribute(src, summary)
        return jnp.stack(summaries, axis=-3)

    def embed(self, x_cols: jax.Array, summaries: jax.Array, col_skip: jax.Array) -> jax.Array:
        """Embeds some rows of columns given their summaries.

        Args:
            x_cols: ``[..., R]`` cells of R rows (train or test) of columns.
            summaries: ``[..., L, I, E]`` from ``summaries``.
            col_skip: bool ``[...]``, columns whose cells (all rows, train and test) are
                all -100.

        Returns:
            ``[..., R, E]``.
        """
        src = self.in_linear(x_cols[..., None])
        for layer, block in enumerate(self.blocks):
            src = block.distribute(src, summaries[..., layer, :, :])
        return self._finish(x_cols, src, col_skip)

    def _finish(self, x_cols: jax.Array, src: jax.Array, col_skip: jax.Array) -> jax.Array:
        # A skipped column leaves the set transformer as all -100 in the reference.
        src = jnp.where(col_skip[..., None, None], jnp.asarray(SKIP_VALUE, src.dtype), src)
        weights, biases = self.out_w(src), self.out_b(src)
        if self.config.norm_first:
            weights, biases = self.ln_w(weights), self.ln_b(biases)
        return x_cols[..., None].astype(weights.dtype) * weights + biases


class RowInteraction(nn.Module):
    """Feature interaction inside each row, read out through CLS tokens."""

    config: TabICLConfig
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        self.cls_tokens = self.param(
            "cls_tokens",
            nn.with_logical_partitioning(_trunc_normal_002, (None, "embed")),
            (cfg.row_num_cls, cfg.embed_dim),
            self.param_dtype,
        )
        self.blocks = [
            _block_class(self.remat_policy)(
                embed_dim=cfg.embed_dim,
                num_heads=cfg.row_nhead,
                ffn_dim=cfg.embed_dim * cfg.ff_factor,
                dropout_rate=cfg.dropout,
                activation=cfg.activation,
                norm_first=cfg.norm_first,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            )
            for _ in range(cfg.row_num_blocks)
        ]
        if cfg.norm_first:
            self.out_ln = _layer_norm(self.dtype, self.param_dtype)

    def __call__(
        self,
        embeddings: jax.Array,
        feature_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Row representations.

        Args:
            embeddings: ``[..., H, E]`` cell embeddings of rows.
            feature_mask: bool broadcastable to ``[..., H]``; False marks padded features,
                which no token attends to.

        Returns:
            ``[..., D]`` with D = C * E (CLS-major).
        """
        cfg = self.config
        num_cls, width = cfg.row_num_cls, cfg.embed_dim
        lead = embeddings.shape[:-2]
        cls = jnp.broadcast_to(self.cls_tokens.astype(embeddings.dtype), (*lead, num_cls, width))
        x = jnp.concatenate([cls, embeddings], axis=-2)
        key_mask = None
        if feature_mask is not None:
            feature_mask = jnp.broadcast_to(feature_mask, lead + embeddings.shape[-2:-1])
            key_mask = jnp.concatenate([jnp.ones((*lead, num_cls), bool), feature_mask], -1)
        rope = rope_tables(x.shape[-2], width // cfg.row_nhead, cfg.row_rope_base)
        for block in self.blocks:
            x = block(x, None, key_mask, rope, deterministic)
        out = x[..., :num_cls, :]
        if cfg.norm_first:
            out = self.out_ln(out)
        return out.reshape(*lead, num_cls * width)


class LabelEmbedding(nn.Module):
    """``y_encoder``: one-hot labels times a Linear, done as a row lookup (exact)."""

    num_classes: int
    features: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, labels: jax.Array) -> jax.Array:
        """``labels: int [...] -> [..., D]``; labels must lie in ``[0, num_classes)``."""
        init = _torch_linear_init(self.num_classes)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, (None, "embed")),
            (self.num_classes, self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(init, ("embed",)),
            (self.features,),
            self.param_dtype,
        )
        return jnp.take(kernel, labels.astype(jnp.int32), axis=0) + bias


def _icl_block_kwargs(config: TabICLConfig) -> dict:
    width = config.icl_dim
    return dict(
        embed_dim=width,
        num_heads=config.icl_nhead,
        ffn_dim=width * config.ff_factor,
        dropout_rate=config.dropout,
        activation=config.activation,
        norm_first=config.norm_first,
    )


def icl_block(config: TabICLConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> AttentionBlock:
    """An unbound ICL block, to apply with ``params["icl_predictor"]["blocks_<i>"]``.

    The chunked inference runs the ICL blocks in a ``lax.scan`` over their stacked
    parameters, which needs the block outside of ``TabICL``.
    """
    return AttentionBlock(**_icl_block_kwargs(config), dtype=dtype, param_dtype=param_dtype)


class ICLearning(nn.Module):
    """In-context learning over rows: every row attends to the labelled training rows."""

    config: TabICLConfig
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        width = cfg.icl_dim
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.y_encoder = LabelEmbedding(cfg.max_classes, width, self.param_dtype)
        self.blocks = [
            _block_class(self.remat_policy)(**_icl_block_kwargs(cfg), **kw)
            for _ in range(cfg.icl_num_blocks)
        ]
        if cfg.norm_first:
            self.ln = _layer_norm(self.dtype, self.param_dtype)
        self.decoder_hidden = Dense(2 * width, ("embed", "mlp"), **kw)
        self.decoder_out = Dense(cfg.max_classes, ("mlp", None), **kw)

    def __call__(
        self,
        representations: jax.Array,
        y_train: jax.Array,
        train_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Logits of the test rows.

        Args:
            representations: ``[B, T, D]`` row representations, training rows first.
            y_train: int ``[B, N]`` labels in ``[0, max_classes)``.
            train_mask: bool broadcastable to ``[B, N]``, False for padded training rows.

        Returns:
            float32 ``[B, T - N, max_classes]``.
        """
        num_train = y_train.shape[-1]
        h = self.add_labels(representations, y_train)
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            # The training rows' last-layer outputs feed nothing: skip them.
            queries = h if index < last else h[..., num_train:, :]
            h = block(queries, h[..., :num_train, :], train_mask, None, deterministic)
        return self.decode(h)

    def add_labels(self, representations: jax.Array, y_train: jax.Array) -> jax.Array:
        """``[B, T, D]`` with the label embedding added to the first N rows."""
        num_train = y_train.shape[-1]
        labels = self.y_encoder(y_train).astype(representations.dtype)
        return representations.at[..., :num_train, :].add(labels)

    def decode(self, h: jax.Array) -> jax.Array:
        """Final norm and decoder: ``[..., D] -> float32 [..., max_classes]``."""
        if self.config.norm_first:
            h = self.ln(h)
        hidden = jax.nn.gelu(self.decoder_hidden(h), approximate=False)
        return self.decoder_out(hidden).astype(jnp.float32)


class TabICL(nn.Module):
    """The TabICL network.

    ``__call__`` is the training forward. The other public methods are the pieces of the
    chunked inference in ``lhc.tabicl.inference`` (call them through
    ``model.apply(variables, ..., method=...)``).

    Attributes:
        config: the architecture.
        remat_policy: rematerialisation of the blocks in the training forward's backward
            pass, one of ``lhc.nn.remat.REMAT_POLICIES`` ("none": keep activations).
        dtype: compute dtype of matmuls and activations (norm statistics, softmax and
            logits stay float32).
        param_dtype: storage dtype of the parameters.
    """

    config: TabICLConfig
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        kw = dict(
            config=self.config,
            remat_policy=self.remat_policy,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        self.col_embedder = ColumnEmbedding(**kw)
        self.row_interactor = RowInteraction(**kw)
        self.icl_predictor = ICLearning(**kw)

    def __call__(
        self,
        X: jax.Array,
        y_train: jax.Array,
        *,
        feature_mask: jax.Array | None = None,
        train_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Training forward: all ``max_classes`` logits of the test rows.

        Equals the reference's train-mode forward (``TabICL._train_forward`` with
        ``d``); cross-entropy over these logits is the pretraining loss.

        Args:
            X: ``[B, T, H]`` tables; rows ``[:N]`` are training rows. Padded features and
                padded rows must hold finite values (zeros).
            y_train: int ``[B, N]`` training labels in ``[0, max_classes)``.
            feature_mask: bool ``[B, H]``; False marks padded features (the reference's
                ``d`` is ``feature_mask.sum(-1)`` with padding at the end). A padded
                table is one with no real feature; mask its loss.
            train_mask: bool ``[B, N]``; False marks padded training rows, which no row
                attends to.
            deterministic: False enables dropout (needs a ``"dropout"`` rng).

        Returns:
            float32 ``[B, T - N, max_classes]``.
        """
        num_train = y_train.shape[-1]
        if num_train > X.shape[1]:
            raise ValueError(f"y_train has {num_train} rows but X only {X.shape[1]}")
        embeddings = self.column_embeddings(
            X,
            num_train,
            feature_mask=feature_mask,
            train_mask=train_mask,
            deterministic=deterministic,
        )
        # Tables split over the batch axes between stages (no-ops without a mesh).
        embeddings = nn.with_logical_constraint(
            embeddings, ("act_batch", "act_len", None, "act_emb")
        )
        row_mask = None if feature_mask is None else feature_mask[:, None, :]
        representations = self.row_interactor(embeddings, row_mask, deterministic)
        representations = nn.with_logical_constraint(
            representations, ("act_batch", "act_len", "act_emb")
        )
        logits = self.icl_predictor(representations, y_train, train_mask, deterministic)
        return nn.with_logical_constraint(logits, ("act_batch", "act_len", None))

    def column_embeddings(
        self,
        X: jax.Array,
        train_size: int,
        *,
        feature_mask: jax.Array | None = None,
        train_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Column stage of whole tables: ``X: [B, T, H] -> [B, T, H, E]``.

        Masked (padded) features embed to zeros.
        """
        x_cols = jnp.swapaxes(X, -1, -2)
        col_mask = None if train_mask is None else train_mask[:, None, :]
        embeddings = self.col_embedder(x_cols, train_size, col_mask, deterministic=deterministic)
        embeddings = jnp.swapaxes(embeddings, -2, -3)
        if feature_mask is not None:
            embeddings = jnp.where(feature_mask[:, None, :, None], embeddings, 0.0)
        return embeddings

    def row_representations(
        self, embeddings: jax.Array, feature_mask: jax.Array | None = None
    ) -> jax.Array:
        """Row stage: ``[..., H, E] -> [..., D]`` (``feature_mask`` broadcastable to ``[..., H]``)."""
        return self.row_interactor(embeddings, feature_mask)

    # -- pieces of the chunked inference ------------------------------------------------

    def train_summaries(self, x_train_cols: jax.Array, train_mask: jax.Array) -> jax.Array:
        """Column-stage summaries: ``x_train_cols: [..., N]`` -> ``[..., L, I, E]``."""
        return self.col_embedder.summaries(x_train_cols, train_mask)

    def embed_rows(
        self,
        x_rows: jax.Array,
        summaries: jax.Array,
        col_skip: jax.Array,
        member_table: jax.Array,
        member_perm: jax.Array,
        feature_mask: jax.Array,
    ) -> jax.Array:
        """Row representations of some rows for ensemble members sharing base tables.

        The column stage runs once per base table; member b then sees base table
        ``member_table[b]`` with its columns reordered by ``member_perm[b]`` (column j
        of the member is base column ``member_perm[b, j]``), which is exact because the
        column stage treats every column on its own.

        Args:
            x_rows: ``[G, R, H]`` cells of R rows of the G base tables.
            summaries: ``[G, H, L, I, E]`` from ``train_summaries``.
            col_skip: bool ``[G, H]``.
            member_table: int ``[B]``.
            member_perm: int ``[B, H]``.
            feature_mask: bool broadcastable to ``[B, H]``, in member column order.

        Returns:
            ``[B, R, D]``.
        """
        x_cols = jnp.swapaxes(x_rows, -1, -2)
        embeddings = self.col_embedder.embed(x_cols, summaries, col_skip)  # [G, H, R, E]
        embeddings = embeddings[member_table]
        embeddings = jnp.take_along_axis(embeddings, member_perm[:, :, None, None], axis=1)
        embeddings = jnp.swapaxes(embeddings, 1, 2)  # [B, R, H, E]
        feature_mask = jnp.broadcast_to(feature_mask, member_perm.shape)[:, None, :]
        embeddings = jnp.where(feature_mask[..., None], embeddings, 0.0)
        return self.row_interactor(embeddings, feature_mask)

    def icl_add_labels(self, representations: jax.Array, y_train: jax.Array) -> jax.Array:
        """``[B, T, D]`` plus label embeddings on the first N = ``y_train.shape[-1]`` rows."""
        return self.icl_predictor.add_labels(representations, y_train)

    def icl_decode(self, h: jax.Array) -> jax.Array:
        """``[B, Q, D] -> float32 [B, Q, max_classes]``."""
        return self.icl_predictor.decode(h)


def init_params(config: TabICLConfig, rng: jax.Array | int = 0, **model_kwargs) -> dict:
    """Randomly initialised parameters (torch's initialisation), without logical boxes."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    model = TabICL(config, **model_kwargs)
    X = jnp.zeros((1, 3, 2), jnp.float32)
    y = jnp.zeros((1, 2), jnp.int32)
    variables = jax.jit(model.init)(rng, X, y)
    return nn.meta.unbox(variables)["params"]


def abstract_params(config: TabICLConfig, **model_kwargs) -> dict:
    """The parameter tree as ``nn.LogicallyPartitioned``-boxed ``ShapeDtypeStruct`` leaves."""
    model = TabICL(config, **model_kwargs)
    X = jax.ShapeDtypeStruct((1, 3, 2), jnp.float32)
    y = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), X, y)["params"]
