"""TabICL's three stages: ``ColumnEmbedding``, ``RowInteraction`` and ``ICLearning`` (with
``LabelEmbedding`` and the decoder); ``lhc.tabicl.model.TabICL`` chains them."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.tabicl.config import SKIP_VALUE, TabICLConfig
from lhc.tabicl.layers import (
    AttentionBlock,
    Dense,
    InducedSelfAttentionBlock,
    block_class,
    interleaved_rope_tables,
    layer_norm,
    torch_linear_init,
    trunc_normal_002,
)

# ----------------------------------------------------------------------------- stages


class TabICLModule(nn.Module):
    """The fields of the network and of each of its stages (see ``TabICL``)."""

    config: TabICLConfig
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32


def _block_fields(config: TabICLConfig, width: int, num_heads: int) -> dict:
    """A stage's ``BlockFields`` but the dtypes: blocks of ``width`` (E or D) with
    ``num_heads`` heads."""
    return dict(
        embed_dim=width,
        num_heads=num_heads,
        ffn_dim=width * config.ff_factor,
        dropout_rate=config.dropout,
        activation=config.activation,
        norm_first=config.norm_first,
    )


class ColumnEmbedding(TabICLModule):
    """Distribution-aware embedding of each cell from its column (``ColEmbedding``)."""

    def setup(self):
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        width = cfg.embed_dim
        self.in_linear = Dense(width, (None, "embed"), skip_value=SKIP_VALUE, **kw)
        self.blocks = [
            InducedSelfAttentionBlock(
                **_block_fields(cfg, width, cfg.col_nhead),
                num_inds=cfg.col_num_inds,
                remat_policy=self.remat_policy,
                **kw,
            )
            for _ in range(cfg.col_num_blocks)
        ]
        self.out_w = Dense(width, ("embed", None), skip_value=SKIP_VALUE, **kw)
        self.out_b = Dense(width, ("embed", None), skip_value=SKIP_VALUE, **kw)
        if cfg.norm_first:
            self.ln_w = layer_norm(self.dtype, self.param_dtype)
            self.ln_b = layer_norm(self.dtype, self.param_dtype)

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

    def summaries(
        self,
        x_train_cols: jax.Array,
        train_mask: jax.Array | None = None,
        col_skip: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Inducing summaries of every block from the training rows alone.

        Args:
            x_train_cols: ``[..., N]`` training cells of columns.
            train_mask: bool broadcastable to ``[..., N]``.
            col_skip: bool ``[...]`` as in ``embed``; given, the training cells'
                embeddings come back too (what ``embed`` would give for these rows).

        Returns:
            ``[..., L, I, E]``: what block l's rows attend to; with it, any row of the
            column embeds without the other rows (``embed``). With ``col_skip``, also
            the ``[..., N, E]`` embeddings of the training cells.
        """
        src = self.in_linear(x_train_cols[..., None])
        summaries = []
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            summary = block.induce(src, train_mask)
            summaries.append(summary)
            if index < last or col_skip is not None:
                src = block.distribute(src, summary)
        summaries = jnp.stack(summaries, axis=-3)
        if col_skip is None:
            return summaries
        return summaries, self._finish(x_train_cols, src, col_skip)

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


class RowInteraction(TabICLModule):
    """Feature interaction inside each row, read out through CLS tokens."""

    def setup(self):
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.cls_tokens = self.param(
            "cls_tokens",
            nn.with_logical_partitioning(trunc_normal_002, (None, "embed")),
            (cfg.row_num_cls, cfg.embed_dim),
            self.param_dtype,
        )
        self.blocks = [
            block_class(self.remat_policy)(**_block_fields(cfg, cfg.embed_dim, cfg.row_nhead), **kw)
            for _ in range(cfg.row_num_blocks)
        ]
        if cfg.norm_first:
            self.out_ln = layer_norm(self.dtype, self.param_dtype)

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
        rope = interleaved_rope_tables(x.shape[-2], width // cfg.row_nhead, cfg.row_rope_base)
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            # Only the CLS outputs of the last block are read: only they are computed.
            queries = x if index < last else x[..., :num_cls, :]
            x = block(queries, x, key_mask, rope, deterministic)
        out = x
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
        init = torch_linear_init(self.num_classes)
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


def icl_block(config: TabICLConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> AttentionBlock:
    """An unbound ICL block, to apply with ``params["icl_predictor"]["blocks_<i>"]``.

    The chunked inference runs the ICL blocks in a ``lax.scan`` over their stacked
    parameters, which needs the block outside of ``TabICL``.
    """
    fields = _block_fields(config, config.icl_dim, config.icl_nhead)
    return AttentionBlock(**fields, dtype=dtype, param_dtype=param_dtype)


class ICLearning(TabICLModule):
    """In-context learning over rows: every row attends to the labelled training rows."""

    def setup(self):
        cfg = self.config
        width = cfg.icl_dim
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.y_encoder = LabelEmbedding(cfg.max_classes, width, self.param_dtype)
        self.blocks = [
            block_class(self.remat_policy)(**_block_fields(cfg, width, cfg.icl_nhead), **kw)
            for _ in range(cfg.icl_num_blocks)
        ]
        if cfg.norm_first:
            self.ln = layer_norm(self.dtype, self.param_dtype)
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
