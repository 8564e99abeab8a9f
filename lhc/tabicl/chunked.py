"""The jitted stages of TabICL's chunked inference, each a loop over chunks.

``train_summaries`` (columns of the training rows), ``embed_rows`` and ``embed_cells``
(rows) and ``icl_logits`` (query rows of each ICL block) bound their working sets by
processing a few columns or rows at a time; ``lhc.tabicl.inference`` picks the chunk
sizes and drives them. With a ``member_sharding``, the ensemble-member axis of every
output is split over the devices of its mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from lhc.tabicl.layers import AttentionBlock
from lhc.tabicl.model import TabICL
from lhc.tabicl.stages import icl_block


def _map_chunks(fn, x: jax.Array, chunk: int, axis: int):
    """``fn`` over chunks of ``chunk`` entries of ``x`` along ``axis``, one after another.

    ``fn`` must keep ``axis`` as the chunk axis of every array it returns (an array or a
    tuple of arrays). Chunks are read and written in place inside a loop (no padded or
    transposed copies of ``x``); the last chunk is shifted back to end at the last entry,
    so a few entries are computed twice, to the same values.
    """
    size = x.shape[axis]
    if size <= chunk:
        return fn(x)
    pieces = jax.eval_shape(fn, jax.lax.slice_in_dim(x, 0, chunk, axis=axis))
    outs = jax.tree.map(
        lambda p: jnp.zeros((*p.shape[:axis], size, *p.shape[axis + 1 :]), p.dtype), pieces
    )

    def body(index, outs):
        start = jnp.minimum(index * chunk, size - chunk)
        parts = fn(jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=axis))
        return jax.tree.map(
            lambda out, part: jax.lax.dynamic_update_slice_in_dim(out, part, start, axis=axis),
            outs,
            parts,
        )

    return jax.lax.fori_loop(0, -(-size // chunk), body, outs)


def _constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    if sharding is None:
        return x
    spec = PartitionSpec(sharding.spec[0], *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, spec))


def _map_member_rows(fn, x: jax.Array, chunk: int, member_sharding: NamedSharding | None):
    """``fn`` over chunks of rows (axis 1) of ``x``; its ``[B, rows, ...]`` outputs, and
    their concatenation, split over the members' sharding."""

    def step(rows):
        return _constrain(fn(rows), member_sharding)

    return _constrain(_map_chunks(step, x, chunk, axis=1), member_sharding)


