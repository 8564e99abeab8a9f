"""The sequence mesh axis: ring and all-gather attention, a Transformer's loss and
gradients and its prefill and greedy decoding with the tokens split over 8 host devices,
each equal to one device; the zig-zag layout; 3-axis mesh shapes."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lhc import lm, parallel
from lhc.lm.costs import ring_attention_costs

_SCRIPT = textwrap.dedent(
    """
    import functools, json, os, runpy
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    import flax.linen as nn
    from lhc import lm
    from lhc.nn.attention_ops import dot_product_attention
    from lhc.parallel import make_mesh, sequence_parallel_rules, zigzag_order
    random_params = runpy.run_path(os.environ["LHC_TESTS_SUPPORT"])["random_params"]
    rules = sequence_parallel_rules()
    rng = np.random.default_rng(0)
    results = {"attention": [], "model": [], "generate": []}

    # Attention alone: GQA (4 query heads over 2 key/value heads), padding in one row,
    # causal and windowed, the tokens in zig-zag order over the sequence axis.
    B, T, N, K, H = 2, 64, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    pos = np.tile(np.arange(T), (B, 1)); pos[1, :5] = -1
    from lhc.nn.ring_attention import sequence_parallel_attention
    def attention(impl, window, q, k, v, p):
        if impl == "ring-pallas":  # the Pallas flash kernels in each ring step, interpreted
            return sequence_parallel_attention(
                q, k, v, p, p, scale=H ** -0.5, window=window, impl="pallas")
        return dot_product_attention(q, k, v, p, p, impl=impl, window=window)
    def loss(impl, window, q, k, v, p):
        return (attention(impl, window, q, k, v, p) ** 2).sum()
    @functools.partial(jax.jit, static_argnums=(0, 1))  # one program: output and gradients
    def both(impl, window, *args):
        return attention(impl, window, *args), jax.grad(loss, argnums=(2, 3, 4))(impl, window, *args)
    for window in (None, 9):
        want = attention("xla", window, q, k, v, jnp.asarray(pos))
        want_grads = jax.grad(loss, argnums=(2, 3, 4))("xla", window, q, k, v, jnp.asarray(pos))
        for shape, impls in (((1, 1, 1, 8), ("ring", "allgather")), ((1, 2, 2, 2), ("ring", "ring-pallas"))):
            order = zigzag_order(T, shape[3]); back = np.argsort(order)
            args = (q[:, order], k[:, order], v[:, order], jnp.asarray(pos[:, order]))
            for impl in impls:
                with jax.set_mesh(make_mesh(shape)), nn.logical_axis_rules(rules):
                    got, grads = both(impl, window, *args)
                results["attention"].append(dict(
                    window=window, shape=shape, impl=impl,
                    error=float(jnp.abs(got[:, back] - want).max()),
                    grad_error=max(float(jnp.abs(g[:, back] - w).max()) for g, w in zip(grads, want_grads)),
                ))

    # The bytes the ring passes per device, counted in the traced program (every
    # ppermute's operands, times the length of each scan around it), for
    # lhc.lm.costs.ring_attention_costs to be compared with.
    def sent(jaxpr, repeat=1):
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ppermute":
                total += repeat * sum(x.aval.size * x.aval.dtype.itemsize for x in eqn.invars)
            times = repeat * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else repeat
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        total += sent(inner, times)
        return total
    with jax.set_mesh(make_mesh((1, 1, 1, 8))), nn.logical_axis_rules(rules):
        traced = jax.make_jaxpr(attention, static_argnums=(0, 1))("ring", None, q, k, v, jnp.asarray(pos))
    results["ring_bytes"] = sent(traced.jaxpr)

    # A Transformer (one sliding-window layer, one full, GQA): loss and gradients.
    base = dict(num_heads=4, num_kv_heads=2, vocab_size=96, mlp_dim=64, max_len=256,
                sliding_window=16, full_attention_layers=(1,))
    config = lm.LMConfig.tiny(**base)
    params = random_params(config, scale=0.5)
    tokens = rng.integers(0, 96, (2, T)); targets = rng.integers(0, 96, (2, T))
    positions = np.tile(np.arange(T), (2, 1))
    def nll(model, params, t, p, y):
        logits, _ = model.apply({"params": params}, t, p)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()
    want, want_grads = jax.jit(jax.value_and_grad(
        lambda pr: nll(lm.Transformer(config), pr, tokens, positions, targets)))(params)
    for shape, impl in (((2, 1, 1, 4), "ring"), ((1, 2, 2, 2), "allgather")):
        c = lm.LMConfig.tiny(**base, attention_impl=impl)
        model, mesh = lm.Transformer(c), make_mesh(shape)
        order = zigzag_order(T, shape[3])
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            sharded = jax.device_put(params, lm.param_shardings(c, mesh, rules))
            got, grads = jax.jit(jax.value_and_grad(lambda pr, t, p, y: nll(model, pr, t, p, y)))(
                sharded, tokens[:, order], positions[:, order], targets[:, order])
        results["model"].append(dict(
            shape=shape, impl=impl, loss=float(got), want=float(want),
            param_specs=sorted({str(x.sharding.spec) for x in jax.tree.leaves(sharded)}),
            grad_error=max(float(jnp.abs(a - b).max()) for a, b in
                           zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))),
        ))

    # Prefill in chunks and 32 greedy tokens, the cache's slots split over the axis.
    prompts = [rng.integers(0, 96, 100).tolist(), rng.integers(0, 96, 77).tolist()]
    single = lm.generate(lm.Transformer(config), params, prompts, max_new_tokens=32, prefill_chunk=64)
    c = lm.LMConfig.tiny(**base, attention_impl="ring")
    mesh = make_mesh((1, 1, 1, 8))
    out = lm.generate(
        lm.Transformer(c), jax.device_put(params, lm.param_shardings(c, mesh, rules)), prompts,
        max_new_tokens=32, prefill_chunk=64, mesh=mesh, rules=rules,
    )
    results["generate"] = dict(
        equal=bool((np.asarray(out.tokens) == np.asarray(single.tokens)).all()),
        distinct=int(len(np.unique(np.asarray(single.tokens)))),
        cache_specs=sorted({str(x.sharding.spec) for x in jax.tree.leaves(out.cache) if x.ndim >= 3}),
    )
    # Models whose memory or state runs along the tokens refuse the axis, by name.
    from lhc.gca import GCA, GCAConfig
    from lhc.recurrent import Mamba2Config, Mamba2LM
    results["refused"] = []
    for model in (GCA(GCAConfig.tiny()), Mamba2LM(Mamba2Config(vocab_size=64))):
        t = jnp.zeros((1, 64), jnp.int32)
        try:
            with jax.set_mesh(make_mesh((1, 1, 1, 8))), nn.logical_axis_rules(rules):
                model.init(jax.random.key(0), t, jnp.broadcast_to(jnp.arange(64), (1, 64)))
            results["refused"].append(None)
        except ValueError as error:
            results["refused"].append(str(error))
    print("RESULT " + json.dumps(results))
    """
)


@pytest.mark.multidevice
@pytest.mark.slow
def test_sequence_parallel_attention_model_and_decoding_equal_one_device():
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        LHC_TESTS_SUPPORT=str(pathlib.Path(__file__).resolve().parents[1] / "support.py"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT ") :])
    assert len(results["attention"]) == 8
    for r in results["attention"]:
        assert r["error"] < 1e-5 and r["grad_error"] < 1e-4, r
    # Each device passes on its keys, values (2 rows x 8 tokens x 2 heads x 8, float32)
    # and int32 positions 7 times: the traced program and the cost model agree.
    config = lm.LMConfig.tiny(num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1)
    costs = ring_attention_costs(config, 64, 8, batch_size=2)
    assert results["ring_bytes"] == costs["bytes_sent"] == 7 * 2 * 8 * (2 * 2 * 8 * 4 + 4)
    for r in results["model"]:
        assert abs(r["loss"] - r["want"]) < 1e-5 and r["grad_error"] < 1e-5, r
        # The weights are split over the sequence devices too (with fsdp where it is).
        assert any("'sequence'" in spec for spec in r["param_specs"]), r["param_specs"]
    generate = results["generate"]
    assert generate["equal"] and generate["distinct"] > 10, generate
    # Every layer's cache keeps its slots split over the sequence axis.
    assert generate["cache_specs"] and all("'sequence'" in s for s in generate["cache_specs"])
    gca, mamba = results["refused"]
    assert gca.startswith("GCA does not split a sequence over devices"), gca
    assert mamba.startswith("Mamba2LM does not split") and "{'sequence': 8}" in mamba, mamba


def test_zigzag_order_gives_every_shard_the_same_causal_work():
    for length, shards in ((16, 2), (64, 8), (96, 4)):
        order = parallel.zigzag_order(length, shards)
        assert sorted(order) == list(range(length))
        # Visible (query, key) pairs under a causal mask, per shard, counted directly.
        work = [
            sum(q + 1 for q in part) for part in np.split(np.asarray(order), shards)
        ]  # a query at position q sees q + 1 keys
        assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="multiple of 2 \\* shards = 8, got 12"):
        parallel.zigzag_order(12, 4)


def test_three_axis_mesh_shapes_and_sequence_rules():
    assert parallel.resolve_mesh_shape((2, 1, 4), 8) == (2, 1, 4, 1)
    assert parallel.resolve_mesh_shape((1, 1, 1, -1), 8) == (1, 1, 1, 8)
    rules = dict(parallel.rules_from_config({"mesh_shape": (1, 2, 1, 4)}))
    assert rules["act_len"] == "sequence" and rules["cache_len"] == "sequence"
    assert rules["embed"] == ("fsdp", "sequence")
    assert dict(parallel.rules_from_config({"mesh_shape": (2, 1, 4)}))["act_len"] is None


def test_ring_attention_gradients_inside_a_layer_scan_keep_no_score_blocks():
    """On one device (no ring), ``impl="ring"`` equals the XLA attention in value and
    gradients (windowed, GQA, a padded row, keys in 512-blocks), also as the body of a
    scan over layers; differentiating that scan keeps no per-block scores or masks: the
    compiled step's temporaries stay under half of one layer's full score matrix (0.21
    of it; 2.8 times it before the masks' positions went through an optimization
    barrier, JAX computing every block's mask ahead of the layers)."""
    import jax
    import jax.numpy as jnp

    from lhc.nn.attention_ops import dot_product_attention

    rng = np.random.default_rng(0)
    batch, length, heads, kv_heads, dim = 2, 1100, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    positions = np.tile(np.arange(length), (batch, 1))
    positions[1, :5] = -1

    def loss(impl, window, q, k, v, positions):
        def layer(x, _):
            return x + dot_product_attention(
                x, k, v, positions, positions, impl=impl, window=window
            ), None

        return (jax.lax.scan(layer, q, None, length=2)[0] ** 2).sum()

    with jax.default_matmul_precision("highest"):
        for window in (None, 300):
            args = (q, k, v, jnp.asarray(positions))
            want = jax.value_and_grad(loss, argnums=(2, 3, 4))("xla", window, *args)
            got = jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4)), static_argnums=(0, 1))(
                "ring", window, *args
            )
            np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
            for a, b in zip(got[1], want[1]):
                np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.abs(b).max()))

    length = 8192
    shapes = [
        jax.ShapeDtypeStruct((1, length, n, 16), jnp.float32) for n in (heads, kv_heads, kv_heads)
    ]
    step = jax.jit(jax.grad(loss, argnums=(2, 3, 4)), static_argnums=(0, 1))
    compiled = step.lower("ring", None, *shapes, jnp.arange(length)[None]).compile()
    scores = length * length * heads * 4  # one layer's float32 [heads, t, s]
    assert compiled.memory_analysis().temp_size_in_bytes < scores / 2


def test_ring_attention_compiles_the_flash_kernels_for_a_tpu_slice():
    """For a TPU slice (v5e 2x2, the sequence split 4 ways, compiled ahead of time on
    this CPU host), each ring step's attention and its backward pass are the Mosaic
    flash kernels, not XLA."""
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    import re

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from lhc.nn.attention_ops import dot_product_attention

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (1, 1, 1, 4), ("data", "fsdp", "tensor", "sequence"))
    rules = parallel.sequence_parallel_rules()
    split = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16, sharding=split)
    kv = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16, sharding=split)
    pos = jax.ShapeDtypeStruct((1, 2048), jnp.int32, sharding=split)

    def loss(q, k, v, p):
        out = dot_product_attention(q, k, v, p, p, impl="ring")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, pos)
    names = set(re.findall(r'kernel_name = "(\w+)"', lowered.as_text()))
    assert names == {"flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv"}
    compiled = lowered.compile()  # Mosaic compiles the kernels for v5e here
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    assert "collective-permute" in compiled.as_text()
