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
forward is built in ``lhc.tabicl.chunked`` from the methods below it, and driven by
``lhc.tabicl.inference``.

The files: ``config.py`` (``TabICLConfig``), ``layers.py`` (dense projections, TabICL's
interleaved rotary embedding and key-masked attention, the attention and ISAB blocks),
``stages.py`` (the three stages and the decoder) and this one (the network and its
parameter initialisation).

Shape letters: B tables (or ensemble members), G base tables, T rows, N training rows,
H features, C CLS tokens, S = C + H tokens of a row, E column/row width, D = C * E ICL
width, I inducing points, L blocks; inside attention Q/K query/key lengths, n heads,
h head dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.tabicl.config import TabICLConfig
from lhc.tabicl.layers import module_fields
from lhc.tabicl.stages import ColumnEmbedding, ICLearning, RowInteraction, TabICLModule


class TabICL(TabICLModule):
    """The TabICL network.

    ``__call__`` is the training forward. The other public methods are the pieces of the
    chunked inference in ``lhc.tabicl.chunked`` (call them through
    ``model.apply(variables, ..., method=...)``).

    Attributes:
        config: the architecture.
        remat_policy: rematerialisation of the blocks in the training forward's backward
            pass, one of ``lhc.nn.remat.REMAT_POLICIES`` ("none": keep activations).
        dtype: compute dtype of matmuls and activations (norm statistics, softmax and
            logits stay float32).
        param_dtype: storage dtype of the parameters.
    """

    def setup(self):
        kw = module_fields(self, TabICLModule)  # each stage takes the network's fields
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

    def train_summaries(
        self, x_train_cols: jax.Array, train_mask: jax.Array, col_skip: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Column-stage summaries: ``x_train_cols: [..., N]`` -> ``[..., L, I, E]``.

        With ``col_skip`` (bool ``[...]``), also the training cells' embeddings
        ``[..., N, E]`` (see ``ColumnEmbedding.summaries``).
        """
        return self.col_embedder.summaries(x_train_cols, train_mask, col_skip)

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
        return self.embed_cells(embeddings, member_table, member_perm, feature_mask)

    def embed_cells(
        self,
        embeddings: jax.Array,
        member_table: jax.Array,
        member_perm: jax.Array,
        feature_mask: jax.Array,
    ) -> jax.Array:
        """Row stage of ``embed_rows`` from cell embeddings ``[G, H, R, E]`` -> ``[B, R, D]``."""
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
