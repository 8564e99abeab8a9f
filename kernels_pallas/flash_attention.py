"""Memory-efficient attention with lhc's position mask: XLA and Pallas (TPU, GPU).

Query ``t`` of batch row ``b`` may attend key slot ``s`` iff::

        key_positions[b, s] >= 0 and query_positions[b, t] >= 0
        and key_positions[b, s] <= query_positions[b, t]
        and (window is None or query_positions[b, t] - key_positions[b, s] < window)

so the mask comes from positions alone: key slots may be in any order (a KV cache holds
tokens wherever they were written), negative positions mark padding or empty slots, and
a query at position ``p`` with a window ``W`` sees keys at positions in ``(p - W, p]``. A
query with no visible key outputs exactly zero and passes no gradient back.

Shapes use ``B`` batch, ``T`` query length, ``S`` key length, ``N`` query heads, ``K``
key/value heads (``N = K * G``: query head ``n`` reads kv head ``n // G``), ``H`` head dim.

Implementations (``impl``):

* ``"xla"``: an online-softmax ``lax.scan`` over query blocks and, inside, over key
    blocks, with a ``custom_vjp`` whose backward recomputes probabilities per block from
    the saved log-sum-exp. Peak memory grows with the block sizes, never with ``T * S``.
* ``"pallas"``: FlashAttention-2 kernels, forward (saves the per-row log-sum-exp) and
    backward (one kernel for dq, one for dk/dv, both recomputing probabilities), lowered
    for TPU through Mosaic (``backend="tpu"``) or for GPU through Triton
    (``backend="gpu"``). On CPU they run with ``interpret=True``.

Both skip a (query block, key block) pair whose position ranges cannot produce a single
visible pair (a block above the causal diagonal, or outside the window), which is exact.

Scores, the running max and sum and the output accumulator are float32 whatever the
input dtype; the output is cast to ``query.dtype``.

Why lhc has its own kernels rather than a maintained one: jax's Pallas flash attention
(``jax.experimental.pallas.ops.tpu/gpu``), tokamax and cuDNN through
``jax.nn.dot_product_attention`` take a causal mask by *index* plus segment ids (or a
sliding window by index, or an explicit bias), while lhc's caches hold tokens in any slot
order with positions that need not equal slot indices (left padding, rings, rewound and
re-appended spans). A causal mask by index is wrong there, and a full ``[T, S]`` bias is
the memory this op exists to avoid; the position mask is computed in the kernel from two
integer vectors instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    DEFAULT_MASK_VALUE,
    MIN_TRITON_DOT_DIM,
    NUM_LANES,
    NUM_SUBLANES,
    check_impl,
    check_scale,
    gpu_compiler_params,
    resolve_backend,
)
from kernels_pallas._common import NN as _NN
from kernels_pallas._common import NT as _NT
from kernels_pallas._common import TN as _TN
from kernels_pallas._common import matmul as _matmul

# Block statistics for blocks without a valid position: min = this, max = -1, so such a
# block never passes `_blocks_may_interact`.
_NO_POSITION = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the chunked computation, shared by the forward and backward passes.

    Each size is clipped to the sequence length for short inputs (to the next power of
    two on the GPU backend, where Triton needs power-of-two tiles); longer sequences are
    padded to a multiple of it inside `flash_attention`.

    Attributes:
        block_q: queries per block (per query head; the TPU kernels process the ``G`` query
            heads of one kv head together, so a TPU query tile holds ``G * block_q`` rows).
        block_k: keys per block.
    """

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {size!r}.")


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, resolved and validated (hashable: a jit static)."""

    scale: float
    window: int | None
    block_q: int
    block_k: int
    impl: str
    backend: str
    interpret: Any


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    *,
    scale: float | None = None,
    window: int | None = None,
    impl: str = "xla",
    interpret: Any = False,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Attention of ``query`` over ``key``/``value`` under the position mask.

    Args:
        query: [B, T, N, H] float32 or bfloat16.
        key: [B, S, K, H], the dtype of query; ``N`` must be a multiple of ``K``.
        value: [B, S, K, H].
        query_positions: int [B, T]; negative marks a padding query.
        key_positions: int [B, S]; negative marks an empty or padding key slot.
        scale: multiplies the scores; defaults to ``H ** -0.5``.
        window: None, or an int ``W >= 1``: a query at position ``p`` sees keys at
            positions in ``(p - W, p]``.
        impl: ``"xla"`` (chunked plain JAX) or ``"pallas"`` (kernels).
        interpret: run the Pallas kernels in interpret mode (needed on CPU); True or a
            ``pltpu.InterpretParams`` for the TPU-style kernels; None interprets exactly
            when no backend is named and the default backend is CPU.
        block_sizes: tile sizes; defaults to ``BlockSizes()`` (128 x 128).
        backend: Pallas lowering, ``"tpu"`` (Mosaic) or ``"gpu"`` (Triton). Defaults to the
            default JAX backend, and to the TPU-style kernels on CPU. Naming one explicitly
            also allows lowering ahead of time for that accelerator from a CPU host.

    Returns:
        [B, T, N, H] in ``query.dtype``; rows of queries with no visible key are zero.

    Raises:
        ValueError: on wrong shapes, dtypes or settings, naming the argument.
    """
    _check_inputs(query, key, value, query_positions, key_positions)
    scale = check_scale(scale, query.shape[-1])
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1
    ):
        raise ValueError(f"window must be None or an int >= 1, got {window=!r}.")
    check_impl(impl)
    if block_sizes is None:
        block_sizes = BlockSizes()
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes or None, got {block_sizes!r}.")
    # Only the tiling rules of the chosen implementation matter ("xla" for impl="xla").
    backend, interpret = resolve_backend(impl, backend, interpret)

    seq_len_q, seq_len_k = query.shape[1], key.shape[1]
    block_q = _clip_block(block_sizes.block_q, seq_len_q, backend)
    block_k = _clip_block(block_sizes.block_k, seq_len_k, backend)
    if impl == "pallas":
        _check_pallas_blocks(
            block_q,
            block_k,
            _round_up(seq_len_q, block_q),
            _round_up(seq_len_k, block_k),
            query.dtype,
            backend,
            interpret,
        )
    config = _Config(
        scale=scale,
        window=None if window is None else int(window),
        block_q=block_q,
        block_k=block_k,
        impl=impl,
        backend=backend,
        interpret=interpret if impl == "pallas" else False,
    )
    return _flash_attention(query, key, value, query_positions, key_positions, config)


