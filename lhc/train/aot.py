"""Ahead-of-time compilation of a config's train step for a Cloud TPU topology.

With libtpu installed (``pip install 'lhc[tpu]'``), ``jax.experimental.topologies``
describes a TPU slice (``v5e:2x2``, ``v5p:2x2x2``, ...) on a CPU-only host, and XLA
compiles the sharded train step for it. The compiled program reports per-device
memory and a cost estimate, which tells whether a config fits before any TPU is
rented.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import ml_collections

from lhc.train.trainer import build_experiment


@dataclasses.dataclass
class CompileReport:
    """What XLA says about the compiled train step (all sizes per device, in bytes)."""

    topology: str
    num_devices: int
    num_hosts: int
    mesh_shape: dict[str, int]
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    flops: float | None
    bytes_accessed: float | None

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries, minus outputs aliased to donated inputs."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def format(self) -> str:
        gib = 1024**3
        lines = [
            f"topology {self.topology}: {self.num_devices} devices on {self.num_hosts} host(s), "
            f"mesh {self.mesh_shape}",
            f"  per-device memory: peak {self.peak_bytes / gib:.3f} GiB "
            f"(arguments {self.argument_bytes / gib:.3f}, outputs {self.output_bytes / gib:.3f}, "
            f"temporaries {self.temp_bytes / gib:.3f}, aliased {self.alias_bytes / gib:.3f}, "
            f"code {self.generated_code_bytes / 1024**2:.1f} MiB)",
        ]
        if self.flops is not None:
            lines.append(
                f"  cost per step and device: {self.flops / 1e9:.3f} GFLOP, "
                f"{(self.bytes_accessed or 0) / 1e9:.3f} GB accessed"
            )
        return "\n".join(lines)


def topology_devices(topology: str) -> list[Any]:
    """The devices of a named Cloud TPU topology, e.g. ``"v5e:2x2"`` or ``"v5p:2x2x2"``."""
    try:
        from jax.experimental import topologies
    except ImportError as error:  # pragma: no cover - part of jax
        raise RuntimeError("jax.experimental.topologies is unavailable") from error
    try:
        description = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as error:
        raise ValueError(
            f"--topology {topology!r} could not be described: {error}. Install libtpu "
            f"(pip install 'lhc[tpu]') and use a name like 'v5e:2x2' or 'v5p:2x2x2'"
        ) from error
    return list(description.devices)


def compile_train_step(config: ml_collections.ConfigDict, topology: str) -> CompileReport:
    """Lowers and compiles the train step of ``config`` for ``topology``; nothing runs."""
    devices = topology_devices(topology)
    exp = build_experiment(config, devices=devices)
    abstract_state = exp.abstract_state()
    abstract_batch = exp.abstract_batch()
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules):
        step = exp.jit_train_step()
        compiled = step.lower(abstract_state, abstract_batch, *exp.frozen_args).compile()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    return CompileReport(
        topology=topology,
        num_devices=len(devices),
        num_hosts=len({d.process_index for d in devices}),
        mesh_shape=dict(exp.mesh.shape),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        generated_code_bytes=int(memory.generated_code_size_in_bytes),
        flops=float(cost["flops"]) if "flops" in cost else None,
        bytes_accessed=float(cost["bytes accessed"]) if "bytes accessed" in cost else None,
    )
