"""Attention over a sequence split along a mesh axis: ring and all-gather.

``dot_product_attention(..., impl="ring")`` and ``impl="allgather"`` read the mesh set
by ``jax.set_mesh`` and the logical-axis rules in force (``flax.linen.logical_axis_rules``):
the mesh axes of ``act_len`` split the tokens, those of ``act_batch`` and ``act_heads`` /
``act_kv_heads`` the rows and heads, as the projections around attention are sharded.
Without a mesh, when ``act_len`` maps to no mesh axis of more than one device, or for
a length those axes do not divide (a model traced with one token), both compute the
same attention without splitting the tokens.

* ``ring``: each device keeps its queries and passes its keys and values (with their
  positions) around the ring of the sequence axis with ``ppermute``; at every step it
  folds the block it holds into an online softmax (running maximum, sum and weighted
  values in float32), so no device ever holds more than two blocks of keys. Blocks that
  no query of the device can see (after every query, by causality, or before every
  query's window) are skipped. The mask is the one of ``lhc.nn.attention_ops``, built
  from positions, so any assignment of tokens to devices is correct; a zig-zag one
  (``lhc.parallel.zigzag_order``) gives every device equal work under a causal mask.
* ``allgather``: every device gathers all keys and values and attends its queries to
  them with the blocked XLA attention (``impl="chunked"``; the Pallas flash kernels on
  TPU and GPU): one collective per layer, the full key/value memory per device: the
  better choice for short rings.

Gradients are JAX's own through ``shard_map``, ``scan``, ``cond`` and the collectives
(checked against one device in the tests), with each ring step and each block's fold
rematerialised: the backward pass keeps the float32 softmax state once per ring step.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

NEG = -1e30  # a finite "minus infinity": exp(NEG - m) is 0 for any real score m
KEY_BLOCK = 512  # keys per online-softmax update inside a ring step


def _mesh_axes(logical: str, mesh) -> tuple[str, ...]:
    axes = nn.logical_to_mesh_axes((logical,))[0]
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return tuple(n for n in names if n in mesh.shape)


def sequence_axes() -> tuple[str, ...]:
    """The mesh axes (of more than one device) that split ``act_len`` here; () without."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(n for n in _mesh_axes("act_len", mesh) if mesh.shape[n] > 1)


def refuse_sequence_axis(model: str) -> None:
    """Raises for a model that cannot split its sequence over devices (its chunk memory
    or recurrent state runs along the tokens) when the mesh in force would.

    Raises:
        ValueError: ``act_len`` maps to mesh axes of more than one device.
    """
    axes = sequence_axes()
    if axes:
        mesh = jax.sharding.get_abstract_mesh()
        sizes = {a: mesh.shape[a] for a in axes}
        raise ValueError(
            f"{model} does not split a sequence over devices, but the mesh and rules "
            f"split its tokens over {sizes}: use a mesh_shape with sequence 1"
        )


def _visible(query_positions, key_positions, window):
    """``[b, t, s]`` mask: key visible to query (lhc.nn.attention_ops' convention)."""
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    mask = (k <= q) & (k >= 0) & (q >= 0)
    if window is not None:
        mask &= k > q - window
    return mask


def _fold(state, query, key, value, query_positions, key_positions, scale, window):
    """The online-softmax state after the keys ``key`` ``[b, s, K, H]`` (one block).

    ``state``: ``(out [b, K, G, t, H], maximum [b, K, G, t], total [b, K, G, t])``, all
    float32; ``query``: ``[b, t, K, G, H]``.
    """
    out, maximum, total = state
    scores = jnp.einsum(
        "btkgh,bskh->bkgts", query, key, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    mask = _visible(query_positions, key_positions, window)[:, None, None]
    scores = jnp.where(mask, scores, NEG)
    new_max = jnp.maximum(maximum, scores.max(axis=-1))
    weights = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
    decay = jnp.exp(maximum - new_max)
    total = total * decay + weights.sum(axis=-1)
    out = out * decay[..., None] + jnp.einsum(
        "bkgts,bskh->bkgth", weights, value.astype(jnp.float32)
    )
    return out, new_max, total


def _fold_blocks(state, query, key, value, query_positions, key_positions, scale, window):
    """``_fold`` over ``key`` in blocks of ``KEY_BLOCK``, skipping blocks no query sees."""
    length = key.shape[1]
    block = math.gcd(length, KEY_BLOCK) if length > KEY_BLOCK else length
    count = length // block
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], count, block, *x.shape[2:]), 1, 0)  # noqa: E731
    valid_q = query_positions >= 0
    first_q = jnp.min(jnp.where(valid_q, query_positions, jnp.iinfo(jnp.int32).max))
    last_q = jnp.max(jnp.where(valid_q, query_positions, -1))

    # Under autodiff a block's scores are recomputed, not kept: what each step leaves
    # for the backward pass is the softmax state, not [t, block] scores per head.
    @jax.checkpoint
    def step(state, blocks):
        k, v, kp = blocks
        valid_k = kp >= 0
        first_k = jnp.min(jnp.where(valid_k, kp, jnp.iinfo(jnp.int32).max))
        last_k = jnp.max(jnp.where(valid_k, kp, -1))
        seen = (first_k <= last_q) & (last_k >= 0)
        if window is not None:
            seen &= last_k > first_q - window
        state = jax.lax.cond(
            seen,
            lambda s: _fold(s, query, k, v, query_positions, kp, scale, window),
            lambda s: s,
            state,
        )
        return state, None

    state, _ = jax.lax.scan(step, state, (split(key), split(value), split(key_positions)))
    return state


