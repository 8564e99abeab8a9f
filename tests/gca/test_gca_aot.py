"""configs/gca_pg19.py's train step compiled ahead of time for a TPU slice: the Pallas
chunk-retrieval kernels are compiled for the TPU and run per device over the batch."""

import re

import flax.linen as nn
import jax
import pytest

from lhc.train import build_experiment
from lhc.train import config as config_lib


def test_pg19_train_step_compiles_the_pallas_kernels_per_device_for_v5e():
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    from lhc.train.aot import topology_devices

    config = config_lib.load_config(
        "configs/gca_pg19.py:runlocal",
        [
            "batch_size=4",
            "data.length=189",  # 3 chunks of 63 text tokens
            "model.gca_impl=pallas",
            "model.embed_dim=128",
            "model.num_heads=2",
            "model.num_kv_heads=2",
            "model.head_dim=64",
            "model.chunk_size=64",
            "model.window=65",
        ],
    )
    exp = build_experiment(config, devices=topology_devices("v5e:2x2"))
    spec = exp.task.batch_spec(4)
    shardings = exp.batch_shardings(spec)
    batch = {
        name: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[name])
        for name, s in spec.items()
    }
    state = exp.abstract_state()
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules):
        compiled = exp.jit_train_step().lower(state, batch).compile()
    text = compiled.as_text()
    kernels = set(re.findall(r"%(chunk_retrieval_\w+?)(?:\.\d+)? = ", text))
    assert {"chunk_retrieval_fwd", "chunk_retrieval_bwd_dq", "chunk_retrieval_bwd_dkv"} <= kernels
    # Each device runs the kernels on its own rows: one of the four.
    assert re.search(r"%chunk_retrieval_fwd(\.\d+)? = f32\[1,", text)