def _check_inputs(query, key, value, query_positions, key_positions):
    """Raises ValueError unless the arrays have the documented shapes and dtypes."""
    for name, array in (("query", query), ("key", key), ("value", value)):
        if getattr(array, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([B, T, N, H] / [B, S, K, H]), got "
                f"{name}.shape={getattr(array, 'shape', None)}."
            )
        if array.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name} must be float32 or bfloat16, got {name}.dtype={array.dtype}.")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"query, key and value must share a dtype, got {query.dtype=}, {key.dtype=}, "
            f"{value.dtype=}."
        )
    batch, seq_len_q, num_heads, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got {key.shape=}, {value.shape=}."
        )
    if key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            "key must match query in batch and head_dim ([B, S, K, H] vs [B, T, N, H]), got "
            f"{query.shape=}, {key.shape=}."
        )
    num_kv_heads = key.shape[2]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            "query heads N must be a multiple of kv heads K, got "
            f"{query.shape=} (N={num_heads}), {key.shape=} (K={num_kv_heads})."
        )
    for name, array, expected in (
        ("query_positions", query_positions, (batch, seq_len_q)),
        ("key_positions", key_positions, (batch, key.shape[1])),
    ):
        if getattr(array, "shape", None) != expected:
            raise ValueError(
                f"{name} must have shape {expected} ([B, T] / [B, S]), got "
                f"{name}.shape={getattr(array, 'shape', None)}."
            )
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must have an integer dtype, got {name}.dtype={array.dtype}.")


def _round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _clip_block(block: int, length: int, backend: str) -> int:
    """The block actually used along a sequence of `length` for `backend`."""
    if backend == "gpu":
        # Triton tiles are powers of two and tl.dot needs >= 16: a short sequence (a
        # decode step) is padded up to one such block.
        return min(block, max(pl.next_power_of_2(length), MIN_TRITON_DOT_DIM))
    # One block covering the whole sequence is the full array dim, which Mosaic accepts
    # whatever its size, so a short sequence needs no padding at all.
    return min(block, length)