def _local(query, key, value, query_positions, key_positions, *, scale, window, ring_axes):
    """Attention of this device's queries; ``ring_axes``: pass the keys around them
    (ring), or () when ``key`` already holds them all."""
    batch, length, num_heads, head_dim = query.shape
    num_kv = key.shape[2]
    groups = num_heads // num_kv
    q = query.reshape(batch, length, num_kv, groups, head_dim)
    shape = (batch, num_kv, groups, length)
    state = (
        jnp.zeros((*shape, head_dim), jnp.float32),
        jnp.full(shape, NEG, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )
    # A ring step is rematerialised as a whole under autodiff: the backward pass keeps
    # the softmax state once per ring step, not once per key block (at 16K queries per
    # device, 32 heads of 128: 256 MiB a state, 32 blocks a step).
    fold = jax.checkpoint(
        lambda s, k, v, kp: _fold_blocks(s, q, k, v, query_positions, kp, scale, window)
    )
    if not ring_axes:
        state = fold(state, key, value, key_positions)
    else:
        size = math.prod(jax.lax.axis_size(a) for a in ring_axes)
        ring = [(i, (i + 1) % size) for i in range(size)]
        rotate = lambda x: jax.lax.ppermute(x, ring_axes, ring)  # noqa: E731

        def step(carry, _):
            state, (k, v, kp) = carry
            state = fold(state, k, v, kp)
            return (state, (rotate(k), rotate(v), rotate(kp))), None

        # size - 1 steps that fold and pass on, then the last block folded in place.
        (state, (k, v, kp)), _ = jax.lax.scan(
            step, (state, (key, value, key_positions)), None, length=size - 1
        )
        state = fold(state, k, v, kp)
    out, _, total = state
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, head_dim)
    return out.astype(value.dtype)


def _blocked(query, key, value, query_positions, key_positions, *, scale, window):
    """Attention over all of ``key`` by blocks: ``dot_product_attention``'s ``"chunked"``
    on a CPU, its ``"flash"`` Pallas kernels on TPU and GPU."""
    from kernels_pallas.flash_attention import flash_attention

    impl = "xla" if jax.default_backend() == "cpu" else "pallas"
    return flash_attention(
        query, key, value, query_positions, key_positions, scale=scale, window=window, impl=impl
    )


def sequence_parallel_attention(
    query, key, value, query_positions, key_positions, *, scale, window=None, variant="ring"
):
    """``dot_product_attention`` with the tokens split over the sequence mesh axes
    (``variant``: ``"ring"`` or ``"allgather"``; see the module docstring)."""
    axes = sequence_axes()
    mesh = jax.sharding.get_abstract_mesh()
    size = lambda names: math.prod(mesh.shape[n] for n in names)  # noqa: E731
    if axes and (query.shape[1] % size(axes) or key.shape[1] % size(axes)):
        axes = ()  # a length the axis does not divide (one token when a model is traced)
    if not axes:
        if variant == "allgather":
            return _blocked(
                query, key, value, query_positions, key_positions, scale=scale, window=window
            )
        return _local(
            query, key, value, query_positions, key_positions,
            scale=scale, window=window, ring_axes=(),
        )  # fmt: skip

    def split(logical, dim):  # the mesh axes of ``logical`` when they divide ``dim``
        names = _mesh_axes(logical, mesh)
        return names if names and dim % size(names) == 0 else None

    batch = split("act_batch", query.shape[0])
    heads = split("act_heads", query.shape[2])
    kv_heads = split("act_kv_heads", key.shape[2])
    q_spec = PartitionSpec(batch, axes, heads, None)
    kv_spec = PartitionSpec(batch, axes, kv_heads, None)
    pos_spec = PartitionSpec(batch, axes)

    if variant == "ring":

        def local(q, k, v, qp, kp):
            return _local(q, k, v, qp, kp, scale=scale, window=window, ring_axes=axes)

    else:

        def local(q, k, v, qp, kp):
            gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)  # noqa: E731
            return _blocked(q, gather(k), gather(v), qp, gather(kp), scale=scale, window=window)

    mapped = jax.shard_map(
        local,
        in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return mapped(query, key, value, query_positions, key_positions)
