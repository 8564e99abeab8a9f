"""Runs the tiny train config under several meshes or processes and prints JSON results.

Run by tests/train/test_multidevice.py in a subprocess, because the number of host
devices (XLA_FLAGS) and the distributed runtime must be set before JAX starts.

    python multidevice_worker.py meshes WORKDIR       # 8 host devices, 4 mesh layouts
    python multidevice_worker.py single WORKDIR       # one process, one device
    LHC_DISTRIBUTED=1 ... python multidevice_worker.py process WORKDIR   # one of N processes:
        # data parallel, then the sequence split over the processes (ring attention)
"""

import json
import logging
import os
import pathlib
import shutil
import sys

mode, workdir = sys.argv[1], sys.argv[2]
if mode == "meshes":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen  # noqa: E402
import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from lhc import parallel, train  # noqa: E402
from lhc.train import config as config_lib  # noqa: E402

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "lm_assoc_recall.py")
OVERRIDES = [
    "num_steps=3",
    "batch_size=8",
    "log_every=1",
    "eval_batches=1",
    "progress_bar=False",
    "tensorboard=False",
    "data.num_pairs=4",
    "data.num_queries=2",
    "model.max_len=11",
    "model.num_kv_heads=4",  # divisible by a tensor axis of 4
]


def layouts(config):
    """Each state leaf after one jitted train step, as the trainer builds it: its logical
    axis names, global shape and the shape of the shard on device 0."""
    exp = train.build_experiment(config)
    state = exp.init_state(int(config.seed))
    rng = jax.random.key_data(jax.random.key(0))
    with jax.set_mesh(exp.mesh), flax.linen.logical_axis_rules(exp.rules):
        boxed = jax.eval_shape(exp.init_fn(), rng)
        batch = exp.task.train_iterator(0, 1)
        state, _ = exp.jit_train_step()(
            state, parallel.global_batch(next(batch), exp.mesh, exp.rules)
        )
    is_box = lambda x: isinstance(x, flax.linen.meta.AxisMetadata)
    names = {
        jax.tree_util.keystr(path): list(box.names) if is_box(box) else None
        for path, box in jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_box)
    }
    rows = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        {"params": state["params"], "opt_state": state["opt_state"]}
    ):
        key = jax.tree_util.keystr(path)
        rows[key] = dict(
            names=names[key],
            shape=list(leaf.shape),
            shard=list(leaf.addressable_shards[0].data.shape),
        )
    return {"mesh": dict(exp.mesh.shape), "rules": [list(r) for r in exp.rules], "leaves": rows}


def copy_config(mesh_shape, attention_impl):
    """The tiny config on the copy task: 16 tokens, which a sequence axis of 4 splits
    in zig-zag order (2 x 4 chunks); 5 steps, checkpointed at 3 and 5."""
    overrides = OVERRIDES + [f"mesh_shape={mesh_shape}", "num_steps=5", "checkpoint_every=3"]
    config = config_lib.load_config(CONFIG + ":tiny", overrides)
    with config.unlocked():
        config.data = ml_collections.ConfigDict(dict(name="copy", length=8, vocab_size=16))
    config.model.vocab_size, config.model.max_len = 16, 16
    config.model.attention_impl = attention_impl
    return config


def run(name, mesh_shape, config=None, resume_from=None):
    """Trains ``config`` (or the tiny config on ``mesh_shape``) in ``WORKDIR/name``, first
    copying the run ``WORKDIR/resume_from[0]`` there, without its checkpoints after step
    ``resume_from[1]``, to continue it."""
    if config is None:
        config = config_lib.load_config(CONFIG + ":tiny", OVERRIDES + [f"mesh_shape={mesh_shape}"])
    path = os.path.join(workdir, name)
    if resume_from is not None:  # ``(run, step)``: that run as it was at that step
        source, step = resume_from
        shutil.copytree(os.path.join(workdir, source), path)
        for saved in os.listdir(os.path.join(path, "checkpoints")):
            if saved.isdigit() and int(saved) > step:
                shutil.rmtree(os.path.join(path, "checkpoints", saved))
    resumed = []  # the step each resume started from, as the trainer logs it
    handler = logging.Handler()
    handler.emit = lambda record: (
        resumed.append(record.args[0]) if "resumed" in record.msg else None
    )
    trainer_log = logging.getLogger("lhc.train.trainer")
    trainer_log.addHandler(handler)
    trainer_log.setLevel(logging.INFO)
    try:
        train.train_and_evaluate(config, path)
    finally:
        trainer_log.removeHandler(handler)
    losses = [r["train/loss"] for r in train.read_metrics(path) if "train/loss" in r]
    _, params, _ = train.restore_params(config, path)
    # Weights split over devices of other processes (fsdp, sequence) gathered first.
    params = multihost_utils.process_allgather(params, tiled=True)
    flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])
    result = {"losses": losses, "params": flat.tolist(), "resumed": resumed}
    if jax.device_count() > 1 and jax.process_count() == 1:
        result["layouts"] = layouts(config)
    return result


if mode == "meshes":
    assert jax.device_count() == 8, jax.device_count()
    results = {
        "single": run("single", "(1,1,1)"),
        "data2_fsdp4": run("data2_fsdp4", "(2,4,1)"),
        "data2_tensor4": run("data2_tensor4", "(2,1,4)"),
        # The sequence split over 4 devices (ring attention, zig-zag order), fsdp over 2.
        "copy_single": run("copy_single", None, copy_config("(1,1,1,1)", "xla")),
        "copy_fsdp2_sequence4": run("copy_seq", None, copy_config("(1,2,1,4)", "ring")),
    }
    # The one-device run's checkpoint at step 3 continued on the sequence mesh.
    results["copy_resumed_fsdp2_sequence4"] = run(
        "copy_resumed", None, copy_config("(1,2,1,4)", "ring"), resume_from=("copy_single", 3)
    )
elif mode == "single":
    results = {
        "single": run("single", "(1,1,1)"),
        "copy_single": run("copy_single", None, copy_config("(1,1,1,1)", "xla")),
    }
else:
    from lhc.parallel import maybe_initialize_distributed

    assert maybe_initialize_distributed()
    assert jax.process_count() == int(os.environ["LHC_NUM_PROCESSES"])
    results = {
        "process": run("distributed", "(-1,1,1)"),
        # Each process holds half of every sequence: ring attention across processes.
        "copy_sequence2": run("copy_seq", None, copy_config("(1,1,1,2)", "ring")),
    }
    results["process_count"] = jax.process_count()
    results["device_count"] = jax.device_count()
print("RESULTS " + json.dumps(results))
