"""Meshes, logical-axis rules, sharded initialisation, multi-host start, host offload."""

from lhc.parallel.mesh import (
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    batch_sharding,
    global_batch,
    logical_shardings,
    long_context_decode_rules,
    make_mesh,
    map_over_batch,
    maybe_initialize_distributed,
    mesh_from_config,
    replicated,
    resolve_mesh_shape,
    rules_from_config,
    sharded_init,
    tree_bytes,
    unbox,
)
from lhc.parallel.offload import host_put_rows, host_take_rows, to_device, to_host

__all__ = [
    "host_put_rows",
    "host_take_rows",
    "to_device",
    "to_host",
    "LOGICAL_AXIS_RULES",
    "long_context_decode_rules",
    "MESH_AXES",
    "batch_sharding",
    "global_batch",
    "logical_shardings",
    "make_mesh",
    "map_over_batch",
    "maybe_initialize_distributed",
    "mesh_from_config",
    "replicated",
    "resolve_mesh_shape",
    "rules_from_config",
    "sharded_init",
    "tree_bytes",
    "unbox",
]