def _check_pallas_blocks(block_q, block_k, padded_q, padded_k, dtype, backend, interpret):
    """Raises ValueError for tiles the chosen compiler cannot lower."""
    if backend == "gpu":
        for name, size in (("block_q", block_q), ("block_k", block_k)):
            if size & (size - 1):
                raise ValueError(
                    f"backend='gpu' needs power-of-two blocks (Triton tiles), got {name}={size}."
                )
        if not interpret and min(block_q, block_k) < MIN_TRITON_DOT_DIM:
            raise ValueError(
                f"backend='gpu' needs blocks >= {MIN_TRITON_DOT_DIM} (tl.dot), got "
                f"{block_q=}, {block_k=}."
            )
        return
    if interpret:
        return  # The interpreter has no tiling rules; any block runs.
    # Mosaic: a tiled dim of a block is a multiple of the vreg tile or the full array dim.
    sublanes = NUM_SUBLANES * (4 // jnp.dtype(dtype).itemsize)  # 8 for f32, 16 for bf16
    if block_q != padded_q and block_q % sublanes:
        raise ValueError(
            f"backend='tpu' needs block_q a multiple of {sublanes} for {jnp.dtype(dtype).name} "
            f"when the queries span several blocks, got {block_q=} for {padded_q} queries."
        )
    if block_k != padded_k and block_k % NUM_LANES:
        raise ValueError(
            f"backend='tpu' needs block_k a multiple of {NUM_LANES} when the keys span "
            f"several blocks, got {block_k=} for {padded_k} keys."
        )


# --------------------------------------------------------------------------------------
# Padding, custom_vjp and dispatch.
# --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config",))
def _flash_attention(query, key, value, query_positions, key_positions, config: _Config):
    """Pads T and S to whole blocks, runs the differentiable core, slices back."""
    seq_len_q, seq_len_k = query.shape[1], key.shape[1]
    pad_q = _round_up(seq_len_q, config.block_q) - seq_len_q
    pad_k = _round_up(seq_len_k, config.block_k) - seq_len_k
    # Padded slots get position -1, so the mask hides them: padded keys are never seen,
    # padded queries see nothing and output zeros that are sliced away.
    pad_seq = lambda x, pad: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    query, key, value = pad_seq(query, pad_q), pad_seq(key, pad_k), pad_seq(value, pad_k)
    query_positions = jnp.pad(
        query_positions.astype(jnp.int32), ((0, 0), (0, pad_q)), constant_values=-1
    )
    key_positions = jnp.pad(
        key_positions.astype(jnp.int32), ((0, 0), (0, pad_k)), constant_values=-1
    )
    out = _attention(query, key, value, query_positions, key_positions, config)
    return out[:, :seq_len_q]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(query, key, value, query_positions, key_positions, config):
    out, _ = _forward(query, key, value, query_positions, key_positions, config)
    return out


def _attention_fwd(query, key, value, query_positions, key_positions, config):
    out, lse = _forward(query, key, value, query_positions, key_positions, config)
    return out, (query, key, value, query_positions, key_positions, out, lse)


def _attention_bwd(config, residuals, d_out):
    query, key, value, query_positions, key_positions, out, lse = residuals
    # delta = rowsum(dO * O) is the softmax-Jacobian term of FlashAttention-2; one cheap
    # elementwise XLA fusion, so no preprocessing kernel. Shape [B, N, T], like lse.
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    backward = {"xla": _xla_backward, "tpu": _tpu_backward, "gpu": _gpu_backward}[config.backend]
    d_query, d_key, d_value = backward(
        query, key, value, query_positions, key_positions, d_out, lse, delta, config
    )
    # Positions are integers: no cotangent.
    return d_query, d_key, d_value, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(query, key, value, query_positions, key_positions, config):
    """Returns (out [B, T, N, H] in query.dtype, lse [B, N, T] float32)."""
    forward = {"xla": _xla_forward, "tpu": _tpu_forward, "gpu": _gpu_forward}[config.backend]
    return forward(query, key, value, query_positions, key_positions, config)


# --------------------------------------------------------------------------------------
# Pieces shared by the implementations (not by the reference).
# --------------------------------------------------------------------------------------


def _probs_and_dscores(q, k, v, d_out, lse, delta, mask, scale):
    """FlashAttention-2 backward of one tile pair: recomputed probabilities and dS.

    Args:
        q, d_out: [bq, H]; k, v: [bk, H].
        lse, delta: float32 [bq, 1], the row log-sum-exp and rowsum(dO * O).
        mask: bool [bq, bk].
        scale: the score scale.

    Returns:
        probs float32 [bq, bk], and d_scores [bq, bk] in q's dtype, already multiplied by
        scale (so dq = d_scores @ k and dk = d_scores.T @ q).
    """
    scores = _matmul(q, k, _NT) * scale
    # The inner where keeps exp's argument finite for masked entries (lse is -inf on rows
    # that see nothing); the outer one zeroes them.
    probs = jnp.where(mask, jnp.exp(jnp.where(mask, scores, 0.0) - lse), 0.0)
    d_probs = _matmul(d_out, v, _NT)
    d_scores = (probs * (d_probs - delta) * scale).astype(q.dtype)
    return probs, d_scores


def _visible(q_pos, k_pos, window):
    """Elementwise mask of the module docstring; q_pos and k_pos broadcast together."""
    mask = (k_pos >= 0) & (q_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def _block_bounds(positions, block):
    """Per block, the smallest and largest valid position.

    Args:
        positions: int32 [B, L] with L a multiple of block.
        block: block length.

    Returns:
        (min_position, max_position), int32 [B, L // block] each; a block without a valid
        position gets (_NO_POSITION, -1).
    """
    batch, length = positions.shape
    blocks = positions.reshape(batch, length // block, block)
    valid = blocks >= 0
    min_position = jnp.min(jnp.where(valid, blocks, _NO_POSITION), axis=-1)
    max_position = jnp.max(jnp.where(valid, blocks, -1), axis=-1)
    return min_position, max_position


def _blocks_may_interact(q_min, q_max, k_min, k_max, window):
    """False only if no query of the block can see any key of the block.

    A visible pair has 0 <= k_pos <= q_pos (so k_min <= q_max) and, with a window,
    q_pos - k_pos < window (so k_max > q_min - window): skipping when either bound fails
    never drops a visible pair. Empty blocks fail the first test by construction.
    """
    may_interact = k_min <= q_max
    if window is not None:
        may_interact &= k_max > q_min - window
    return may_interact


# --------------------------------------------------------------------------------------
# impl="xla": chunked online softmax in plain JAX.
# --------------------------------------------------------------------------------------


def _xla_blocks(query, key, value, query_positions, key_positions, config):
    """Splits the padded inputs into scan-major blocks.

    Returns a dict with q [nq, B, K, G, bq, H], k and v [nk, B, K, bk, H], q_pos
    [nq, B, bq], k_pos [nk, B, bk] and block bounds q_min/q_max [nq, B], k_min/k_max [nk, B].
    """
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    nq, nk = seq_len_q // bq, seq_len_k // bk
    kv = lambda x: x.reshape(batch, nk, bk, num_kv_heads, head_dim).transpose(1, 0, 3, 2, 4)
    q_min, q_max = _block_bounds(query_positions, bq)
    k_min, k_max = _block_bounds(key_positions, bk)
    return dict(
        q=query.reshape(batch, nq, bq, num_kv_heads, group, head_dim).transpose(1, 0, 3, 4, 2, 5),
        k=kv(key),
        v=kv(value),
        q_pos=query_positions.reshape(batch, nq, bq).transpose(1, 0, 2),
        k_pos=key_positions.reshape(batch, nk, bk).transpose(1, 0, 2),
        q_min=q_min.T,
        q_max=q_max.T,
        k_min=k_min.T,
        k_max=k_max.T,
    )


def _xla_scores(q_block, k_block, q_pos, k_pos, config):
    """Scaled scores [B, K, G, bq, bk] float32 and their mask [B, 1, 1, bq, bk]."""
    scores = (
        jnp.einsum("bkgqh,bksh->bkgqs", q_block, k_block, preferred_element_type=jnp.float32)
        * config.scale
    )
    mask = _visible(q_pos[:, None, None, :, None], k_pos[:, None, None, None, :], config.window)
    return scores, mask


def _xla_forward(query, key, value, query_positions, key_positions, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    blocks = _xla_blocks(query, key, value, query_positions, key_positions, config)
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    bq = config.block_q
    row_shape = (batch, num_kv_heads, group, bq, 1)

    def query_block_step(_, q_xs):
        q_block, q_pos, q_min, q_max = q_xs

        def key_block_step(carry, k_xs):
            k_block, v_block, k_pos, k_min, k_max = k_xs

            def update(carry):
                m_prev, l_prev, acc_prev = carry
                scores, mask = _xla_scores(q_block, k_block, q_pos, k_pos, config)
                scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)
                m_next = jnp.maximum(m_prev, scores.max(axis=-1, keepdims=True))
                correction = jnp.exp(m_prev - m_next)
                probs = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
                l_next = correction * l_prev + probs.sum(axis=-1, keepdims=True)
                acc_next = correction * acc_prev + jnp.einsum(
                    "bkgqs,bksh->bkgqh",
                    probs.astype(v_block.dtype),
                    v_block,
                    preferred_element_type=jnp.float32,
                )
                return m_next, l_next, acc_next

            # A conditional, not a select: a skipped pair of blocks costs no matmul. Any row
            # of the batch that may interact runs the block for all rows (the mask is exact).
            may_interact = jnp.any(_blocks_may_interact(q_min, q_max, k_min, k_max, config.window))
            return lax.cond(may_interact, update, lambda carry: carry, carry), None

        init = (
            jnp.full(row_shape, DEFAULT_MASK_VALUE, jnp.float32),
            jnp.zeros(row_shape, jnp.float32),
            jnp.zeros((*row_shape[:-1], head_dim), jnp.float32),
        )
        k_xs = tuple(blocks[name] for name in ("k", "v", "k_pos", "k_min", "k_max"))
        (row_max, row_sum, acc), _ = lax.scan(key_block_step, init, k_xs)
        has_keys = row_sum > 0
        row_sum_safe = jnp.where(has_keys, row_sum, 1.0)
        out_block = (acc / row_sum_safe).astype(query.dtype)  # zero rows stay zero
        lse_block = jnp.where(has_keys, row_max + jnp.log(row_sum_safe), -jnp.inf)[..., 0]
        return None, (out_block, lse_block)

    q_xs = tuple(blocks[name] for name in ("q", "q_pos", "q_min", "q_max"))
    _, (out, lse) = lax.scan(query_block_step, None, q_xs)
    # out [nq, B, K, G, bq, H] -> [B, T, N, H]; lse [nq, B, K, G, bq] -> [B, N, T].
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, seq_len_q, num_heads, head_dim)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(batch, num_heads, seq_len_q)
    return out, lse


def _xla_backward(query, key, value, query_positions, key_positions, d_out, lse, delta, config):
    """FlashAttention-2 backward in one pass over key blocks.

    XLA runs the loop sequentially, so unlike the kernels there is no race on dq: the outer
    scan over key blocks carries the float32 dq of all queries, each inner step over query
    blocks recomputes its probabilities once and yields dq, dk and dv contributions.
    """
    batch, seq_len_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    nq, bq = seq_len_q // config.block_q, config.block_q
    blocks = _xla_blocks(query, key, value, query_positions, key_positions, config)
    to_q_blocks = lambda x: x.reshape(batch, nq, bq, num_kv_heads, group, head_dim).transpose(
        1, 0, 3, 4, 2, 5
    )
    # [B, N, T] -> [nq, B, K, G, bq, 1]
    to_row_blocks = lambda x: x.reshape(batch, num_kv_heads, group, nq, bq).transpose(
        3, 0, 1, 2, 4
    )[..., None]
    d_out_blocks = to_q_blocks(d_out)
    lse_blocks, delta_blocks = to_row_blocks(lse), to_row_blocks(delta)

    def key_block_step(d_query_acc, k_xs):
        k_block, v_block, k_pos, k_min, k_max = k_xs

        def query_block_step(carry, q_xs):
            q_block, d_out_block, lse_block, delta_block, q_pos, q_min, q_max = q_xs

            def contributions(carry):
                d_key_prev, d_value_prev = carry
                scores, mask = _xla_scores(q_block, k_block, q_pos, k_pos, config)
                probs = jnp.where(mask, jnp.exp(jnp.where(mask, scores, 0.0) - lse_block), 0.0)
                d_value = d_value_prev + jnp.einsum(
                    "bkgqs,bkgqh->bksh",
                    probs.astype(d_out_block.dtype),
                    d_out_block,
                    preferred_element_type=jnp.float32,
                )
                d_probs = jnp.einsum(
                    "bkgqh,bksh->bkgqs", d_out_block, v_block, preferred_element_type=jnp.float32
                )
                d_scores = (probs * (d_probs - delta_block) * config.scale).astype(q_block.dtype)
                d_key = d_key_prev + jnp.einsum(
                    "bkgqs,bkgqh->bksh", d_scores, q_block, preferred_element_type=jnp.float32
                )
                d_query = jnp.einsum(
                    "bkgqs,bksh->bkgqh", d_scores, k_block, preferred_element_type=jnp.float32
                )
                return (d_key, d_value), d_query

            def skip(carry):
                return carry, jnp.zeros(q_block.shape, jnp.float32)

            may_interact = jnp.any(_blocks_may_interact(q_min, q_max, k_min, k_max, config.window))
            return lax.cond(may_interact, contributions, skip, carry)

        kv_shape = (batch, num_kv_heads, config.block_k, head_dim)
        init = (jnp.zeros(kv_shape, jnp.float32), jnp.zeros(kv_shape, jnp.float32))
        q_xs = (
            blocks["q"],
            d_out_blocks,
            lse_blocks,
            delta_blocks,
            blocks["q_pos"],
            blocks["q_min"],
            blocks["q_max"],
        )
        (d_key, d_value), d_query = lax.scan(query_block_step, init, q_xs)
        return d_query_acc + d_query, (d_key, d_value)

    k_xs = tuple(blocks[name] for name in ("k", "v", "k_pos", "k_min", "k_max"))
    d_query, (d_key, d_value) = lax.scan(
        key_block_step, jnp.zeros(blocks["q"].shape, jnp.float32), k_xs
    )
    d_query = d_query.transpose(1, 0, 4, 2, 3, 5).reshape(query.shape)
    # [nk, B, K, bk, H] -> [B, S, K, H]
    from_kv_blocks = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(key.shape)
    return (
        d_query.astype(query.dtype),
        from_kv_blocks(d_key).astype(key.dtype),
        from_kv_blocks(d_value).astype(value.dtype),
    )


# --------------------------------------------------------------------------------------
# impl="pallas", backend="tpu": Mosaic kernels.
#
# Layout: q, o, dq as [B, K, G, T, H] (a free reshape of [B, N, T, H]); k, v, dk, dv as
# [B, K, S, H]. The grid is (batch, kv head, query block, key block) for the forward and
# dq kernels and (batch, kv head, key block, query block) for the dk/dv kernel, the last
# axis sequential ("arbitrary") and accumulating into VMEM scratch. One query tile holds
# the G query heads of a kv head, so each key/value tile is copied into VMEM once per
# group and reused by its G heads. Query positions come lane-broadcast [B, T, 128] and
# key positions sublane-broadcast [B, 8, S] (so each block is a whole (8, 128) tile);
# per-block position bounds are scalar-prefetched into SMEM to skip blocks that cannot
# interact.
#
# Backward: two kernels (dq; dk and dv) rather than one. A fused kernel would have to
# accumulate dq across the sequential key-block axis of a (.., key block, query block)
# grid, which Pallas TPU output blocks cannot do (a block is written back when its index
# changes); the price of two kernels is computing the scores twice.
# --------------------------------------------------------------------------------------


def _tpu_layout(query, key, value):
    batch, seq_len_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.transpose(0, 2, 1, 3).reshape(batch, num_kv_heads, group, seq_len_q, head_dim)
    return q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)


def _tpu_position_inputs(query_positions, key_positions, config):
    """Scalar-prefetch block bounds (flat, for SMEM) and the broadcast position arrays."""
    q_min, q_max = _block_bounds(query_positions, config.block_q)
    k_min, k_max = _block_bounds(key_positions, config.block_k)
    batch, seq_len_q = query_positions.shape
    seq_len_k = key_positions.shape[1]
    # 1-D: a multi-dimensional SMEM array is padded per row.
    bounds = tuple(x.reshape(-1) for x in (q_min, q_max, k_min, k_max))
    q_pos_lanes = jnp.broadcast_to(query_positions[:, :, None], (batch, seq_len_q, NUM_LANES))
    k_pos_sublanes = jnp.broadcast_to(key_positions[:, None, :], (batch, NUM_SUBLANES, seq_len_k))
    return bounds, q_pos_lanes, k_pos_sublanes


def _tpu_may_interact(
    bounds_refs, batch_index, q_block_index, k_block_index, num_q_blocks, num_k_blocks, window
):
    q_min_ref, q_max_ref, k_min_ref, k_max_ref = bounds_refs
    q_flat = batch_index * num_q_blocks + q_block_index
    k_flat = batch_index * num_k_blocks + k_block_index
    return _blocks_may_interact(
        q_min_ref[q_flat], q_max_ref[q_flat], k_min_ref[k_flat], k_max_ref[k_flat], window
    )


def _tpu_block_mask(q_pos_ref, k_pos_ref, window):
    """[block_q, block_k] mask from a lane-broadcast and a sublane-broadcast tile."""
    return _visible(q_pos_ref[:, 0:1], k_pos_ref[0:1, :], window)


def _tpu_forward_kernel(
    # Scalar prefetch (SMEM): per-block position bounds, flat over (batch, block).
    q_min_ref,
    q_max_ref,
    k_min_ref,
    k_max_ref,
    # Input blocks.
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    # Output blocks.
    o_ref,
    lse_ref,
    # VMEM scratch, carried across the key blocks.
    m_scratch,
    l_scratch,
    acc_scratch,
    *,
    scale,
    window,
    group,
    num_q_blocks,
    num_k_blocks,
):
    """One (batch, kv head, query block, key block) step of the online softmax.

    Blocks: q_pos [bq, 128], k_pos [8, bk], q [G, bq, H], k and v [bk, H], o [G, bq, H],
    lse [G, bq, 128]; scratch m and l [G, bq, 1], acc [G, bq, H], all float32.
    """
    batch_index, q_block_index, k_block_index = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(k_block_index == 0)
    def init():
        m_scratch[...] = jnp.full(m_scratch.shape, DEFAULT_MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    may_interact = _tpu_may_interact(
        (q_min_ref, q_max_ref, k_min_ref, k_max_ref),
        batch_index,
        q_block_index,
        k_block_index,
        num_q_blocks,
        num_k_blocks,
        window,
    )

    @pl.when(may_interact)
    def update():
        mask = _tpu_block_mask(q_pos_ref, k_pos_ref, window)  # shared by the G heads
        k, v = k_ref[...], v_ref[...]
        for head in range(group):  # static: G matmuls against the same VMEM k and v tiles
            scores = _matmul(q_ref[head], k, _NT)
            scores = jnp.where(mask, scores * scale, DEFAULT_MASK_VALUE)
            m_prev = m_scratch[head]
            m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            probs = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
            l_scratch[head] = correction * l_scratch[head] + probs.sum(axis=1, keepdims=True)
            acc_scratch[head] = correction * acc_scratch[head] + _matmul(
                probs.astype(v.dtype), v, _NN
            )
            m_scratch[head] = m_next

    @pl.when(k_block_index == num_k_blocks - 1)
    def finalize():
        for head in range(group):
            row_sum = l_scratch[head]
            has_keys = row_sum > 0
            row_sum_safe = jnp.where(has_keys, row_sum, 1.0)
            o_ref[head] = (acc_scratch[head] / row_sum_safe).astype(o_ref.dtype)
            lse = jnp.where(has_keys, m_scratch[head] + jnp.log(row_sum_safe), -jnp.inf)
            lse_ref[head] = jnp.broadcast_to(lse, lse_ref.shape[1:])


def _tpu_forward(query, key, value, query_positions, key_positions, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    nq, nk = seq_len_q // bq, seq_len_k // bk
    q, k, v = _tpu_layout(query, key, value)
    bounds, q_pos_lanes, k_pos_sublanes = _tpu_position_inputs(
        query_positions, key_positions, config
    )

    # Index maps receive the grid indices, then the scalar-prefetch refs.
    q_spec = pl.BlockSpec((None, None, group, bq, head_dim), lambda b, h, i, j, *_: (b, h, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, head_dim), lambda b, h, i, j, *_: (b, h, j, 0))
    in_specs = [
        pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, i, 0)),
        pl.BlockSpec((None, NUM_SUBLANES, bk), lambda b, h, i, j, *_: (b, 0, j)),
        q_spec,
        kv_spec,
        kv_spec,
    ]
    out_specs = [
        q_spec,
        pl.BlockSpec((None, None, group, bq, NUM_LANES), lambda b, h, i, j, *_: (b, h, 0, i, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, query.dtype),
        jax.ShapeDtypeStruct((batch, num_kv_heads, group, seq_len_q, NUM_LANES), jnp.float32),
    ]
    kernel = functools.partial(
        _tpu_forward_kernel,
        scale=config.scale,
        window=config.window,
        group=group,
        num_q_blocks=nq,
        num_k_blocks=nk,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds),
            grid=(batch, num_kv_heads, nq, nk),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((group, bq, 1), jnp.float32),  # running max
                pltpu.VMEM((group, bq, 1), jnp.float32),  # running sum
                pltpu.VMEM((group, bq, head_dim), jnp.float32),  # output accumulator
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=config.interpret,
        name="flash_attention_fwd",
    )(*bounds, q_pos_lanes, k_pos_sublanes, q, k, v)
    out = out.reshape(batch, num_heads, seq_len_q, head_dim).transpose(0, 2, 1, 3)
    # The lane-broadcast lse only lives until this slice; the residual is [B, N, T].
    return out, lse[..., 0].reshape(batch, num_heads, seq_len_q)


def _tpu_dq_kernel(
    # Scalar prefetch (SMEM), as in the forward kernel.
    q_min_ref,
    q_max_ref,
    k_min_ref,
    k_max_ref,
    # Input blocks.
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    # Output block, then its float32 accumulator.
    dq_ref,
    dq_scratch,
    *,
    scale,
    window,
    group,
    num_q_blocks,
    num_k_blocks,
):
    """dq of one query tile, accumulated over the key blocks (last grid axis).

    Blocks: q, d_out, dq [G, bq, H]; lse and delta [G, bq, 128]; k, v [bk, H].
    """
    batch_index, q_block_index, k_block_index = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(k_block_index == 0)
    def init():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, jnp.float32)

    may_interact = _tpu_may_interact(
        (q_min_ref, q_max_ref, k_min_ref, k_max_ref),
        batch_index,
        q_block_index,
        k_block_index,
        num_q_blocks,
        num_k_blocks,
        window,
    )

    @pl.when(may_interact)
    def update():
        mask = _tpu_block_mask(q_pos_ref, k_pos_ref, window)
        k, v = k_ref[...], v_ref[...]
        for head in range(group):
            _, d_scores = _probs_and_dscores(
                q_ref[head],
                k,
                v,
                d_out_ref[head],
                lse_ref[head][:, 0:1],
                delta_ref[head][:, 0:1],
                mask,
                scale,
            )
            dq_scratch[head] += _matmul(d_scores, k, _NN)

    @pl.when(k_block_index == num_k_blocks - 1)
    def finalize():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _tpu_dkv_kernel(
    # Scalar prefetch (SMEM), as in the forward kernel.
    q_min_ref,
    q_max_ref,
    k_min_ref,
    k_max_ref,
    # Input blocks, as for the dq kernel.
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    # Output blocks, then their float32 accumulators.
    dk_ref,
    dv_ref,
    dk_scratch,
    dv_scratch,
    *,
    scale,
    window,
    group,
    num_q_blocks,
    num_k_blocks,
):
    """dk and dv of one key tile, summed over the G heads and the query blocks (last axis)."""
    batch_index, k_block_index, q_block_index = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(q_block_index == 0)
    def init():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, jnp.float32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, jnp.float32)

    may_interact = _tpu_may_interact(
        (q_min_ref, q_max_ref, k_min_ref, k_max_ref),
        batch_index,
        q_block_index,
        k_block_index,
        num_q_blocks,
        num_k_blocks,
        window,
    )

    @pl.when(may_interact)
    def update():
        mask = _tpu_block_mask(q_pos_ref, k_pos_ref, window)
        k, v = k_ref[...], v_ref[...]
        for head in range(group):
            q, d_out = q_ref[head], d_out_ref[head]
            probs, d_scores = _probs_and_dscores(
                q, k, v, d_out, lse_ref[head][:, 0:1], delta_ref[head][:, 0:1], mask, scale
            )
            dv_scratch[...] += _matmul(probs.astype(d_out.dtype), d_out, _TN)
            dk_scratch[...] += _matmul(d_scores, q, _TN)

    @pl.when(q_block_index == num_q_blocks - 1)
    def finalize():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _tpu_backward(query, key, value, query_positions, key_positions, d_out, lse, delta, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    nq, nk = seq_len_q // bq, seq_len_k // bk
    q, k, v = _tpu_layout(query, key, value)
    d_out = d_out.transpose(0, 2, 1, 3).reshape(q.shape)
    # Row statistics lane-broadcast again, only for the duration of the backward kernels.
    rows = lambda x: jnp.broadcast_to(
        x.reshape(batch, num_kv_heads, group, seq_len_q, 1),
        (batch, num_kv_heads, group, seq_len_q, NUM_LANES),
    )
    lse, delta = rows(lse), rows(delta)
    bounds, q_pos_lanes, k_pos_sublanes = _tpu_position_inputs(
        query_positions, key_positions, config
    )
    kernel_args = dict(
        scale=config.scale, window=config.window, group=group, num_q_blocks=nq, num_k_blocks=nk
    )
    compiler_params = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )

    def specs(q_index, k_index):
        """Input specs for a grid whose (query block, key block) indices the two maps pick."""
        q_map = lambda b, h, i, j, *_: (b, h, 0, q_index(i, j), 0)
        kv_map = lambda b, h, i, j, *_: (b, h, k_index(i, j), 0)
        q_spec = pl.BlockSpec((None, None, group, bq, head_dim), q_map)
        row_spec = pl.BlockSpec((None, None, group, bq, NUM_LANES), q_map)
        kv_spec = pl.BlockSpec((None, None, bk, head_dim), kv_map)
        return (
            [
                pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, q_index(i, j), 0)),
                pl.BlockSpec(
                    (None, NUM_SUBLANES, bk), lambda b, h, i, j, *_: (b, 0, k_index(i, j))
                ),
                q_spec,
                kv_spec,
                kv_spec,
                q_spec,
                row_spec,
                row_spec,
            ],
            q_spec,
            kv_spec,
        )

    inputs = (*bounds, q_pos_lanes, k_pos_sublanes, q, k, v, d_out, lse, delta)

    dq_in_specs, dq_spec, _ = specs(lambda i, j: i, lambda i, j: j)
    dq = pl.pallas_call(
        functools.partial(_tpu_dq_kernel, **kernel_args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds),
            grid=(batch, num_kv_heads, nq, nk),
            in_specs=dq_in_specs,
            out_specs=dq_spec,
            scratch_shapes=[pltpu.VMEM((group, bq, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, query.dtype),
        compiler_params=compiler_params,
        interpret=config.interpret,
        name="flash_attention_bwd_dq",
    )(*inputs)

    # Grid (batch, kv head, key block, query block): i indexes keys, j queries.
    dkv_in_specs, _, dkv_spec = specs(lambda i, j: j, lambda i, j: i)
    dk, dv = pl.pallas_call(
        functools.partial(_tpu_dkv_kernel, **kernel_args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds),
            grid=(batch, num_kv_heads, nk, nq),
            in_specs=dkv_in_specs,
            out_specs=[dkv_spec, dkv_spec],
            scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32)] * 2,
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, key.dtype),
            jax.ShapeDtypeStruct(v.shape, value.dtype),
        ],
        compiler_params=compiler_params,
        interpret=config.interpret,
        name="flash_attention_bwd_dkv",
    )(*inputs)
    dq = dq.reshape(batch, num_heads, seq_len_q, head_dim).transpose(0, 2, 1, 3)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------------------
