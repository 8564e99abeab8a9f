"""Host-memory rows: values against numpy, memory kinds, and a TPU program that keeps the
store in host memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lhc.parallel.offload import host_put_rows, host_take_rows, to_host

SHAPE = (2, 6, 3, 4)  # [B, N, ...]


def _store(rng):
    return rng.normal(size=SHAPE).astype(np.float32)


def test_put_and_take_rows_match_numpy_and_stay_in_host_memory():
    rng = np.random.default_rng(0)
    store = _store(rng)
    slots = np.array([[1, 6], [0, 4]], np.int32)  # slot 6 is out of range: dropped
    rows = rng.normal(size=(2, 2) + SHAPE[2:]).astype(np.float32)
    indices = np.array([[[4, -1], [1, 1]], [[0, 5], [-1, 4]]], np.int32)

    @jax.jit
    def step(store, slots, rows, indices):
        store = host_put_rows(store, slots, rows)
        return store, host_take_rows(store, indices)

    new_store, taken = step(to_host(jnp.asarray(store)), slots, rows, indices)
    expected = store.copy()
    expected[0, 1], expected[1, 0], expected[1, 4] = rows[0, 0], rows[1, 0], rows[1, 1]
    np.testing.assert_array_equal(np.asarray(new_store), expected)
    gathered = np.stack([expected[b][np.maximum(indices[b], 0)] for b in range(2)])
    np.testing.assert_array_equal(np.asarray(taken), gathered)
    assert new_store.sharding.memory_kind == "pinned_host"
    assert taken.sharding.memory_kind != "pinned_host"


def test_tpu_program_keeps_the_store_in_host_memory():
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (len(topology.devices),), ("data",))
    host = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    device = NamedSharding(mesh, P("data"))
    store_shape = (4, 256, 64, 2, 64)  # 4 MiB of bfloat16 per device
    store = jax.ShapeDtypeStruct(store_shape, jnp.bfloat16, sharding=host)
    slots = jax.ShapeDtypeStruct((4, 1), jnp.int32, sharding=device)
    rows = jax.ShapeDtypeStruct((4, 1) + store_shape[2:], jnp.bfloat16, sharding=device)
    indices = jax.ShapeDtypeStruct((4, 8), jnp.int32, sharding=device)

    def step(store, slots, rows, indices):
        store = host_put_rows(store, slots, rows)
        return store, host_take_rows(store, indices)

    compiled = (
        jax.jit(step, out_shardings=(host, device), donate_argnums=0)
        .lower(store, slots, rows, indices)
        .compile()
    )
    stats = compiled.memory_analysis()
    per_device = np.prod(store_shape[1:]) * 2  # bytes of one device's store
    assert stats.host_argument_size_in_bytes >= per_device
    assert stats.host_alias_size_in_bytes >= per_device  # updated in place, on the host
    # On the device: only the rows that cross (one written, eight read), never the store.
    assert stats.argument_size_in_bytes + stats.temp_size_in_bytes < per_device / 4
