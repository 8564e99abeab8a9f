"""The Transformer against a loop-by-loop numpy reference, and its cache protocol.

Parameters are random with norm scales near one (``norms=0.2``) and non-zero biases,
where init leaves them 1 and 0."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm

from ..support import random_params

LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


@functools.partial(jax.jit, static_argnums=0)
def _forward(config, params, tokens, positions, cache=None):
    """Jitted protocol call; one compile per config and shape keeps the tests fast."""
    return lm.Transformer(config).apply({"params": params}, tokens, positions, cache)


def _tokens(config, batch, length, seed=1):
    return jnp.asarray(
        np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length)), jnp.int32
    )


def _positions(batch, length):
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


CONFIGS = {
    "gqa": lm.LMConfig.tiny(),
    "mha_tied_bias": lm.LMConfig.tiny(num_kv_heads=4, tie_embeddings=True, qkv_bias=True),
    # An array per layer, run as one scanned block through lax.switch.
    "bias_switched": lm.LMConfig.tiny(qkv_bias=True, switch_layers=True),
    "mqa_llama3_scan": lm.LMConfig.tiny(
        num_kv_heads=1, rope_scaling=LLAMA3_SCALING, scan_layers=True
    ),
    # The nanoGPT block of PENCIL: LayerNorm without bias, GELU MLP 4D wide, tied.
    "gpt_layernorm_gelu": lm.LMConfig.tiny(
        num_kv_heads=4, norm_type="layernorm", mlp_type="gelu", mlp_dim=128, tie_embeddings=True
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_forward_matches_numpy_reference(name, numpy_lm):
    config = CONFIGS[name]
    params = random_params(config, norms=0.2)
    length = 24  # beyond original_max_position_embeddings of the Llama-3 scaling
    tokens = _tokens(config, 2, length)
    logits, cache = _forward(config, params, tokens, _positions(2, length))
    assert cache is None and logits.dtype == jnp.float32 and logits.shape == (2, length, 128)
    for b in range(2):
        expected = numpy_lm.forward(config, params, np.asarray(tokens[b]))
        np.testing.assert_allclose(logits[b], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gqa", "mqa_llama3_scan", "bias_switched"])
def test_incremental_decoding_equals_full_forward(name):
    config = CONFIGS[name]
    params = random_params(config, norms=0.2)
    batch, length = 2, 14
    tokens, positions = _tokens(config, batch, length), _positions(batch, length)
    full, _ = _forward(config, params, tokens, positions)

    cache = lm.init_cache(config, batch, 20)
    pieces = []
    # prefill 5, then one token at a time (4 steps), then chunks of 3 and 2
    bounds = [0, 5, 6, 7, 8, 9, 12, 14]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        logits, cache = _forward(
            config, params, tokens[:, start:stop], positions[:, start:stop], cache
        )
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [length, length])
    np.testing.assert_array_equal(cache.positions[:, :length], positions)
    assert (np.asarray(cache.positions[:, length:]) == -1).all()


def test_left_padding_does_not_change_results(numpy_lm):
    config = CONFIGS["gqa"]
    params = random_params(config, norms=0.2)
    lengths = [7, 3, 5]
    width = max(lengths)
    sequences = [np.asarray(_tokens(config, 1, n, seed=10 + n))[0] for n in lengths]
    tokens = np.zeros((3, width), np.int32)
    positions = np.full((3, width), -1, np.int32)
    for b, seq in enumerate(sequences):
        tokens[b, width - len(seq) :] = seq
        positions[b, width - len(seq) :] = np.arange(len(seq))
    logits, _ = _forward(config, params, jnp.asarray(tokens), jnp.asarray(positions))
    # Same tokens through a cache, then a continuation of 3 tokens per sequence.
    cache = lm.init_cache(config, 3, width + 3)
    prefill, cache = _forward(config, params, jnp.asarray(tokens), jnp.asarray(positions), cache)
    more = np.asarray(_tokens(config, 3, 3, seed=5))
    more_positions = np.asarray(lengths)[:, None] + np.arange(3)
    cont, cache = _forward(config, params, jnp.asarray(more), jnp.asarray(more_positions), cache)
    for b, seq in enumerate(sequences):
        expected = numpy_lm.forward(config, params, np.concatenate([seq, more[b]]))
        np.testing.assert_allclose(logits[b, width - len(seq) :], expected[: len(seq)], atol=1e-4)
        np.testing.assert_allclose(prefill[b, width - len(seq) :], expected[: len(seq)], atol=1e-4)
        np.testing.assert_allclose(cont[b], expected[len(seq) :], atol=1e-4)
        assert np.isfinite(np.asarray(logits[b])).all()  # padding rows stay finite too


def test_truncate_then_reappend_equals_full_forward(numpy_lm):
    config = CONFIGS["mha_tied_bias"]
    params = random_params(config, norms=0.2)
    batch = 2
    tokens = _tokens(config, batch, 10)
    cache = lm.init_cache(config, batch, 16)
    _, cache = _forward(config, params, tokens, _positions(batch, 10), cache)
    # Roll back each sequence to its own length (speculative rejection), then append
    # the same number of new tokens to both.
    keep = np.array([4, 7])
    np.testing.assert_array_equal(cache.next_positions(), [10, 10])
    cache = cache.truncate(jnp.asarray(keep))
    np.testing.assert_array_equal(cache.lengths, keep)
    np.testing.assert_array_equal(cache.next_positions(), keep)
    assert (np.asarray(cache.positions)[0, 4:] == -1).all()
    new_tokens = _tokens(config, batch, 3, seed=7)
    new_positions = jnp.asarray(keep[:, None] + np.arange(3), jnp.int32)
    logits, cache = _forward(config, params, new_tokens, new_positions, cache)
    np.testing.assert_array_equal(cache.lengths, keep + 3)
    for b in range(batch):
        sequence = np.concatenate([np.asarray(tokens[b, : keep[b]]), np.asarray(new_tokens[b])])
        expected = numpy_lm.forward(config, params, sequence)
        np.testing.assert_allclose(logits[b], expected[keep[b] :], atol=1e-4)


def test_truncate_validation_and_clip_under_jit():
    config = CONFIGS["gqa"]
    cache = lm.init_cache(config, 2, 8).replace(lengths=jnp.array([3, 5], jnp.int32))
    with pytest.raises(ValueError, match="new_lengths"):
        cache.truncate(jnp.array([4, 5]))
    with pytest.raises(ValueError, match="new_lengths"):
        cache.truncate(-1)
    clipped = jax.jit(lambda c, n: c.truncate(n))(cache, jnp.array([4, 2]))
    np.testing.assert_array_equal(clipped.lengths, [3, 2])
    np.testing.assert_array_equal(cache.truncate(0).lengths, [0, 0])


def test_scan_and_loop_layouts_give_same_logits():
    config = CONFIGS["gqa"]
    params = random_params(config, norms=0.2)
    tokens, positions = _tokens(config, 2, 24), _positions(2, 24)
    loop_logits, _ = _forward(config, params, tokens, positions)
    stacked = lm.stack_layer_params(params, config.num_layers)
    assert stacked["layers"]["attention"]["query"]["kernel"].shape == (2, 32, 4, 8)
    scan_config = config.replace(scan_layers=True)
    scan_logits, _ = _forward(scan_config, stacked, tokens, positions)
    np.testing.assert_allclose(scan_logits, loop_logits, atol=1e-5)
    # The stacked layout is the one scan_layers=True initialises, and converts back.
    fresh = nn.meta.unbox(lm.abstract_params(scan_config))
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, stacked)
    back = lm.unstack_layer_params(stacked)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, params))


@pytest.mark.parametrize("scan_layers,policies", [(True, ("minimal",)), (False, ("full",))])
def test_remat_policies_give_same_gradients(scan_layers, policies):
    config = CONFIGS["gqa"].replace(scan_layers=scan_layers)
    params = random_params(config, norms=0.2)
    tokens, positions = _tokens(config, 2, 24), _positions(2, 24)

    def loss_fn(params, policy):
        model = lm.Transformer(config.replace(remat_policy=policy))
        logits, _ = model.apply({"params": params}, tokens[:, :-1], positions[:, :-1])
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()

    reference = jax.jit(jax.grad(loss_fn), static_argnums=1)(params, "none")
    for policy in policies:
        grads = jax.jit(jax.grad(loss_fn), static_argnums=1)(params, policy)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, reference)


def test_parameters_carry_logical_axes():
    config = CONFIGS["mha_tied_bias"].replace(scan_layers=True)
    abstract = lm.abstract_params(config)
    names = jax.tree.leaves(
        jax.tree.map(lambda p: p.names, abstract, is_leaf=lambda p: isinstance(p, nn.Partitioned)),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    assert all(
        isinstance(leaf, nn.Partitioned)
        for leaf in jax.tree.leaves(abstract, is_leaf=lambda p: isinstance(p, nn.Partitioned))
    )
    assert ("layers", "embed", "heads", "kv") in names
    assert ("vocab", "embed") in names
    assert ("layers", "mlp", "embed") in names


def test_intermediates_hold_residual_stream_per_layer():
    config = CONFIGS["gqa"]
    params = random_params(config, norms=0.2)
    tokens, positions = _tokens(config, 1, 5), _positions(1, 5)
    apply = jax.jit(
        lambda p, t, q: lm.Transformer(config).apply({"params": p}, t, q, mutable=["intermediates"])
    )
    (_, _), state = apply(params, tokens, positions)
    residuals = [state["intermediates"][f"layers_{i}"]["residual"][0] for i in range(2)]
    assert residuals[0].shape == (1, 5, config.embed_dim)
    assert not np.allclose(residuals[0], residuals[1])


def test_bfloat16_compute_close_to_float32():
    config = CONFIGS["gqa"]
    params = random_params(config, norms=0.2)
    tokens, positions = _tokens(config, 2, 24), _positions(2, 24)
    logits32, _ = _forward(config, params, tokens, positions)
    config16 = config.replace(dtype="bfloat16", param_dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits16, _ = _forward(config16, params16, tokens, positions)
    assert logits16.dtype == jnp.float32
    assert float(jnp.abs(logits16 - logits32).max()) < 0.1 * float(jnp.abs(logits32).max())
    cache = lm.init_cache(config16, 2, 24)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(cache.keys))
    _, cache = _forward(config16, params16, tokens, positions, cache)
    assert all(np.isfinite(np.asarray(k, np.float32)).all() for k in jax.tree.leaves(cache.keys))


def test_input_validation_errors():
    config = CONFIGS["gqa"].replace(max_len=16)
    params = random_params(config, norms=0.2)
    model = lm.Transformer(config)
    apply = lambda *args: model.apply({"params": params}, *args)
    with pytest.raises(ValueError, match="exceeds the model's max_len 16"):
        apply(_tokens(config, 1, 17), _positions(1, 17))
    with pytest.raises(ValueError, match="must both be int"):
        apply(_tokens(config, 1, 4), _positions(1, 5))
    with pytest.raises(ValueError, match="vocab_size"):
        apply(jnp.full((1, 2), 128, jnp.int32), _positions(1, 2))
    with pytest.raises(ValueError, match="below max_len"):
        apply(_tokens(config, 1, 2), jnp.array([[15, 16]], jnp.int32))
    with pytest.raises(ValueError, match="max_len"):
        model.init_cache(1, 17)
    cache = model.init_cache(1, 8).replace(lengths=jnp.array([6], jnp.int32))
    with pytest.raises(ValueError, match="exceeds the cache capacity 8"):
        apply(_tokens(config, 1, 3), jnp.array([[6, 7, 8]], jnp.int32), cache)
    with pytest.raises(ValueError, match="capacity"):
        apply(_tokens(config, 1, 9), _positions(1, 9), model.init_cache(1, 8))
    with pytest.raises(ValueError, match="the cache holds 1 sequences, the call has 2"):
        apply(_tokens(config, 2, 2), _positions(2, 2), cache)
    other = lm.init_cache(config.replace(num_kv_heads=4), 1, 8)
    with pytest.raises(ValueError, match=r"\[L, B, K, S, H\]"):
        apply(_tokens(config, 1, 2), _positions(1, 2), other)


def test_cache_overflow_under_jit_gives_nan_logits_for_that_sequence():
    config = CONFIGS["gqa"].replace(max_len=16)
    params = random_params(config, norms=0.2)
    model = lm.Transformer(config)
    apply = jax.jit(lambda *args: model.apply({"params": params}, *args))
    # sequence 0 has room for 3 more tokens, sequence 1 has 2
    cache = model.init_cache(2, 8).replace(lengths=jnp.array([5, 6], jnp.int32))
    positions = jnp.array([[5, 6, 7], [6, 7, 8]], jnp.int32)
    logits, _ = apply(_tokens(config, 2, 3), positions, cache)
    assert np.isfinite(np.asarray(logits[0])).all()
    assert np.isnan(np.asarray(logits[1])).all()


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        lm.LMConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        lm.LMConfig.tiny(head_dim=7)
    with pytest.raises(ValueError, match="remat_policy"):
        lm.LMConfig.tiny(remat_policy="sometimes")
    with pytest.raises(ValueError, match="dtype"):
        lm.LMConfig.tiny(dtype="int8")
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        lm.LMConfig.tiny(vocab_size=0)
    with pytest.raises(ValueError, match="norm_type must be one of"):
        lm.LMConfig.tiny(norm_type="batchnorm")
    with pytest.raises(ValueError, match="mlp_type must be one of"):
        lm.LMConfig.tiny(mlp_type="relu")
    with pytest.raises(ValueError, match="dropout_rate must lie in"):
        lm.LMConfig.tiny(dropout_rate=1.0)
    with pytest.raises(ValueError, match="unknown LMConfig keys"):
        lm.LMConfig.from_dict({**lm.LMConfig.tiny().to_dict(), "num_experts": 8})
    with pytest.raises(ValueError, match="unknown LM preset"):
        lm.get_preset("gpt-5")
    config = lm.LMConfig.tiny(rope_scaling=LLAMA3_SCALING, dtype=jnp.bfloat16)
    assert config.dtype == "bfloat16"
    assert hash(config) == hash(lm.LMConfig.from_dict(config.to_dict()))
    assert lm.LMConfig.from_dict(config.to_dict()) == config
    assert dataclasses.replace(config, num_layers=3).num_layers == 3


@pytest.mark.parametrize("scan_layers", [False, True])
def test_dropout_only_with_a_train_rng(scan_layers):
    config = CONFIGS["gpt_layernorm_gelu"].replace(scan_layers=scan_layers)
    params = random_params(config, norms=0.2)
    tokens, positions = _tokens(config, 2, 16), _positions(2, 16)
    plain, _ = _forward(config, params, tokens, positions)
    dropped = config.replace(dropout_rate=0.5)
    model = lm.Transformer(dropped)
    apply = jax.jit(lambda p, rngs: model.apply({"params": p}, tokens, positions, rngs=rngs)[0])
    np.testing.assert_allclose(apply(params, None), plain, atol=1e-6)  # evaluation: off
    first = apply(params, {"train": jax.random.key(1)})
    again = apply(params, {"train": jax.random.key(1)})
    other = apply(params, {"train": jax.random.key(2)})
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - plain).max() > 0.1 and np.abs(first - other).max() > 0.1


def _count_formula(c):
    attention = c.embed_dim * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    if c.qkv_bias:
        attention += c.head_dim * (c.num_heads + 2 * c.num_kv_heads)
    per_layer = attention + 3 * c.embed_dim * c.mlp_dim + 2 * c.embed_dim
    heads = 1 if c.tie_embeddings else 2
    return heads * c.vocab_size * c.embed_dim + c.num_layers * per_layer + c.embed_dim


@pytest.mark.parametrize("name", sorted(lm.PRESETS))
def test_preset_parameter_counts(name):
    config = lm.get_preset(name)
    assert lm.count_params(config) == _count_formula(config)


def test_released_model_sizes():
    # Published totals: Llama-3.1-8B 8,030,261,248; Qwen2.5-7B 7.62B; Qwen2.5-0.5B 0.49B.
    assert lm.count_params(lm.get_preset("llama3.1-8b")) == 8_030_261_248
    assert round(lm.count_params(lm.get_preset("qwen2.5-7b")) / 1e9, 2) == 7.62
    assert round(lm.count_params(lm.get_preset("qwen2.5-0.5b")) / 1e9, 2) == 0.49
    assert 90e6 < lm.count_params(lm.LMConfig.lm_100m()) < 130e6


def test_init_cache_on_unbound_module_and_logical_axes():
    config = CONFIGS["gqa"]
    cache = lm.Transformer(config).init_cache(3, 10)
    assert cache.shape == (2, 3, 2, 10, 8)  # [L, B, K, S, H]
    # A model that loops over layers keeps one buffer per layer, a scanned one stacks.
    assert isinstance(cache.keys, tuple) and cache.keys[0].shape == (3, 2, 10, 8)
    stacked = lm.Transformer(config.replace(scan_layers=True)).init_cache(3, 10)
    assert stacked.keys.shape == (2, 3, 2, 10, 8)
    assert cache.capacity == 10 and cache.batch_size == 3 and cache.num_layers == 2
    np.testing.assert_array_equal(cache.lengths, [0, 0, 0])
    assert (np.asarray(cache.positions) == -1).all()
    axes = stacked.logical_axes()
    assert tuple(axes.keys) == (None, "cache_batch", "cache_kv_heads", "cache_len", "cache_kv")
    assert tuple(cache.logical_axes().keys[1]) == (
        "cache_batch",
        "cache_kv_heads",
        "cache_len",
        "cache_kv",
    )
    for c in (cache, stacked):
        assert jax.tree.structure(
            c.logical_axes(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        ) == jax.tree.structure(jax.tree.map(lambda x: 0, c))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_out_in_kernel_layout_gives_the_same_model(scan_layers, numpy_lm):
    """Kernels stored outputs-first (the layout of HF checkpoints) and multiplied
    kernel-first compute the same logits; convert_kernel_layout moves between layouts."""
    config = CONFIGS["mha_tied_bias"].replace(scan_layers=scan_layers, tie_embeddings=False)
    params = random_params(config, norms=0.2)
    out_in = config.replace(kernel_layout="out_in")
    converted = lm.convert_kernel_layout(params, config, "out_in")
    fresh = nn.meta.unbox(lm.abstract_params(out_in))
    assert jax.tree.map(jnp.shape, converted) == jax.tree.map(jnp.shape, fresh)
    layer = converted["layers"] if scan_layers else converted["layers_0"]
    query = layer["attention"]["query"]["kernel"]
    assert query.shape[-3:] == (4, 8, 32)  # [N, H, D]
    names = jax.tree.map(
        lambda p: p.names,
        lm.abstract_params(out_in),
        is_leaf=lambda p: isinstance(p, nn.Partitioned),
    )
    layer_names = names["layers"] if scan_layers else names["layers_0"]
    assert layer_names["attention"]["out"]["kernel"][-3:] == ("embed", "heads", "kv")
    tokens, positions = _tokens(config, 2, 12), _positions(2, 12)
    want, _ = _forward(config, params, tokens, positions)
    got, _ = _forward(out_in, converted, tokens, positions)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(
        got[0], numpy_lm.forward(config, params, np.asarray(tokens[0])), atol=1e-4
    )
    # Cached decoding in the out_in layout.
    cache = lm.init_cache(out_in, 2, 12)
    first, cache = _forward(out_in, converted, tokens[:, :7], positions[:, :7], cache)
    rest, _ = _forward(out_in, converted, tokens[:, 7:], positions[:, 7:], cache)
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), want, atol=1e-5)
    back = lm.convert_kernel_layout(converted, out_in, "in_out")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), back, params)
    with pytest.raises(ValueError, match="kernel_layout must be one of"):
        lm.LMConfig.tiny(kernel_layout="columns")
