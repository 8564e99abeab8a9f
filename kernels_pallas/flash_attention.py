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
The TPU kernels' index maps also clamp each step into the range of blocks it may need
(``fetch_ranges``), so the pipeline does not copy a skipped block either.

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

Files: this one holds the public function, the custom_vjp and its dispatch, the XLA path
and the reference (last); `flash_attention_tpu` the Mosaic kernels,
`flash_attention_gpu` the Triton kernels, and `_flash_attention_common` the mask and
block-skipping helpers that all three implementations share.
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

from kernels_pallas import flash_attention_gpu, flash_attention_tpu
from kernels_pallas._common import (
    DEFAULT_MASK_VALUE,
    MIN_TRITON_DOT_DIM,
    NUM_LANES,
    NUM_SUBLANES,
    check_impl,
    check_scale,
    resolve_backend,
)
from kernels_pallas._flash_attention_common import block_bounds, blocks_may_interact, visible


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
    config = _resolve(
        query, key, value, query_positions, key_positions,
        scale=scale, window=window, impl=impl, interpret=interpret,
        block_sizes=block_sizes, backend=backend,
    )  # fmt: skip
    return _flash_attention(query, key, value, query_positions, key_positions, config)


def flash_attention_forward(
    query, key, value, query_positions, key_positions, *,
    scale=None, window=None, impl="xla", interpret=False, block_sizes=None, backend=None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``flash_attention``'s forward pass alone, for callers that combine attention over
    several key sets themselves (ring attention: one set per device).

    Arguments as ``flash_attention``'s.

    Returns:
        ``out [B, T, N, H]`` in ``query.dtype`` (zero rows for queries that see no key)
        and ``lse [B, N, T]`` float32, each query's log-sum-exp of its visible scores
        (``-inf`` where it sees none).
    """
    config = _resolve(
        query, key, value, query_positions, key_positions,
        scale=scale, window=window, impl=impl, interpret=interpret,
        block_sizes=block_sizes, backend=backend,
    )  # fmt: skip
    return _padded_forward(query, key, value, query_positions, key_positions, config)


def flash_attention_backward(
    query, key, value, query_positions, key_positions, d_out, lse, delta, *,
    scale=None, window=None, impl="xla", interpret=False, block_sizes=None, backend=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """``flash_attention``'s backward pass alone: the gradients of a loss through
    attention over ``key``/``value`` when each query's softmax normaliser is ``lse``.

    With the whole attention's ``lse`` and ``delta`` (each query's ``sum(d_out * out)``),
    over a subset of the keys this gives that subset's key and value gradients and its
    part of the query gradient (ring attention adds those up around the ring).

    Args:
        query, key, value, query_positions, key_positions: as ``flash_attention``'s.
        d_out: ``[B, T, N, H]``, the loss's gradient with respect to the output.
        lse: ``[B, N, T]`` float32, the log-sum-exp of each query's scores.
        delta: ``[B, N, T]`` float32.
        scale, window, impl, interpret, block_sizes, backend: as ``flash_attention``'s.

    Returns:
        ``(d_query, d_key, d_value)`` in the inputs' dtypes.
    """
    config = _resolve(
        query, key, value, query_positions, key_positions,
        scale=scale, window=window, impl=impl, interpret=interpret,
        block_sizes=block_sizes, backend=backend,
    )  # fmt: skip
    for name, array in (("lse", lse), ("delta", delta)):
        expected = (query.shape[0], query.shape[2], query.shape[1])
        if getattr(array, "shape", None) != expected:
            raise ValueError(
                f"{name} must have shape {expected} ([B, N, T]), got "
                f"{name}.shape={getattr(array, 'shape', None)}."
            )
    if getattr(d_out, "shape", None) != query.shape:
        raise ValueError(
            f"d_out must have the query's shape {query.shape}, got "
            f"d_out.shape={getattr(d_out, 'shape', None)}."
        )
    return _padded_backward(
        query, key, value, query_positions, key_positions, d_out, lse, delta, config
    )


def _resolve(
    query, key, value, query_positions, key_positions,
    *, scale, window, impl, interpret, block_sizes, backend,
) -> _Config:  # fmt: skip
    """The validated static settings of one call (``flash_attention``'s arguments)."""
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
    return config


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


def _pad(config, query, key, value, query_positions, key_positions, *rows):
    """Pads T and S to whole blocks; ``rows`` (``[B, T, N, H]`` or ``[B, N, T]``) along
    T. Padded slots get position -1, so the mask hides them: padded keys are never
    seen, padded queries see nothing and output zeros that are sliced away."""
    pad_q = _round_up(query.shape[1], config.block_q) - query.shape[1]
    pad_k = _round_up(key.shape[1], config.block_k) - key.shape[1]
    pad_seq = lambda x, pad: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    pad_rows = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad_q)))  # noqa: E731
    pad_pos = lambda x, pad: jnp.pad(  # noqa: E731
        x.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1
    )
    return (
        pad_seq(query, pad_q), pad_seq(key, pad_k), pad_seq(value, pad_k),
        pad_pos(query_positions, pad_q), pad_pos(key_positions, pad_k),
        *(pad_seq(x, pad_q) if x.ndim == 4 else pad_rows(x) for x in rows),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("config",))
