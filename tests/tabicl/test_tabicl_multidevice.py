"""Sharded over 8 host devices, inference and the training forward equal one device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    from sklearn.datasets import load_iris
    from jax.sharding import NamedSharding, PartitionSpec
    from lhc.parallel import LOGICAL_AXIS_RULES, batch_sharding, make_mesh
    from lhc.tabicl import (
        TabICL, TabICLClassifier, TabICLConfig, abstract_params, predict_logits, save_orbax,
    )
    from lhc.tabicl import inference

    config = TabICLConfig(
        embed_dim=16, col_num_blocks=2, col_nhead=2, col_num_inds=8, row_num_blocks=2,
        row_nhead=2, row_num_cls=2, icl_num_blocks=2, icl_nhead=2,
    )
    rng = np.random.default_rng(0)
    shapes = nn.meta.unbox(abstract_params(config))
    params = jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(np.float32), shapes)
    directory = os.path.join(tempfile.mkdtemp(), "model")
    save_orbax(directory, config, params)
    mesh = make_mesh((-1, 1, 1))

    X, y = load_iris(return_X_y=True)
    order = rng.permutation(len(y))
    X, y = X[order], y[order]
    # Member batches of 3, 3 and 2 over 8 devices: none fills the mesh, the last is short.
    kwargs = dict(n_estimators=8, batch_size=3)
    single = TabICLClassifier(model_path=directory, **kwargs).fit(X[:100], y[:100])
    sharded = TabICLClassifier(model_path=directory, mesh=mesh, **kwargs).fit(X[:100], y[:100])
    diff = np.abs(single.predict_proba(X[100:]) - sharded.predict_proba(X[100:])).max()
    assert diff < 1e-5, diff

    # Hierarchical (12 > 10 classes) with a sharded member batch.
    model = TabICL(config)
    table = rng.normal(size=(90, 5)).astype(np.float32)
    labels = np.stack([rng.permutation(np.arange(60) % 12) for _ in range(3)])
    perms = np.stack([rng.permutation(5) for _ in range(3)])
    single = predict_logits(model, params, table, labels, feature_permutations=perms)
    sharded = predict_logits(model, params, table, labels, feature_permutations=perms, mesh=mesh)
    assert np.abs(single - sharded).max() < 1e-5

    # The member axis is really split: one member per device.
    members = batch_sharding(mesh, LOGICAL_AXIS_RULES, 2)
    reps = inference.embed_rows(
        model, jax.device_put(params, NamedSharding(mesh, PartitionSpec())),
        jnp.asarray(table[None, :40]),
        inference.train_summaries(model, params, jnp.asarray(table[:30].T[None]),
                                  jnp.ones(30, bool), col_chunk=4),
        jnp.zeros((1, 5), bool),
        jax.device_put(np.zeros(8, np.int32), batch_sharding(mesh, LOGICAL_AXIS_RULES, 1)),
        jax.device_put(np.tile(np.arange(5, dtype=np.int32), (8, 1)), members),
        jnp.ones(5, bool), row_chunk=16,
        member_sharding=batch_sharding(mesh, LOGICAL_AXIS_RULES, 1),
    )
    assert reps.shape == (8, 40, 32)
    assert {shard.data.shape for shard in reps.addressable_shards} == {(1, 40, 32)}

    # Training forward and gradients with batch-sharded tables and logically sharded
    # parameters equal the single-device ones.
    from lhc.parallel import logical_shardings

    X = jnp.asarray(rng.normal(size=(8, 40, 5)), jnp.float32)
    y_train = jnp.asarray(rng.integers(0, 3, size=(8, 30)), jnp.int32)
    y_test = jnp.asarray(rng.integers(0, 3, size=(8, 10)), jnp.int32)

    def loss(params, X, y_train, y_test):
        logits = model.apply({"params": params}, X, y_train)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y_test[..., None], -1))

    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(params, X, y_train, y_test)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        shardings = nn.meta.unbox(
            logical_shardings(abstract_params(config), mesh, LOGICAL_AXIS_RULES)
        )
        batch = [jax.device_put(a, batch_sharding(mesh, LOGICAL_AXIS_RULES, a.ndim))
                 for a in (X, y_train, y_test)]
        value_s, grads_s = step(jax.device_put(params, shardings), *batch)
    assert abs(float(value) - float(value_s)) < 1e-5, (value, value_s)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_s)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-5
    print("ok")
    """
)


@pytest.mark.multidevice
@pytest.mark.slow
def test_sharded_ensemble_equals_single_device(tmp_path):
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
    )
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")
