"""Generation (plain and speculative) with parameters and cache sharded over 8 host devices
equals one device."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, os, runpy, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import jax.numpy as jnp
    import numpy as np
    from lhc import lm
    from lhc.parallel.mesh import LOGICAL_AXIS_RULES, make_mesh, sharded_init
    # tests/support.py's random_params, by path: this script runs outside pytest.
    random_params = runpy.run_path(os.environ["LHC_TESTS_SUPPORT"])["random_params"]

    assert jax.device_count() == 8
    # Caches of models that loop over layers keep a tuple of per-layer arrays.
    first_layer = lambda cache: cache.keys[0] if isinstance(cache.keys, tuple) else cache.keys
    layers_of = lambda cache: cache.shape[0]
    mesh = make_mesh((2, 1, 4))  # data=2, fsdp=1, tensor=4
    results = {}
    for scan_layers in (False, True):
        config = lm.LMConfig.tiny(
            num_heads=8, num_kv_heads=4, vocab_size=128, mlp_dim=64, scan_layers=scan_layers
        )
        params = random_params(config, scale=0.5)
        rng = np.random.default_rng(0)
        model = lm.Transformer(config)
        prompts = [[5, 9, 1, 33, 2, 7], [12], [40, 41, 42], [7, 7, 100, 3]]
        sampling = lm.SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
        key = jax.random.key(1)
        single = lm.generate(model, params, prompts, max_new_tokens=12)

        shardings = lm.param_shardings(config, mesh, LOGICAL_AXIS_RULES)
        sharded_params = jax.device_put(params, shardings)
        out = lm.generate(model, sharded_params, prompts, max_new_tokens=12, mesh=mesh)
        if not scan_layers:
            # Long-context decoding: the cache's slots split over data=8 (flash decoding
            # across devices) give the same tokens; batch and heads are replicated.
            from lhc.parallel import long_context_decode_rules

            sequence_mesh = make_mesh((8, 1, 1))
            long = lm.generate(
                model, params, prompts, max_new_tokens=12, mesh=sequence_mesh,
                rules=long_context_decode_rules(),
            )
            results["long_context"] = dict(
                tokens_equal=bool((np.asarray(long.tokens) == np.asarray(single.tokens)).all()),
                cache_shape=list(long.cache.shape),
                cache_shard_shape=[layers_of(long.cache)]
                + list(long.cache.keys[0].addressable_shards[0].data.shape),
            )
        sampled_equal = speculative_equal = True
        if scan_layers:  # speculative decoding with a perturbed draft, sharded alike
            draft_params = jax.tree.map(
                lambda x: x + jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), params
            )
            speculative = lm.speculative_generate(
                model, sharded_params, model, jax.device_put(draft_params, shardings), prompts,
                max_new_tokens=12, num_draft=3, mesh=mesh,
            )
            speculative_equal = bool((np.asarray(speculative.tokens) == np.asarray(single.tokens)).all())
        if scan_layers:  # sampling once is enough; each generate call compiles anew
            single_sampled = lm.generate(
                model, params, prompts, max_new_tokens=12, sampling=sampling, rng=key
            )
            sampled = lm.generate(
                model, sharded_params, prompts, max_new_tokens=12, sampling=sampling, rng=key,
                mesh=mesh,
            )
            sampled_equal = bool((np.asarray(sampled.tokens) == np.asarray(single_sampled.tokens)).all())
        layer = sharded_params["layers"] if scan_layers else sharded_params["layers_0"]
        tokens = jnp.zeros((1, 1), jnp.int32)
        initialised, _ = sharded_init(
            lambda r: model.init(r, tokens, tokens)["params"], mesh, LOGICAL_AXIS_RULES, key
        )
        checkpoint = tempfile.mkdtemp()
        lm.hf.save(config, params, checkpoint)
        _, loaded = lm.hf.load(checkpoint, mesh=mesh, scan_layers=scan_layers)
        loaded_query = (loaded["layers"] if scan_layers else loaded["layers_0"])["attention"]["query"]["kernel"]
        loaded_equal = all(
            bool((np.asarray(a) == np.asarray(b)).all())
            for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params))
        )
        results[str(scan_layers)] = dict(
            loaded_equal=loaded_equal,
            loaded_query_spec=str(loaded_query.sharding.spec),
            tokens_equal=bool((np.asarray(out.tokens) == np.asarray(single.tokens)).all()),
            sampled_equal=sampled_equal,
            speculative_equal=speculative_equal,
            log_prob_diff=float(np.abs(np.asarray(out.log_probs) - np.asarray(single.log_probs)).max()),
            distinct_tokens=int(len(np.unique(np.asarray(single.tokens)))),
            query_spec=str(layer["attention"]["query"]["kernel"].sharding.spec),
            query_shard_shape=list(layer["attention"]["query"]["kernel"].addressable_shards[0].data.shape),
            cache_spec=str(first_layer(out.cache).sharding.spec),
            cache_shard_shape=[layers_of(out.cache)]
            + list(first_layer(out.cache).addressable_shards[0].data.shape)[-4:],
            cache_shape=list(out.cache.shape),
            init_mlp_spec=str((initialised["layers"] if scan_layers else initialised["layers_0"])["mlp"]["gate"]["kernel"].sharding.spec),
        )
    print("RESULT " + json.dumps(results))
    """
)


@pytest.mark.multidevice
@pytest.mark.slow
def test_sharded_generation_equals_single_device():
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
    long_context = results.pop("long_context")
    assert long_context["tokens_equal"], long_context
    layers, batch, kv_heads, slots, head_dim = long_context["cache_shape"]
    assert long_context["cache_shard_shape"] == [layers, batch, kv_heads, slots // 8, head_dim]
    for scan_layers, r in results.items():
        assert r["tokens_equal"], (scan_layers, r)
        assert r["loaded_equal"] and r["loaded_query_spec"] == r["query_spec"], r
        assert r["sampled_equal"], (scan_layers, r)
        assert r["speculative_equal"], (scan_layers, r)
        assert r["log_prob_diff"] < 1e-4, (scan_layers, r)
        assert r["distinct_tokens"] > 4, r  # a non-degenerate sequence was compared
        # Heads are split over tensor=4; the cache over data=2 (batch) and tensor=4 (heads).
        assert "tensor" in r["query_spec"] and "tensor" in r["cache_spec"], r
        layers, batch, kv_heads, slots, head_dim = r["cache_shape"]
        assert r["cache_shard_shape"] == [layers, batch // 2, kv_heads // 4, slots, head_dim], r
        assert "tensor" in r["init_mlp_spec"], r
    assert results["False"]["query_shard_shape"] == [32, 2, 8]
    assert results["True"]["query_shard_shape"] == [2, 32, 2, 8]