# impl="pallas", backend="gpu": Triton kernels.
#
# Layout: q, o, dq, d_out stay [B, T, N, H] and k, v, dk, dv [B, S, K, H], with H padded
# to a power of two (Triton tiles; zero features change neither scores nor outputs).
# Forward and dq: grid (batch, query head, query block), an inner fori_loop over key
# blocks; the kv head of query head n is n // G. dk/dv: grid (batch, kv head, key block),
# looping over the G query heads of the group and over query blocks, so dk and dv are
# summed in registers and written once (no atomics). Two backward kernels rather than
# jax's fused one, which needs as many query blocks as key blocks; here T and S differ.
# A key (query) block whose position range cannot interact with the program's query
# (key) block is skipped with lax.cond, using bounds computed from its positions.
# --------------------------------------------------------------------------------------


def _gpu_bounds(positions):
    """(min valid position, max valid position) of a 1-D block, as scalars."""
    valid = positions >= 0
    return (
        jnp.min(jnp.where(valid, positions, _NO_POSITION)),
        jnp.max(jnp.where(valid, positions, -1)),
    )


def _gpu_forward_kernel(
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    window,
    block_k,
    num_k_blocks,
):
    """Blocks: q_pos [bq], k_pos [S], q and o [bq, H], k and v [S, H], lse [bq]."""
    q = q_ref[...]
    q_pos = q_pos_ref[...]
    q_min, q_max = _gpu_bounds(q_pos)
    block_q, head_dim = q.shape

    def body(k_block_index, carry):
        k_slice = pl.ds(k_block_index * block_k, block_k)
        k_pos = k_pos_ref[k_slice]
        k_min, k_max = _gpu_bounds(k_pos)

        def update(carry):
            m_prev, l_prev, acc_prev = carry
            k, v = k_ref[k_slice, :], v_ref[k_slice, :]
            mask = _visible(q_pos[:, None], k_pos[None, :], window)
            scores = _matmul(q, k, _NT) * scale
            scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
            correction = jnp.exp(m_prev - m_next)
            probs = jnp.where(mask, jnp.exp(scores - m_next[:, None]), 0.0)
            l_next = correction * l_prev + jnp.sum(probs, axis=1)
            acc_next = correction[:, None] * acc_prev + _matmul(probs.astype(v.dtype), v, _NN)
            return m_next, l_next, acc_next

        may_interact = _blocks_may_interact(q_min, q_max, k_min, k_max, window)
        return lax.cond(may_interact, update, lambda carry: carry, carry)

    init = (
        jnp.full((block_q,), DEFAULT_MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, head_dim), jnp.float32),
    )
    row_max, row_sum, acc = lax.fori_loop(0, num_k_blocks, body, init)
    has_keys = row_sum > 0
    row_sum_safe = jnp.where(has_keys, row_sum, 1.0)
    o_ref[...] = (acc / row_sum_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_keys, row_max + jnp.log(row_sum_safe), -jnp.inf)