@functools.partial(jax.jit, static_argnames=("model", "col_chunk"))
def train_summaries(
    model: TabICL,
    params,
    x_train_cols: jax.Array,
    train_mask: jax.Array,
    col_skip: jax.Array | None = None,
    *,
    col_chunk: int,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Column-stage summaries of the training rows.

    Args:
        x_train_cols: ``[G, H, N]`` training cells of every column of G base tables.
        train_mask: bool ``[N]``, False for padded training rows.
        col_skip: bool ``[G, H]``; given, the training cells' embeddings come back too.

    Returns:
        ``[G, H, L, I, E]``; with ``col_skip``, also the cell embeddings ``[G, N, H, E]``
        (rows first, as ``embed_cells`` takes them).
    """
    num_tables, num_features, num_train = x_train_cols.shape
    flat = x_train_cols.reshape(num_tables * num_features, num_train)
    flat_skip = None if col_skip is None else col_skip.reshape(-1)

    def step(columns):  # chunks of column indices, so that cells and skips stay aligned
        skip = None if flat_skip is None else flat_skip[columns]
        return model.apply(
            {"params": params}, flat[columns], train_mask, skip, method=TabICL.train_summaries
        )

    out = _map_chunks(step, jnp.arange(num_tables * num_features), col_chunk, axis=0)
    unflat = lambda a: a.reshape(num_tables, num_features, *a.shape[1:])  # noqa: E731
    if flat_skip is None:
        return unflat(out)
    summaries, cells = out
    return unflat(summaries), jnp.swapaxes(unflat(cells), 1, 2)


def _row_stage(method, doc: str, *, rows_first_cells: bool = False):
    """A jitted stage that runs ``method`` of ``TabICL`` on ``row_chunk`` rows at a time.

    The stage takes ``(model, params, x, *inputs, row_chunk, member_sharding=None)``:
    the rows are axis 1 of ``x``, ``inputs`` are the method's other arguments, and the
    ``[B, R, D]`` row representations come back split over ``member_sharding``. With
    ``rows_first_cells``, ``x`` is cell embeddings ``[G, R, H, E]``, which the method
    takes as ``[G, H, R, E]``.
    """

    def stage(
        model: TabICL,
        params,
        x: jax.Array,
        *inputs: jax.Array,
        row_chunk: int,
        member_sharding: NamedSharding | None = None,
    ) -> jax.Array:
        def step(rows):
            if rows_first_cells:
                rows = jnp.swapaxes(rows, 1, 2)
            return model.apply({"params": params}, rows, *inputs, method=method)

        return _map_member_rows(step, x, row_chunk, member_sharding)

    stage.__name__ = stage.__qualname__ = method.__name__
    stage.__doc__ = doc
    return jax.jit(stage, static_argnames=("model", "row_chunk", "member_sharding"))


embed_rows = _row_stage(
    TabICL.embed_rows,
    """Row representations ``[B, R, D]`` of rows ``x: [G, R, H]``, ``row_chunk`` rows at a
    time; ``inputs`` are the rest of ``TabICL.embed_rows``'s arguments (``summaries,
    col_skip, member_table, member_perm, feature_mask``).""",
)
embed_cells = _row_stage(
    TabICL.embed_cells,
    """Row representations ``[B, R, D]`` from cell embeddings ``x: [G, R, H, E]``,
    ``row_chunk`` rows at a time; ``inputs`` are the rest of ``TabICL.embed_cells``'s
    arguments (``member_table, member_perm, feature_mask``).""",
    rows_first_cells=True,
)


@functools.partial(jax.jit, static_argnames=("model", "query_chunk", "member_sharding"))
def icl_logits(
    model: TabICL,
    params,
    representations: jax.Array,
    y_train: jax.Array,
    train_mask: jax.Array,
    *,
    query_chunk: int,
    member_sharding: NamedSharding | None = None,
) -> jax.Array:
    """ICL stage, block by block, query rows in chunks.

    Args:
        representations: ``[B, N + M, D]``, the N training rows first.
        y_train: int ``[B, N]``.
        train_mask: bool ``[N]`` (or ``[B, N]``), False for padded training rows.

    Returns:
        float32 ``[B, M, max_classes]``.
    """
    num_train = y_train.shape[1]
    key_mask = train_mask if train_mask.ndim == 1 else train_mask[:, None, :]
    h = model.apply({"params": params}, representations, y_train, method=TabICL.icl_add_labels)
    block = icl_block(model.config, model.dtype, model.param_dtype)
    blocks = params["icl_predictor"]
    num_blocks = model.config.icl_num_blocks

    def run_block(h, block_params, first_query):
        key, value = block.apply(
            {"params": block_params}, h[:, :num_train], method=AttentionBlock.key_value
        )

        def step(rows):
            return block.apply(
                {"params": block_params}, rows, key, value, key_mask, method=AttentionBlock.attend
            )

        return _map_member_rows(step, h[:, first_query:], query_chunk, member_sharding)

    if num_blocks > 1:
        # One loop over the blocks keeps a fixed number of [B, T, D] buffers alive; an
        # unrolled Python loop made XLA keep one per block.
        stacked = jax.tree.map(
            lambda *leaves: jnp.stack(leaves),
            *(blocks[f"blocks_{i}"] for i in range(num_blocks - 1)),
        )
        h, _ = jax.lax.scan(lambda h, p: (run_block(h, p, 0), None), h, stacked)
    # The training rows' last-block outputs feed nothing: only the test rows go through.
    h = run_block(h, blocks[f"blocks_{num_blocks - 1}"], num_train)

    def decode(rows):
        return model.apply({"params": params}, rows, method=TabICL.icl_decode)

    return _constrain(_map_chunks(decode, h, query_chunk, axis=1), member_sharding)
