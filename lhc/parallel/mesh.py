"""Device meshes, logical-axis rules and sharded initialisation.

The mesh has four axes: ``data`` (pure data parallelism), ``fsdp`` (data parallel
with parameters and optimizer state sharded along it), ``tensor`` (model parallel over
heads and MLP width) and ``sequence`` (the tokens of each sequence split over devices:
activations, attention by ``impl="ring"`` or ``"allgather"``, the decoding cache). A
config names the sizes (a 3-tuple, as recorded before the sequence axis, means a
sequence axis of 1); one of them may be -1 ("whatever devices remain").

Parameters and activations carry *logical* axis names; ``LOGICAL_AXIS_RULES`` maps
them to mesh axes, and a config may override that table.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor", "sequence")

# Parameter names: vocab, embed, mlp, heads, kv_heads, kv (head dim), layers, norm.
# Activation names start with act_ (and cache_ for decoding caches).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("act_batch", ("data", "fsdp")),
    ("act_len", None),
    ("act_emb", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_kv", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_batch", ("data", "fsdp")),
    ("cache_len", None),
    ("cache_kv_heads", "tensor"),
    ("cache_kv", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("layers", None),
    ("norm", None),
)


def _names(axes) -> tuple[str, ...]:
    """A rule's mesh axes (``None``, a name or several) as a tuple of names."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def long_context_decode_rules(
    rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES,
    sequence_axes: str | tuple[str, ...] = ("data", "fsdp"),
) -> tuple[tuple[str, Any], ...]:
    """Rules for decoding one long sequence: the cache's slots split over mesh axes.

    At batch 1 the batch axes have nothing to split; instead each device keeps
    ``S / n`` slots of every layer's cache and attends over them, and XLA combines the
    per-device softmax statistics with small all-reduces (flash-decoding across devices).
    The cache length must divide evenly (``generate``'s default lengths are multiples of
    16). Heads stay on ``tensor``.

    Args:
        rules: the rules to start from.
        sequence_axes: mesh axes for the cache's ``cache_len`` axis; the batch axes that
            used them (``act_batch``, ``cache_batch``) are replicated instead.
    """
    axes = _names(sequence_axes)
    changed = {"cache_len": axes, "cache_batch": None, "act_batch": None}
    out = [(name, changed.pop(name) if name in changed else target) for name, target in rules]
    return tuple(out) + tuple(changed.items())


def sequence_parallel_rules(
    rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES, axis: str = "sequence"
) -> tuple[tuple[str, Any], ...]:
    """``rules`` with the tokens of activations (``act_len``) and the decoding cache's
    slots (``cache_len``) split over the mesh axis ``axis``: training and prefill of
    sequences longer than one device holds (with ``attention_impl="ring"`` or
    ``"allgather"``), and decoding from the cache they leave, each device attending to
    its slots (see ``long_context_decode_rules``).

    The parameters' ``embed`` dimension, and so the optimizer state, is split over
    ``axis`` as well as the axes it had (``fsdp``): the devices of a sequence hold
    different tokens but the same weights, so they share the weights' memory the way
    fsdp rows do, each layer's weights gathered when it runs."""
    embed = _names(dict(rules).get("embed"))
    changed = {"act_len": axis, "cache_len": axis, "embed": (*embed, axis)}
    out = [(name, changed.pop(name) if name in changed else target) for name, target in rules]
    return tuple(out) + tuple(changed.items())


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """The token order that balances causal attention over ``shards`` devices.

    The sequence is cut into ``2 * shards`` chunks; device ``i`` takes chunks ``i`` and
    ``2 * shards - 1 - i``, so each holds an early and a late part and every device has
    the same number of visible (query, key) pairs. ``x[..., order]`` lays out tokens,
    positions and targets alike (attention masks by position, so the model's result per
    token is unchanged); ``np.argsort(order)`` undoes it.

    Raises:
        ValueError: ``length`` not a multiple of ``2 * shards``.
    """
    if shards < 1 or length % (2 * shards):
        raise ValueError(
            f"zigzag_order: length must be a multiple of 2 * shards = {2 * shards}, got {length}"
        )
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(shards)])


