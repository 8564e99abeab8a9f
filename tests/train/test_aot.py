"""The tiny config's train step compiles ahead of time for Cloud TPU topologies (libtpu)."""

import pathlib

import jax
import numpy as np
import pytest

from lhc.parallel import tree_bytes
from lhc.train import build_experiment
from lhc.train import config as config_lib
from lhc.train.aot import compile_train_step, topology_devices

pytest.importorskip("libtpu", reason="ahead-of-time TPU compilation needs the tpu extra")

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "lm_assoc_recall.py")


@pytest.mark.parametrize(
    "topology, mesh_shape, chips, hosts",
    [("v5e:2x2", "(-1,1,1)", 4, 1), ("v5p:2x2x2", "(2,2,2)", 8, 2)],
)
def test_train_step_compiles_for_topology(topology, mesh_shape, chips, hosts):
    config = config_lib.load_config(CONFIG + ":tiny", [f"mesh_shape={mesh_shape}"])
    report = compile_train_step(config, topology)
    assert report.num_devices == chips and report.num_hosts == hosts
    assert (
        report.mesh_shape["data"] * report.mesh_shape["fsdp"] * report.mesh_shape["tensor"] == chips
    )
    # Independent lower bound: every device holds at least its shard of the train state.
    exp = build_experiment(config, devices=topology_devices(topology))
    state = exp.abstract_state()
    shard_bytes = sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(state)
    )
    assert report.argument_bytes >= shard_bytes > 0
    assert shard_bytes <= tree_bytes(state)
    assert report.flops is not None and report.flops > 0
    assert "per-device memory" in report.format()


def test_unknown_topology_is_a_clear_error():
    config = config_lib.load_config(CONFIG + ":tiny")
    with pytest.raises(ValueError, match="--topology 'v9z:1x1'"):
        compile_train_step(config, "v9z:1x1")
