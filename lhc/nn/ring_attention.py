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

Gradients (``ring``) are flash attention's, by hand (``jax.custom_vjp``): the forward
pass keeps only its output and each query's log-sum-exp; the backward pass sends the
keys and values around the ring again, recomputes each block's probabilities from the
log-sum-exp, and passes the keys' and values' gradients along with them, one more step
bringing them home. Checked against one device in the tests.
"""

from __future__ import annotations

import functools
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


def _span(positions):
    """The first and last valid (non-negative) position of ``positions``."""
    valid = positions >= 0
    first = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max))
    return first, jnp.max(jnp.where(valid, positions, -1))


def _over_key_blocks(fn, carry, query_positions, key, value, key_positions, window):
    """``fn(carry, k, v, kp) -> (carry, out)`` over ``key`` in blocks of ``KEY_BLOCK``,
    skipping the blocks no query sees (their ``out`` zeros); returns the carry and the
    blocks' outs joined along the key axis (``[b, s, ...]``; ``None`` when ``fn``
    returns none)."""
    length = key.shape[1]
    block = math.gcd(length, KEY_BLOCK) if length > KEY_BLOCK else length
    count = length // block
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], count, block, *x.shape[2:]), 1, 0)  # noqa: E731
    first_q, last_q = _span(query_positions)

    def step(carry, blocks):
        k, v, kp = blocks
        first_k, last_k = _span(kp)
        seen = (first_k <= last_q) & (last_k >= 0)
        if window is not None:
            seen &= last_k > first_q - window

        def skip(carry):
            shapes = jax.eval_shape(fn, carry, k, v, kp)[1]
            return carry, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

        return jax.lax.cond(seen, lambda c: fn(c, k, v, kp), skip, carry)

    carry, outs = jax.lax.scan(step, carry, (split(key), split(value), split(key_positions)))
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], length, *x.shape[3:])  # noqa: E731
    return carry, jax.tree.map(join, outs)


def _rotate(x, ring_axes):
    """``x`` passed to the next device of the ring of ``ring_axes``."""
    size = math.prod(jax.lax.axis_size(a) for a in ring_axes)
    return jax.lax.ppermute(x, ring_axes, [(i, (i + 1) % size) for i in range(size)])


def _around_ring(fn, carry, blocks, ring_axes):
    """``fn(carry, blocks) -> (carry, blocks)`` on this device's ``blocks``, then on every
    other device's in turn, passed on around the ring of ``ring_axes`` (none: only this
    device's). Returns the carry and the blocks ``fn`` saw last: those of the next
    device, one pass short of home."""
    if not ring_axes:
        return fn(carry, blocks)
    size = math.prod(jax.lax.axis_size(a) for a in ring_axes)

    def step(state, _):
        carry, blocks = fn(*state)
        return (carry, jax.tree.map(lambda x: _rotate(x, ring_axes), blocks)), None

    (carry, blocks), _ = jax.lax.scan(step, (carry, blocks), None, length=size - 1)
    return fn(carry, blocks)


def _unhoistable(x, *positions):
    """``x`` and ``positions`` through an optimization barrier, so that what is computed
    from the positions alone (the masks) counts as depending on ``x``. Inside a scan
    over layers the positions are the same at every layer; differentiating the scan,
    JAX would otherwise compute every mask of every key block ahead of the layers and
    keep them all (at 4K queries per device over 32K keys, 32 heads: 50 GiB)."""
    return jax.lax.optimization_barrier((x, *positions))


def _forward(q, key, value, query_positions, key_positions, scale, window, ring_axes):
    """The online softmax over every device's keys: ``out [b, K, G, t, H]`` (normalised,
    float32) and ``lse [b, K, G, t]`` (log-sum-exp of each query's scores, 0 for a
    query that sees no key); ``q``: ``[b, t, K, G, H]``."""
    q, query_positions, key_positions = _unhoistable(q, query_positions, key_positions)
    batch, length, num_kv, groups, head_dim = q.shape
    shape = (batch, num_kv, groups, length)
    state = (
        jnp.zeros((*shape, head_dim), jnp.float32),
        jnp.full(shape, NEG, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )

    def fold(state, blocks):
        k, v, kp = blocks
        fold_block = lambda s, k, v, kp: (
            _fold(s, q, k, v, query_positions, kp, scale, window),
            None,
        )  # noqa: E731
        state, _ = _over_key_blocks(fold_block, state, query_positions, k, v, kp, window)
        return state, blocks

    (out, maximum, total), _ = _around_ring(fold, state, (key, value, key_positions), ring_axes)
    seen = total > 0
    out = jnp.where(seen[..., None], out / jnp.where(seen, total, 1.0)[..., None], 0.0)
    return out, jnp.where(seen, maximum + jnp.log(jnp.where(seen, total, 1.0)), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attend(q, key, value, query_positions, key_positions, scale, window, ring_axes):
    """This device's attention output ``[b, K, G, t, H]`` in ``value``'s dtype."""
    out, _ = _forward(q, key, value, query_positions, key_positions, scale, window, ring_axes)
    return out.astype(value.dtype)


def _attend_fwd(q, key, value, query_positions, key_positions, scale, window, ring_axes):
    out, lse = _forward(q, key, value, query_positions, key_positions, scale, window, ring_axes)
    out = out.astype(value.dtype)
    return out, (q, key, value, query_positions, key_positions, out, lse)


def _attend_bwd(scale, window, ring_axes, residuals, d_out):
    """Flash attention's backward pass around the ring: each block's probabilities
    recomputed from the saved log-sum-exp; the keys' and values' gradients travel with
    them and take one more pass to get home."""
    q, key, value, query_positions, key_positions, out, lse = residuals
    d_out, query_positions, key_positions = _unhoistable(d_out, query_positions, key_positions)
    do = d_out.astype(jnp.float32)
    delta = (do * out.astype(jnp.float32)).sum(-1)  # [b, K, G, t]
    qf = q.astype(jnp.float32)

    def block(dq, k, v, kp):
        scores = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(jnp.float32)) * jnp.float32(scale)
        mask = _visible(query_positions, kp, window)[:, None, None]
        probs = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)
        dv = jnp.einsum("bkgts,bkgth->bskh", probs, do)
        dscores = probs * (
            jnp.einsum("bkgth,bskh->bkgts", do, v.astype(jnp.float32)) - delta[..., None]
        )
        dq = dq + jnp.einsum("bkgts,bskh->bkgth", dscores, k.astype(jnp.float32)) * scale
        dk = jnp.einsum("bkgts,btkgh->bskh", dscores, qf) * jnp.float32(scale)
        return dq, (dk, dv)

    def grads(dq, blocks):
        k, v, kp, dk, dv = blocks
        dq, (dk_new, dv_new) = _over_key_blocks(block, dq, query_positions, k, v, kp, window)
        return dq, (k, v, kp, dk + dk_new, dv + dv_new)

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, (_, _, _, dk, dv) = _around_ring(
        grads, zeros(out), (key, value, key_positions, zeros(key), zeros(value)), ring_axes
    )
    if ring_axes:
        dk, dv = _rotate(dk, ring_axes), _rotate(dv, ring_axes)
    dq = dq.transpose(0, 3, 1, 2, 4).astype(q.dtype)
    return dq, dk.astype(key.dtype), dv.astype(value.dtype), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _local(query, key, value, query_positions, key_positions, *, scale, window, ring_axes):
    """Attention of this device's queries; ``ring_axes``: pass the keys around them
    (ring), or () when ``key`` already holds them all."""
    batch, length, num_heads, head_dim = query.shape
    num_kv = key.shape[2]
    q = query.reshape(batch, length, num_kv, num_heads // num_kv, head_dim)
    out = _attend(q, key, value, query_positions, key_positions, scale, window, tuple(ring_axes))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, head_dim)


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
