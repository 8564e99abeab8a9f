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
  attends its queries to the keys it holds with flash attention
  (``kernels_pallas.flash_attention``: the Pallas kernels on TPU and GPU, blocked XLA
  on a CPU), which gives a normalised output and each query's log-sum-exp, and folds
  them into what it has (float32), so no device ever holds more than two devices' keys.
  Blocks that no query of the device can see (after every query, by causality, or before
  every query's window) are skipped inside. The mask is the one of
  ``lhc.nn.attention_ops``, built from positions, so any assignment of tokens to devices
  is correct; a zig-zag one (``lhc.parallel.zigzag_order``) gives every device equal
  work under a causal mask.
* ``allgather``: every device gathers all keys and values and attends its queries to
  them with the same flash attention: one collective per layer, the full key/value
  memory per device: the better choice for short rings.

Gradients are flash attention's, by hand (``jax.custom_vjp``): the forward pass keeps
only its output and each query's log-sum-exp; the backward pass sends the keys and
values around the ring again, and each device's keys give their own gradients and
their part of the queries' through the kernels' backward pass (probabilities
recomputed from the whole softmax's log-sum-exp); the keys' and values' gradients
travel with them, one more step bringing them home. Checked against one device in the
tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kernels_pallas._common import target_platform
from kernels_pallas.flash_attention import (
    BlockSizes,
    flash_attention_backward,
    flash_attention_forward,
)

KEY_BLOCK = 512  # queries and keys per block of the XLA flash attention (on a CPU)


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


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """How one device attends its queries to one device's keys: the flash-attention
    forward and backward passes of ``kernels_pallas.flash_attention`` (``impl="xla"``,
    blocked plain XLA, on a CPU; the Pallas kernels on TPU and GPU)."""

    scale: float
    window: int | None
    impl: str

    def _kwargs(self):
        blocks = BlockSizes(KEY_BLOCK, KEY_BLOCK) if self.impl == "xla" else None
        return dict(
            scale=self.scale, window=self.window, impl=self.impl,
            interpret=None if self.impl == "pallas" else False, block_sizes=blocks,
        )  # fmt: skip

    def forward(self, q, k, v, qp, kp):
        return flash_attention_forward(q, k, v, qp, kp, **self._kwargs())

    def backward(self, q, k, v, qp, kp, d_out, lse, delta):
        return flash_attention_backward(q, k, v, qp, kp, d_out, lse, delta, **self._kwargs())


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


def _rows(x):
    """``[b, N, t]`` per-query values as ``[b, t, N, 1]``, to scale ``[b, t, N, H]``."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _forward(q, key, value, query_positions, key_positions, blocks: _Blocks, ring_axes):
    """The softmax over every device's keys: ``out [b, t, N, H]`` float32 and ``lse
    [b, N, t]`` (``-inf`` for a query that sees no key). Each device's keys give a
    normalised output and its log-sum-exp; two such are combined by weighting each
    with ``exp(its lse - their log-sum-exp)``."""
    batch, length, heads, _ = q.shape
    state = (jnp.zeros(q.shape, jnp.float32), jnp.full((batch, heads, length), -jnp.inf))

    def fold(state, kv):
        (out, lse), (k, v, kp) = state, kv
        block_out, block_lse = blocks.forward(q, k, v, query_positions, kp)
        total = jnp.logaddexp(lse, block_lse)
        finite = jnp.where(jnp.isfinite(total), total, 0.0)  # -inf - -inf would be nan
        out = out * _rows(jnp.exp(lse - finite)) + block_out.astype(jnp.float32) * _rows(
            jnp.exp(block_lse - finite)
        )
        return (out, total), kv

    state, _ = _around_ring(fold, state, (key, value, key_positions), ring_axes)
    return state


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q, key, value, query_positions, key_positions, blocks, ring_axes):
    """This device's attention output ``[b, t, N, H]`` in ``value``'s dtype."""
    out, _ = _forward(q, key, value, query_positions, key_positions, blocks, ring_axes)
    return out.astype(value.dtype)


def _attend_fwd(q, key, value, query_positions, key_positions, blocks, ring_axes):
    out, lse = _forward(q, key, value, query_positions, key_positions, blocks, ring_axes)
    out = out.astype(value.dtype)
    return out, (q, key, value, query_positions, key_positions, out, lse)


def _attend_bwd(blocks, ring_axes, residuals, d_out):
    """Flash attention's backward pass around the ring: each device's keys give their
    own gradients and their part of the queries' from the whole softmax's log-sum-exp;
    the keys' and values' gradients travel with them and take one more pass home."""
    q, key, value, query_positions, key_positions, out, lse = residuals
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def grads(dq, kv):
        k, v, kp, dk, dv = kv
        dq_k, dk_k, dv_k = blocks.backward(q, k, v, query_positions, kp, d_out, lse, delta)
        return dq + f32(dq_k), (k, v, kp, dk + f32(dk_k), dv + f32(dv_k))

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, (_, _, _, dk, dv) = _around_ring(
        grads, zeros(q), (key, value, key_positions, zeros(key), zeros(value)), ring_axes
    )
    if ring_axes:
        dk, dv = _rotate(dk, ring_axes), _rotate(dv, ring_axes)
    return dq.astype(q.dtype), dk.astype(key.dtype), dv.astype(value.dtype), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _impl(impl: str | None) -> str:
    """The flash-attention implementation of each block: ``"pallas"`` for TPU and GPU
    (those of the mesh in force: a TPU slice compiled ahead of time from a CPU host
    too), ``"xla"`` on a CPU (the kernels would be interpreted), unless named."""
    if impl is None:
        return "pallas" if target_platform() in ("tpu", "gpu") else "xla"
    if impl not in ("xla", "pallas"):
        raise ValueError(f"impl must be None, 'xla' or 'pallas', got {impl!r}")
    return impl


def sequence_parallel_attention(
    query, key, value, query_positions, key_positions, *, scale, window=None, variant="ring",
    impl=None,
):  # fmt: skip
    """``dot_product_attention`` with the tokens split over the sequence mesh axes
    (``variant``: ``"ring"`` or ``"allgather"``; see the module docstring). ``impl``:
    the flash attention of each block, ``"xla"`` or ``"pallas"`` (default: by the
    backend, the kernels on TPU and GPU; on a CPU they run interpreted)."""
    blocks = _Blocks(scale, window, _impl(impl))
    axes = sequence_axes()
    mesh = jax.sharding.get_abstract_mesh()
    size = lambda names: math.prod(mesh.shape[n] for n in names)  # noqa: E731
    if axes and (query.shape[1] % size(axes) or key.shape[1] % size(axes)):
        axes = ()  # a length the axis does not divide (one token when a model is traced)
    if mesh.empty:
        return _attend(query, key, value, query_positions, key_positions, blocks, ())

    def split(logical, dim):  # the mesh axes of ``logical`` when they divide ``dim``
        names = _mesh_axes(logical, mesh)
        return names if names and dim % size(names) == 0 else None

    batch = split("act_batch", query.shape[0])
    heads = split("act_heads", query.shape[2])
    kv_heads = split("act_kv_heads", key.shape[2])
    if kv_heads != heads:  # each device's query heads must read its own key/value heads
        heads = kv_heads = None
    # Without a sequence axis the rows and heads are still split: the kernels run
    # per device (Mosaic kernels cannot be partitioned by XLA).
    tokens = axes or None
    q_spec = PartitionSpec(batch, tokens, heads, None)
    kv_spec = PartitionSpec(batch, tokens, kv_heads, None)
    pos_spec = PartitionSpec(batch, tokens)

    def local(q, k, v, qp, kp):
        if variant == "ring" or not axes:
            return _attend(q, k, v, qp, kp, blocks, axes)
        gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)  # noqa: E731
        return _attend(q, gather(k), gather(v), qp, gather(kp), blocks, ())

    mapped = jax.shard_map(
        local,
        in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return mapped(query, key, value, query_positions, key_positions)
