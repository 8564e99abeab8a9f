"""Memory-bounded inference of the TabICL network: chunked, bucketed, optionally sharded.

``predict_logits`` is the counterpart of the reference's eval-mode ``TabICL.forward``:
logits (or probabilities) of the test rows restricted to the classes present, with the
class hierarchy above ``max_classes`` classes. It never materialises the ``[B, T, H, E]``
cell embeddings nor any ``T x N`` attention matrix of a whole table:

1. **Column stage, training rows.** Each column's inducing summaries (``[L, I, E]``) are
   computed from its training rows, a few columns at a time (``col_chunk``).
2. **Row representations.** With the summaries fixed, any row embeds on its own, so
   rows go through the column and row stages in chunks (``row_chunk``). The column stage
   runs once per base table and is permuted per ensemble member.
3. **ICL, block by block.** Every block's keys and values come from the training rows
   only, so each block processes its query rows in chunks (``query_chunk``); the last
   block only updates the test rows. Test rows never influence each other, so splitting
   the test rows over several calls (``test_chunk``) gives the same numbers.

Shapes are padded to a few bucket sizes (rows, features; at most 1/8 extra) with masks,
so that tables of similar size reuse compiled programs. With a ``mesh``, ensemble
members are sharded over the batch axes (``act_batch``); parameters are replicated.

This file plans the chunks, validates and pads the inputs, runs the members in batches
and walks the class hierarchy; the jitted stages themselves are in
``lhc.tabicl.chunked``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lhc.parallel.mesh import LOGICAL_AXIS_RULES, batch_sharding
from lhc.tabicl.chunked import embed_cells, embed_rows, icl_logits, train_summaries
from lhc.tabicl.config import SKIP_VALUE, TabICLConfig
from lhc.tabicl.model import TabICL

DEFAULT_MEMORY_BUDGET_MB = 512
# Per-chunk working sets are also held near this size, about a CPU's last-level cache:
# on a 2-core AVX2 CPU, 32 MB chunks ran the 1K-row benchmark 1.5x faster than 512 MB
# ones (experiments/tabicl/README.md). The memory budget still bounds them from above.
CACHE_BUDGET_MB = 32
# An ICL query chunk never goes below this many rows (unless the memory budget says so):
# smaller ones leave the projections and the feed-forward layer with too little work.
MIN_QUERY_CHUNK = 256
# The reference's class hierarchy always uses this temperature inside the tree.
HIERARCHY_SOFTMAX_TEMPERATURE = 0.9
_FLOAT_BYTES = 4


def bucket_size(n: int) -> int:
    """Rounds ``n`` up to a size with at most 4 significant bits (at most 1/8 larger)."""
    if n <= 16:
        return max(int(n), 1)
    step = 1 << (int(n).bit_length() - 4)
    return -(-int(n) // step) * step


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Chunk sizes of one inference call.

    Attributes:
        col_chunk: columns per step of the training-row column stage.
        row_chunk: rows per step of the row embedding.
        query_chunk: query rows per step of an ICL block.
        test_chunk: test rows per call (the training rows are recomputed per call).
        keep_train_cells: keep the training cells' column embeddings from the summary
            pass (``[G, H, N, E]`` floats within the memory budget) instead of running
            the column stage on the training rows a second time.
    """

    col_chunk: int
    row_chunk: int
    query_chunk: int
    test_chunk: int
    keep_train_cells: bool = False


def _floor_pow2(n: float, lo: int, hi: int) -> int:
    n = int(max(lo, min(n, hi)))
    return max(lo, 1 << (n.bit_length() - 1))