def _gpu_pad_head_dim(*arrays):
    """Zero-pads the last dim (H) to a power of two >= 16, as Triton tiles need.

    Zero features add nothing to q.k and give zero output columns, sliced off after.
    """
    head_dim = arrays[0].shape[-1]
    pad = max(pl.next_power_of_2(head_dim), MIN_TRITON_DOT_DIM) - head_dim
    return tuple(jnp.pad(x, ((0, 0),) * 3 + ((0, pad),)) for x in arrays)


def _gpu_forward(query, key, value, query_positions, key_positions, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    q, k, v = _gpu_pad_head_dim(query, key, value)
    head_dim_padded = q.shape[-1]
    q_spec = pl.BlockSpec((None, bq, None, head_dim_padded), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec(
        (None, seq_len_k, None, head_dim_padded), lambda b, n, i: (b, 0, n // group, 0)
    )
    out, lse = pl.pallas_call(
        functools.partial(
            _gpu_forward_kernel,
            scale=config.scale,
            window=config.window,
            block_k=bk,
            num_k_blocks=seq_len_k // bk,
        ),
        grid=(batch, num_heads, seq_len_q // bq),
        in_specs=[
            pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
            pl.BlockSpec((None, seq_len_k), lambda b, n, i: (b, 0)),
            q_spec,
            kv_spec,
            kv_spec,
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, query.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, seq_len_q), jnp.float32),
        ],
        compiler_params=gpu_compiler_params(head_dim_padded),
        interpret=config.interpret,
        name="flash_attention_fwd",
    )(query_positions, key_positions, q, k, v)
    return out[..., :head_dim], lse


def _gpu_dq_kernel(
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    scale,
    window,
    block_k,
    num_k_blocks,
):
    """Blocks: q, d_out, dq [bq, H]; lse, delta, q_pos [bq]; k, v [S, H]; k_pos [S]."""
    q, d_out = q_ref[...], d_out_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]  # [bq, 1] columns
    q_pos = q_pos_ref[...]
    q_min, q_max = _gpu_bounds(q_pos)

    def body(k_block_index, dq):
        k_slice = pl.ds(k_block_index * block_k, block_k)
        k_pos = k_pos_ref[k_slice]
        k_min, k_max = _gpu_bounds(k_pos)

        def update(dq):
            k, v = k_ref[k_slice, :], v_ref[k_slice, :]
            mask = _visible(q_pos[:, None], k_pos[None, :], window)
            _, d_scores = _probs_and_dscores(q, k, v, d_out, lse, delta, mask, scale)
            return dq + _matmul(d_scores, k, _NN)

        may_interact = _blocks_may_interact(q_min, q_max, k_min, k_max, window)
        return lax.cond(may_interact, update, lambda dq: dq, dq)

    dq = lax.fori_loop(0, num_k_blocks, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _gpu_dkv_kernel(
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    window,
    group,
    block_q,
    num_q_blocks,
):
    """Blocks: q and d_out [T, G, H]; lse, delta [G, T]; q_pos [T]; k, v, dk, dv [bk, H]."""
    k, v = k_ref[...], v_ref[...]
    k_pos = k_pos_ref[...]
    k_min, k_max = _gpu_bounds(k_pos)

    def body_for(head):
        def body(q_block_index, carry):
            q_slice = pl.ds(q_block_index * block_q, block_q)
            q_pos = q_pos_ref[q_slice]
            q_min, q_max = _gpu_bounds(q_pos)

            def update(carry):
                d_key, d_value = carry
                q, d_out = q_ref[q_slice, head, :], d_out_ref[q_slice, head, :]
                mask = _visible(q_pos[:, None], k_pos[None, :], window)
                probs, d_scores = _probs_and_dscores(
                    q,
                    k,
                    v,
                    d_out,
                    lse_ref[head, q_slice][:, None],
                    delta_ref[head, q_slice][:, None],
                    mask,
                    scale,
                )
                d_value = d_value + _matmul(probs.astype(d_out.dtype), d_out, _TN)
                d_key = d_key + _matmul(d_scores, q, _TN)
                return d_key, d_value

            may_interact = _blocks_may_interact(q_min, q_max, k_min, k_max, window)
            return lax.cond(may_interact, update, lambda carry: carry, carry)

        return body

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for head in range(group):  # static: the G query heads that read this kv head
        carry = lax.fori_loop(0, num_q_blocks, body_for(head), carry)
    d_key, d_value = carry
    dk_ref[...] = d_key.astype(dk_ref.dtype)
    dv_ref[...] = d_value.astype(dv_ref.dtype)


def _gpu_backward(query, key, value, query_positions, key_positions, d_out, lse, delta, config):
    batch, seq_len_q, num_heads, head_dim = query.shape
    seq_len_k, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = config.block_q, config.block_k
    q, k, v, d_out = _gpu_pad_head_dim(query, key, value, d_out)
    head_dim_padded = q.shape[-1]
    inputs = (query_positions, key_positions, q, k, v, d_out, lse, delta)

    q_block_spec = pl.BlockSpec((None, bq, None, head_dim_padded), lambda b, n, i: (b, i, n, 0))
    kv_full_spec = pl.BlockSpec(
        (None, seq_len_k, None, head_dim_padded), lambda b, n, i: (b, 0, n // group, 0)
    )
    row_block_spec = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    dq = pl.pallas_call(
        functools.partial(
            _gpu_dq_kernel,
            scale=config.scale,
            window=config.window,
            block_k=bk,
            num_k_blocks=seq_len_k // bk,
        ),
        grid=(batch, num_heads, seq_len_q // bq),
        in_specs=[
            pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
            pl.BlockSpec((None, seq_len_k), lambda b, n, i: (b, 0)),
            q_block_spec,
            kv_full_spec,
            kv_full_spec,
            q_block_spec,
            row_block_spec,
            row_block_spec,
        ],
        out_specs=q_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, query.dtype),
        compiler_params=gpu_compiler_params(head_dim_padded),
        interpret=config.interpret,
        name="flash_attention_bwd_dq",
    )(*inputs)

    # Grid (batch, kv head, key block); the block of q covers the G heads of kv head h.
    q_group_spec = pl.BlockSpec(
        (None, seq_len_q, group, head_dim_padded), lambda b, h, j: (b, 0, h, 0)
    )
    kv_block_spec = pl.BlockSpec((None, bk, None, head_dim_padded), lambda b, h, j: (b, j, h, 0))
    row_group_spec = pl.BlockSpec((None, group, seq_len_q), lambda b, h, j: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _gpu_dkv_kernel,
            scale=config.scale,
            window=config.window,
            group=group,
            block_q=bq,
            num_q_blocks=seq_len_q // bq,
        ),
        grid=(batch, num_kv_heads, seq_len_k // bk),
        in_specs=[
            pl.BlockSpec((None, seq_len_q), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            q_group_spec,
            kv_block_spec,
            kv_block_spec,
            q_group_spec,
            row_group_spec,
            row_group_spec,
        ],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, key.dtype),
            jax.ShapeDtypeStruct(v.shape, value.dtype),
        ],
        compiler_params=gpu_compiler_params(head_dim_padded),
        interpret=config.interpret,
        name="flash_attention_bwd_dkv",
    )(*inputs)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


# --------------------------------------------------------------------------------------
# Reference.
# --------------------------------------------------------------------------------------


def flash_attention_reference(
    query, key, value, query_positions, key_positions, *, scale=None, window=None
):
    """Plain-jnp attention under the position mask; materialises all scores.

    Args:
        query: [B, T, N, H].
        key: [B, S, K, H] with N a multiple of K.
        value: [B, S, K, H].
        query_positions: int [B, T]; negative = padding.
        key_positions: int [B, S]; negative = empty slot.
        scale: score multiplier, default H ** -0.5.
        window: None or int W >= 1 (keys at positions in (p - W, p]).

    Returns:
        [B, T, N, H] in query.dtype; zero rows for queries with no visible key.
    """
    batch, seq_len_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    q = query.reshape(batch, seq_len_q, num_kv_heads, group, head_dim)
    scores = (
        jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=jnp.float32) * scale
    )  # [B, K, G, T, S]
    q_pos = query_positions[:, None, None, :, None]
    k_pos = key_positions[:, None, None, None, :]
    allowed = (q_pos >= 0) & (k_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    # Rows with no allowed key have max -inf; any finite shift keeps exp(-inf) = 0 there.
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum(
        "bkgts,bskh->btkgh",
        probs,
        value.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    return out.reshape(batch, seq_len_q, num_heads, head_dim).astype(query.dtype)