def resolve_mesh_shape(
    shape: Sequence[int], num_devices: int, axes: Sequence[str] = MESH_AXES
) -> tuple[int, ...]:
    """Replaces a single -1 in ``shape`` so that the product equals ``num_devices``
    (a shape of one size fewer than ``MESH_AXES``, as recorded before the ``sequence``
    axis, gets a sequence axis of 1)."""
    shape = tuple(int(s) for s in shape)
    if tuple(axes) == MESH_AXES and len(shape) == len(MESH_AXES) - 1:
        shape += (1,)
    if len(shape) != len(axes):
        raise ValueError(f"mesh_shape must have one size per axis {tuple(axes)}, got {shape}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh_shape may contain at most one -1, got {shape}")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh_shape sizes must be positive or -1, got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(
                f"mesh_shape {shape} cannot be completed: {num_devices} devices are not "
                f"divisible by {known}"
            )
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh_shape {shape} needs {math.prod(shape)} devices, but {num_devices} are available"
        )
    return shape


def make_mesh(
    shape: Sequence[int] = (-1, 1, 1, 1),
    axes: Sequence[str] = MESH_AXES,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Builds a mesh with Auto axis types (needed by linen's logical constraints)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(int(s) for s in shape)
    if tuple(axes) == MESH_AXES and len(shape) == len(MESH_AXES) - 1:
        shape += (1,)
    if -1 not in shape and 0 < math.prod(shape) < len(devices):
        # An explicit shape smaller than the machine (e.g. (1, 1, 1) on 8 devices) runs
        # on the first devices only; say so, since the others sit idle.
        log.warning("mesh %s uses %d of %d devices", shape, math.prod(shape), len(devices))
        devices = devices[: math.prod(shape)]
    shape = resolve_mesh_shape(shape, len(devices), axes)
    return jax.make_mesh(
        shape, tuple(axes), axis_types=(AxisType.Auto,) * len(axes), devices=devices
    )


def mesh_from_config(config, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh named by ``config.mesh_shape`` (and optionally ``config.mesh_axes``)."""
    axes = tuple(config.get("mesh_axes", MESH_AXES))
    return make_mesh(tuple(config.get("mesh_shape", (-1, 1, 1, 1))), axes, devices)


def rules_from_config(config) -> tuple[tuple[str, Any], ...]:
    """Logical-axis rules of ``config`` (``config.logical_axis_rules``), or the defaults:
    ``sequence_parallel_rules()`` when ``config.mesh_shape`` splits the sequence axis."""
    rules = config.get("logical_axis_rules", None)
    if rules is None:
        shape = tuple(config.get("mesh_shape", ()))
        axes = tuple(config.get("mesh_axes", MESH_AXES))
        if "sequence" in axes and len(shape) == len(axes) and shape[axes.index("sequence")] != 1:
            return sequence_parallel_rules()
        return LOGICAL_AXIS_RULES
    return tuple((str(name), _as_mesh_axes(target)) for name, target in rules)


def _as_mesh_axes(target):
    if isinstance(target, list):
        return tuple(target)
    return target


def unbox(tree) -> Any:
    """Removes ``nn.Partitioned`` boxes without adding sharding constraints.

    Works on abstract trees outside ``jit`` (``nn.meta.unbox`` would constrain them).
    """
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.meta.AxisMetadata) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )


def logical_shardings(abstract_tree, mesh: Mesh, rules) -> Any:
    """NamedShardings for a tree of (possibly ``nn.Partitioned``-boxed) abstract values.

    Leaves without logical names are replicated. A box around an empty pytree node
    (optax's ``MaskedNode``, which stands in for the state of a frozen parameter) gives
    that empty node back, so the result matches the unboxed tree's structure.
    """

    def sharding(x):
        if isinstance(x, nn.meta.AxisMetadata):
            value = x.unbox(apply_constraint=False)
            if not jax.tree.leaves(value):
                return value
            spec = x.get_partition_spec()
        else:
            spec = PartitionSpec()
        return NamedSharding(mesh, nn.logical_to_mesh_axes(spec, rules))

    return jax.tree.map(
        sharding, abstract_tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
    )


def sharded_init(init_fn, mesh: Mesh, rules, *args):
    """Initialises a pytree directly in its sharded layout.

    ``init_fn(*args)`` returns a tree whose leaves may be ``nn.LogicallyPartitioned``.
    The tree is traced abstractly (``eval_shape``), its shardings derived from the logical
    names, and the real initialisation is jitted with those ``out_shardings``, so no
    device ever holds the full unsharded tree. Returns ``(tree, shardings)`` with the
    boxes removed.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_fn, *args)
        shardings = logical_shardings(abstract, mesh, rules)
        tree = jax.jit(lambda *a: nn.meta.unbox(init_fn(*a)), out_shardings=shardings)(*args)
    return tree, shardings


def batch_sharding(mesh: Mesh, rules, ndim: int) -> NamedSharding:
    """Sharding of a batch array: leading axis over the ``act_batch`` mesh axes."""
    spec = nn.logical_to_mesh_axes(("act_batch",) + (None,) * (ndim - 1), rules)
    return NamedSharding(mesh, spec)


def map_over_batch(fn, *args):
    """``fn(*args)``, run on each device's rows when a mesh of several devices is set.

    For kernels XLA cannot partition (Pallas / Mosaic calls): under ``jax.set_mesh``
    with more than one device, ``jax.shard_map`` runs ``fn`` per device over the mesh
    axes of the logical axis ``act_batch`` (from the active logical-axis rules), every
    other mesh axis replicated; without such a mesh, or for a batch those axes do not
    divide, ``fn(*args)`` directly. Every argument and the output have the batch as
    their leading axis.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*args)
    axes = nn.logical_to_mesh_axes(("act_batch",))[0]
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if args[0].shape[0] % math.prod(mesh.shape[name] for name in names):
        return fn(*args)  # a batch the mesh does not divide (one row at init) stays whole
    spec = PartitionSpec(axes)
    mapped = jax.shard_map(fn, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)
    return mapped(*args)


def batch_share(mesh: Mesh, rules) -> tuple[int, int]:
    """``(index, count)``: this process loads part ``index`` of ``count`` equal parts of
    each global batch's rows (what a task's ``train_iterator`` takes).

    The rows are split between processes only along the batch's mesh axes
    (``act_batch``). Processes whose devices differ along the other axes, a
    ``sequence`` or ``tensor`` axis that crosses processes, hold the same rows and load
    the same part: with one process per device and a mesh ``(1, 1, 1, 2)``, both
    processes load every row (``(0, 1)``), each device keeping its half of the tokens.
    """
    hashable = tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in rules)
    return _batch_share(mesh, hashable, jax.process_index())


@functools.lru_cache(maxsize=16)
def _batch_share(mesh: Mesh, rules, process: int) -> tuple[int, int]:
    """``batch_share``, computed once per mesh and rules (``global_batch`` asks every
    step)."""
    sharding = batch_sharding(mesh, rules, 1)
    axes = _names(sharding.spec[0] if len(sharding.spec) else None)
    rows = math.prod(mesh.shape[a] for a in axes)  # one row per block of the batch
    starts: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((rows,)).items():
        starts.setdefault(device.process_index, set()).add(index[0].start or 0)
    parts = sorted({tuple(sorted(s)) for s in starts.values()})
    return parts.index(tuple(sorted(starts[process]))), len(parts)


def global_batch(local_batch, mesh: Mesh, rules):
    """Assembles process-local numpy batches into global, batch-sharded jax Arrays.

    Every process passes its own part of the rows (``batch_share``: the leading axis is
    one of ``count`` equal parts of the global batch); the result is one global array
    per leaf.
    """
    _, count = batch_share(mesh, rules)

    def put(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, rules, x.ndim)
        global_shape = (x.shape[0] * count,) + x.shape[1:]
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, local_batch)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def maybe_initialize_distributed() -> bool:
    """Calls ``jax.distributed.initialize()`` when ``LHC_DISTRIBUTED=1``.

    On Cloud TPU VMs the arguments are discovered automatically. Elsewhere set
    ``LHC_COORDINATOR`` (host:port), ``LHC_NUM_PROCESSES`` and ``LHC_PROCESS_ID``.
    Returns whether the distributed runtime was started.
    """
    if os.environ.get("LHC_DISTRIBUTED", "0") != "1":
        return False
    if jax.distributed.is_initialized():
        return True
    kwargs = {}
    if "LHC_COORDINATOR" in os.environ:
        kwargs = dict(
            coordinator_address=os.environ["LHC_COORDINATOR"],
            num_processes=int(os.environ["LHC_NUM_PROCESSES"]),
            process_id=int(os.environ["LHC_PROCESS_ID"]),
        )
        if jax.config.jax_platforms in (None, "", "cpu") and os.environ.get(
            "JAX_PLATFORMS", ""
        ) in ("", "cpu"):
            # CPU collectives across processes (tests, local debugging).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True


def tree_bytes(tree) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) in ``tree``."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