def plan_chunks(
    config: TabICLConfig,
    *,
    num_tables: int,
    num_features: int,
    num_train: int,
    num_members: int,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
) -> ChunkPlan:
    """Chunk sizes whose working sets stay near ``memory_budget_mb`` (float32).

    The estimates count the largest intermediates per unit of work from the shapes:
    attention scores and probabilities, the block activations and the feed-forward
    hidden layer. The column, row and query chunks also stay near ``CACHE_BUDGET_MB``
    (faster on CPUs; the ICL query chunk keeps at least ``MIN_QUERY_CHUNK`` rows); the
    test chunk, the rows of one call, only near the memory budget.
    """
    budget = memory_budget_mb * 2**20 / _FLOAT_BYTES
    fast = min(memory_budget_mb, CACHE_BUDGET_MB) * 2**20 / _FLOAT_BYTES
    width, ffn = config.embed_dim, config.embed_dim * config.ff_factor
    # Per (column, row) cell of the column stage: scores+probs of both ISAB attentions.
    col_cell = 2 * 2 * config.col_nhead * config.col_num_inds + 8 * width + 2 * ffn
    col_chunk = _floor_pow2(fast / (num_train * col_cell), 1, num_tables * num_features)
    tokens = config.row_num_cls + num_features
    row_token = 2 * config.row_nhead * tokens + 8 * width + 2 * ffn
    per_row = num_tables * num_features * col_cell + num_members * tokens * row_token
    row_chunk = _floor_pow2(fast / per_row, 1, 1 << 16)
    icl_width = config.icl_dim
    per_query = num_members * (
        2 * config.icl_nhead * num_train + 8 * icl_width + 2 * config.ff_factor * icl_width
    )
    query_chunk = max(
        _floor_pow2(fast / per_query, 1, 1 << 16),
        _floor_pow2(budget / per_query, 1, MIN_QUERY_CHUNK),
    )
    # Every call recomputes the training rows (the N x N part of the ICL), so a test
    # chunk is never smaller than the training set: splitting at most doubles the work.
    # Beyond that, the [B, rows, D] residual stream of a call stays within the budget.
    rows = budget / (num_members * icl_width)
    test_chunk = bucket_size(int(min(max(rows, num_train, 256), 1 << 22)))
    keep_train_cells = num_tables * num_features * num_train * width <= budget
    return ChunkPlan(col_chunk, row_chunk, query_chunk, test_chunk, keep_train_cells)


# ----------------------------------------------------------------------------- driver


def _softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    x = x / np.float32(temperature)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def class_groups(num_classes: int, max_classes: int) -> np.ndarray:
    """Group of each of ``num_classes`` sorted classes: at most ``max_classes`` balanced
    contiguous groups (the reference's ``ICLearning._grouping``)."""
    if num_classes <= max_classes:
        return np.zeros(num_classes, np.int64)
    num_groups = min(math.ceil(num_classes / max_classes), max_classes)
    groups = np.zeros(num_classes, np.int64)
    start, remaining = 0, num_classes
    for group in range(num_groups):
        size = math.ceil(remaining / (num_groups - group))
        groups[start : start + size] = group
        start += size
        remaining -= size
    return groups


def _check_labels(y_train: np.ndarray) -> int:
    """Number of classes K; every table's labels must be exactly 0..K-1."""
    if not np.all(np.isfinite(y_train)) or not np.all(y_train == np.round(y_train)):
        raise ValueError("y_train must hold integer class indices")
    counts = {len(np.unique(row)) for row in y_train}
    if len(counts) != 1:
        raise ValueError(
            f"all tables must have the same number of classes, found counts {sorted(counts)}"
        )
    num_classes = counts.pop()
    for row in y_train:
        if not np.array_equal(np.unique(row), np.arange(num_classes)):
            raise ValueError(
                f"y_train classes must be 0..{num_classes - 1} (each present), found "
                f"{np.unique(row)[:12]}"
            )
    return num_classes