def _flash_attention(query, key, value, query_positions, key_positions, config: _Config):
    """Pads T and S to whole blocks, runs the differentiable core, slices back."""
    out = _attention(*_pad(config, query, key, value, query_positions, key_positions), config)
    return out[:, : query.shape[1]]


@functools.partial(jax.jit, static_argnames=("config",))
def _padded_forward(query, key, value, query_positions, key_positions, config: _Config):
    padded = _pad(config, query, key, value, query_positions, key_positions)
    out, lse = _forward(*padded, config)
    return out[:, : query.shape[1]], lse[..., : query.shape[1]]


@functools.partial(jax.jit, static_argnames=("config",))
def _padded_backward(
    query, key, value, query_positions, key_positions, d_out, lse, delta, config: _Config
):
    padded = _pad(config, query, key, value, query_positions, key_positions, d_out, lse, delta)
    backward = _BACKWARD[config.backend]
    d_query, d_key, d_value = backward(*padded, config)
    return d_query[:, : query.shape[1]], d_key[:, : key.shape[1]], d_value[:, : key.shape[1]]


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
    backward = _BACKWARD[config.backend]
    d_query, d_key, d_value = backward(
        query, key, value, query_positions, key_positions, d_out, lse, delta, config
    )
    # Positions are integers: no cotangent.
    return d_query, d_key, d_value, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(query, key, value, query_positions, key_positions, config):
    """Returns (out [B, T, N, H] in query.dtype, lse [B, N, T] float32)."""
    forward = {
        "xla": _xla_forward,
        "tpu": flash_attention_tpu.forward,
        "gpu": flash_attention_gpu.forward,
    }[config.backend]
    return forward(query, key, value, query_positions, key_positions, config)


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
    q_min, q_max = block_bounds(query_positions, bq)
    k_min, k_max = block_bounds(key_positions, bk)
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
    mask = visible(q_pos[:, None, None, :, None], k_pos[:, None, None, None, :], config.window)
    return scores, mask


def _unhoistable(x, *positions):
    """``x`` and ``positions`` through an optimization barrier, so that what is computed
    from the positions alone (every block's mask) counts as depending on ``x``. Inside a
    scan over layers the positions are the same at every layer; differentiating the
    scan, JAX would otherwise compute the masks of every pair of blocks ahead of the
    layers and keep them all: T x S per head, 25 GB for a 135M model at 16K tokens."""
    return lax.optimization_barrier((x, *positions))


def _xla_forward(query, key, value, query_positions, key_positions, config):
    query, query_positions, key_positions = _unhoistable(query, query_positions, key_positions)
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
            may_interact = jnp.any(blocks_may_interact(q_min, q_max, k_min, k_max, config.window))
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
    d_out, query_positions, key_positions = _unhoistable(d_out, query_positions, key_positions)
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

            may_interact = jnp.any(blocks_may_interact(q_min, q_max, k_min, k_max, config.window))
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


_BACKWARD = {
    "xla": _xla_backward,
    "tpu": flash_attention_tpu.backward,
    "gpu": flash_attention_gpu.backward,
}


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
