"""Arrays that live in host memory inside jitted programs: rows written and read there.

A cache too large for device memory (GCA's chunk memory, for one) is kept in the host
memory of each device (``memory_kind="pinned_host"``): its program scatters new rows
into it and gathers the few rows a step needs from it *on the host*
(``jax.experimental.compute_on``), so that only those rows cross to the device. The
sharding (which devices hold which part) is unchanged; only the memory kind differs.

On a CPU the host memory is the device memory and the transfers are copies, but the
programs are the same ones a TPU or GPU runs (``tests/parallel/test_offload.py``
compiles them for a TPU topology and checks where the bytes live).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def to_host(x: jax.Array) -> jax.Array:
    """``x`` moved to host memory (same sharding); in or out of ``jax.jit``."""
    return jax.device_put(x, HOST)


def to_device(x: jax.Array) -> jax.Array:
    """``x`` moved to device memory (same sharding); in or out of ``jax.jit``."""
    return jax.device_put(x, DEVICE)


def host_put_rows(store: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """``store`` (in host memory) with ``store[b, slots[b, m]] = rows[b, m]``, on the host.

    Args:
        store: ``[B, N, ...]`` in host memory.
        slots: int ``[B, M]``; a slot outside ``[0, N)`` drops its row.
        rows: ``[B, M, ...]`` (any memory); cast to the store's dtype.

    Returns:
        The updated store, in host memory.
    """
    slots, rows = to_host(slots.astype(jnp.int32)), to_host(rows.astype(store.dtype))
    batch = to_host(jnp.arange(store.shape[0], dtype=jnp.int32)[:, None])
    with compute_on("device_host"):
        return store.at[batch, slots].set(rows, mode="drop")


def host_take_rows(store: jax.Array, indices: jax.Array) -> jax.Array:
    """``store[b, indices[b, ...]]`` gathered on the host and moved to the device.

    Args:
        store: ``[B, N, ...]`` in host memory.
        indices: int ``[B, ...]``; entries outside ``[0, N)`` read row 0 (mask them).

    Returns:
        ``indices.shape + store.shape[2:]``, in device memory.
    """
    valid = (indices >= 0) & (indices < store.shape[1])
    flat = jnp.where(valid, indices, 0).astype(jnp.int32).reshape(indices.shape[0], -1)
    flat = to_host(flat)
    with compute_on("device_host"):
        taken = jax.vmap(lambda s, i: s.at[i].get(mode="promise_in_bounds"))(store, flat)
    return to_device(taken).reshape(indices.shape + store.shape[2:])