def _mesh_batch_size(sharding: NamedSharding) -> int:
    """Devices along the mesh axes that split the member axis."""
    axes = sharding.spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(sharding.mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _Tables:
    """Validated inputs, padded to bucket sizes.

    ``table`` holds the G base tables ``[G, N_pad + M, H_pad]``: training rows (zero
    padded to N_pad), then the M test rows; padded features are zero columns at the end.
    """

    table: np.ndarray
    num_train: int
    col_skip: np.ndarray  # bool [G, H_pad]
    feature_mask: np.ndarray  # bool [H_pad]
    member_table: np.ndarray  # int [B]
    member_perm: np.ndarray  # int32 [B, H_pad]
    y_train: np.ndarray  # int [B, N], the labels as given
    y_pad: np.ndarray  # int32 [B, N_pad]
    num_classes: int

    @property
    def train_pad(self) -> int:
        return self.y_pad.shape[1]

    @property
    def num_test(self) -> int:
        return self.table.shape[1] - self.train_pad

    def rows(self, test_start: int, test_stop: int, *, with_train: bool = True) -> np.ndarray:
        """``[G, N_pad + bucket(count), H_pad]``: all training rows, then some test rows
        (``[G, bucket(count), H_pad]``, the test rows alone, without ``with_train``)."""
        count = test_stop - test_start
        first = self.train_pad if with_train else 0
        rows = np.zeros(
            (self.table.shape[0], first + bucket_size(count), self.table.shape[2]), np.float32
        )
        rows[:, :first] = self.table[:, :first]
        rows[:, first : first + count] = self.table[
            :, self.train_pad + test_start : self.train_pad + test_stop
        ]
        return rows


def _prepare(X, y_train, feature_permutations) -> _Tables:
    X = np.asarray(X, dtype=np.float32)
    y_train = np.asarray(y_train)
    if feature_permutations is None:
        if X.ndim != 3:
            raise ValueError(f"X must be [B, T, H] without feature_permutations, got {X.shape=}")
        base, member_table = X, np.arange(X.shape[0])
        perms = np.broadcast_to(np.arange(X.shape[2]), (X.shape[0], X.shape[2]))
    else:
        if X.ndim != 2:
            raise ValueError(f"X must be [T, H] with feature_permutations, got {X.shape=}")
        base, perms = X[None], np.asarray(feature_permutations)
        if perms.ndim != 2 or perms.shape[1] != X.shape[1]:
            raise ValueError(f"feature_permutations must be [B, H={X.shape[1]}], got {perms.shape}")
        if not np.all(np.sort(perms, axis=1) == np.arange(X.shape[1])):
            raise ValueError("every row of feature_permutations must permute range(H)")
        member_table = np.zeros(perms.shape[0], np.int64)
    num_members = perms.shape[0]
    num_tables, num_rows, num_features = base.shape
    if y_train.ndim != 2 or y_train.shape[0] != num_members:
        raise ValueError(f"y_train must be [B={num_members}, N], got {y_train.shape}")
    num_train = y_train.shape[1]
    if num_train < 1 or num_rows - num_train < 1:
        raise ValueError(
            f"need at least one training and one test row, got N={num_train} of T={num_rows}"
        )
    if num_features < 1:
        raise ValueError("X has no features")
    if not np.all(np.isfinite(base)):
        raise ValueError("X contains NaN or inf")
    num_classes = _check_labels(y_train)

    features_pad, train_pad = bucket_size(num_features), bucket_size(num_train)
    table = np.zeros((num_tables, train_pad + num_rows - num_train, features_pad), np.float32)
    table[:, :num_train, :num_features] = base[:, :num_train]
    table[:, train_pad:, :num_features] = base[:, num_train:]
    col_skip = np.zeros((num_tables, features_pad), bool)
    col_skip[:, :num_features] = np.all(base == SKIP_VALUE, axis=1)
    # Padded features stay in place (at the end) for every member.
    padding = np.arange(num_features, features_pad)
    member_perm = np.concatenate(
        [perms, np.broadcast_to(padding, (num_members, len(padding)))], axis=1
    ).astype(np.int32)
    y_pad = np.zeros((num_members, train_pad), np.int32)
    y_pad[:, :num_train] = y_train
    return _Tables(
        table=table,
        num_train=num_train,
        col_skip=col_skip,
        feature_mask=np.arange(features_pad) < num_features,
        member_table=member_table,
        member_perm=member_perm,
        y_train=y_train.astype(np.int64),
        y_pad=y_pad,
        num_classes=num_classes,
    )


def predict_logits(
    model: TabICL,
    params,
    X,
    y_train,
    *,
    feature_permutations=None,
    return_logits: bool = True,
    softmax_temperature: float = 0.9,
    batch_size: int | None = None,
    memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    mesh: Mesh | None = None,
    verbose: bool = False,
) -> np.ndarray:
    """Eval-mode forward of TabICL: test-row outputs restricted to the classes present.

    Same outputs as the reference ``TabICL(...).eval()(X, y_train,
    return_logits=..., softmax_temperature=...)`` on the explicitly permuted tables.

    Args:
        model: the network (its ``config`` and ``dtype``).
        params: its parameters.
        X: ``[B, T, H]`` tables, the first N rows of each are training rows; or, with
            ``feature_permutations``, one shared table ``[T, H]``.
        y_train: ``[B, N]`` labels; each table's classes must be exactly 0..K-1 with the
            same K for all tables. K > ``max_classes`` uses the class hierarchy.
        feature_permutations: int ``[B, H]``; member b sees the shared table's columns
            in the order ``feature_permutations[b]``. The column stage then runs once.
        return_logits: logits (True) or ``softmax(logits / softmax_temperature)``.
            Above ``max_classes`` classes the logits are
            ``softmax_temperature * log(p + 1e-6)`` of the hierarchy's probabilities p.
        batch_size: members per network call (None: all).
        memory_budget_mb: bound on per-chunk working sets (see ``plan_chunks``).
        mesh: shard the members of a call over the mesh's batch axes (``act_batch``);
            the member batch is padded to a multiple of their size.

    Returns:
        float32 numpy ``[B, M, K]`` with M = T - N.

    Raises:
        ValueError: shapes that do not fit, non-finite X, or labels that are not 0..K-1.
    """
    tables = _prepare(X, y_train, feature_permutations)
    num_members = len(tables.member_table)
    member_sharding = None
    batch_size = num_members if batch_size is None else max(1, int(batch_size))
    if mesh is not None:
        member_sharding = batch_sharding(mesh, LOGICAL_AXIS_RULES, 1)
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        devices = _mesh_batch_size(member_sharding)
        batch_size = -(-batch_size // devices) * devices
    plan = plan_chunks(
        model.config,
        num_tables=tables.table.shape[0],
        num_features=tables.table.shape[2],
        num_train=tables.train_pad,
        num_members=min(batch_size, num_members),
        memory_budget_mb=memory_budget_mb,
    )
    if verbose:
        print(
            f"TabICL inference: N={tables.num_train} (padded {tables.train_pad}) "
            f"H_pad={tables.table.shape[2]} M={tables.num_test} members={num_members} {plan}"
        )

    summaries = train_summaries(
        model,
        params,
        jnp.asarray(np.swapaxes(tables.table[:, : tables.train_pad], 1, 2)),
        jnp.asarray(np.arange(tables.train_pad) < tables.num_train),
        jnp.asarray(tables.col_skip) if plan.keep_train_cells else None,
        col_chunk=plan.col_chunk,
    )
    # With kept training cells, ``summaries`` is (summaries, cells).
    outputs = []
    for start in range(0, num_members, batch_size):
        members = np.arange(start, min(start + batch_size, num_members))
        outputs.append(
            _predict_members(
                model, params, tables, summaries, members, batch_size, plan, member_sharding
            )
        )
    out = np.concatenate(outputs, axis=0)
    if tables.num_classes > model.config.max_classes:
        # The hierarchy yields probabilities.
        return softmax_temperature * np.log(out + 1e-6) if return_logits else out
    return out if return_logits else _softmax(out, softmax_temperature)


def _predict_members(
    model: TabICL,
    params,
    tables: _Tables,
    summaries: jax.Array,
    members: np.ndarray,
    batch_size: int,
    plan: ChunkPlan,
    member_sharding: NamedSharding | None,
) -> np.ndarray:
    """Logits ``[b, M, K]`` (class-tree probabilities above ``max_classes``) of some members."""
    padded = members
    if member_sharding is not None and len(members) % batch_size:
        # Fill the batch with copies of the last member so that it splits over devices.
        padded = np.concatenate([members, np.full(batch_size - len(members), members[-1])])

    def put(array: np.ndarray) -> jax.Array:
        if member_sharding is None:
            return jnp.asarray(array)
        spec = PartitionSpec(member_sharding.spec[0], *([None] * (array.ndim - 1)))
        return jax.device_put(array, NamedSharding(member_sharding.mesh, spec))

    member_table, member_perm = put(tables.member_table[padded]), put(tables.member_perm[padded])
    y_pad = put(tables.y_pad[padded])
    train_mask = jnp.asarray(np.arange(tables.train_pad) < tables.num_train)
    hierarchical = tables.num_classes > model.config.max_classes
    feature_mask = jnp.asarray(tables.feature_mask)
    train_representations = None
    if plan.keep_train_cells:
        # The training rows embed once, from the cells kept by the summary pass.
        summaries, train_cells = summaries
        train_representations = embed_cells(
            model,
            params,
            train_cells,
            member_table,
            member_perm,
            feature_mask,
            row_chunk=plan.row_chunk,
            member_sharding=member_sharding,
        )
    chunks = []
    for test_start in range(0, tables.num_test, plan.test_chunk):
        test_stop = min(test_start + plan.test_chunk, tables.num_test)
        count = test_stop - test_start
        representations = embed_rows(
            model,
            params,
            jnp.asarray(tables.rows(test_start, test_stop, with_train=not plan.keep_train_cells)),
            summaries,
            jnp.asarray(tables.col_skip),
            member_table,
            member_perm,
            feature_mask,
            row_chunk=plan.row_chunk,
            member_sharding=member_sharding,
        )
        if train_representations is not None:
            representations = jnp.concatenate([train_representations, representations], axis=1)
        if not hierarchical:
            logits = icl_logits(
                model,
                params,
                representations,
                y_pad,
                train_mask,
                query_chunk=plan.query_chunk,
                member_sharding=member_sharding,
            )
            chunks.append(np.asarray(logits)[: len(members), :count, : tables.num_classes])
            continue
        representations = np.asarray(representations)
        chunks.append(
            np.stack(
                [
                    _hierarchy_probs(
                        model,
                        params,
                        representations[i],
                        tables.y_train[member],
                        tables.train_pad,
                        plan,
                        tables.num_classes,
                    )[:count]
                    for i, member in enumerate(members)
                ]
            )
        )
    return np.concatenate(chunks, axis=1).astype(np.float32)


def _hierarchy_probs(
    model: TabICL,
    params,
    representations: np.ndarray,
    y_train: np.ndarray,
    train_pad: int,
    plan: ChunkPlan,
    num_classes: int,
) -> np.ndarray:
    """Class probabilities of one member through the class tree.

    Args:
        representations: ``[train_pad + M, D]`` row representations of the member.
        y_train: int ``[N]`` labels 0..K-1.

    Returns:
        float32 ``[M, K]``: products of the node probabilities down the tree.
    """
    max_classes = model.config.max_classes
    num_train = len(y_train)
    train_reps, test_reps = representations[:num_train], representations[train_pad:]
    y_train = y_train.astype(np.int64)

    def node_probs(rows: np.ndarray, labels: np.ndarray, count: int) -> np.ndarray:
        size = bucket_size(len(rows))
        reps = np.zeros((1, size + len(test_reps), representations.shape[-1]), np.float32)
        reps[0, : len(rows)] = train_reps[rows]
        reps[0, size:] = test_reps
        y = np.zeros((1, size), np.int32)
        y[0, : len(rows)] = labels
        logits = icl_logits(
            model,
            params,
            jnp.asarray(reps),
            jnp.asarray(y),
            jnp.asarray(np.arange(size) < len(rows)),
            query_chunk=plan.query_chunk,
        )
        return _softmax(np.asarray(logits)[0, :, :count], HIERARCHY_SOFTMAX_TEMPERATURE)

    def visit(classes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        labels = np.searchsorted(classes, y_train[rows])
        out = np.zeros((len(test_reps), num_classes), np.float32)
        if len(classes) <= max_classes:
            out[:, classes] = node_probs(rows, labels, len(classes))
            return out
        groups = class_groups(len(classes), max_classes)
        group_labels = groups[labels]
        group_probs = node_probs(rows, group_labels, int(groups.max()) + 1)
        for group in range(int(groups.max()) + 1):
            child = visit(classes[groups == group], rows[group_labels == group])
            out += child * group_probs[:, group : group + 1]
        return out

    return visit(np.arange(num_classes), np.arange(num_train))
