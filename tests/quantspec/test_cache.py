"""The QuantSpec cache through an lhc.lm.Transformer: a step equals attention over a
plain KV cache holding the dequantized prefix (8-bit target, 4-bit draft); one call of
several tokens reads as token-by-token calls; after flushes and rewinds the store holds
what quantizing the kept keys from scratch gives; bytes per token; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.quantspec import cache as quantspec_cache
from lhc.quantspec import dequantize, quantize
from lhc.quantspec.cache import cutoff, init_cache, kv_bytes_per_token

G = 4
CONFIG = lm.LMConfig(
    vocab_size=64,
    num_layers=1,
    embed_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    max_len=128,
)
MODEL = lm.Transformer(CONFIG)


@pytest.fixture(scope="module")
def params():
    one = jnp.zeros((1, 1), jnp.int32)
    return MODEL.init(jax.random.key(0), one, one)["params"]


def tokens(n, seed=0, batch=2):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (batch, n)), jnp.int32)


def arange(start, stop, batch=2):
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (batch, stop - start))


_apply = jax.jit(lambda p, t, pos, c: MODEL.apply({"params": p}, t, pos, c))


def feed(params, cache, toks, start, chunk):
    outs = []
    for s in range(0, toks.shape[1], chunk):
        part = toks[:, s : s + chunk]
        logits, cache = _apply(params, part, arange(start + s, start + s + part.shape[1]), cache)
        outs.append(logits)
    return jnp.concatenate(outs, axis=1), cache


def full_precision_kv(params, toks):
    """Layer 0's keys and values [B, K, S, H] of ``toks`` from a plain KV cache."""
    cache = lm.init_cache(CONFIG, toks.shape[0], 64)
    positions = arange(0, toks.shape[1], batch=toks.shape[0])
    _, cache = MODEL.apply({"params": params}, toks, positions, cache)
    n = toks.shape[1]
    return cache.keys[0][:, :, :n], cache.values[0][:, :, :n]


@pytest.fixture(params=[None, 8], ids=["one_block", "blocks_of_8"])
def store_block(request, monkeypatch):
    """The XLA path's store block: the default (one block here) or 8 slots, so that the
    16 quantized slots a step reads take two steps of the loop."""
    if request.param is not None:
        monkeypatch.setattr(quantspec_cache, "STORE_BLOCK", request.param)
        jax.clear_caches()  # the jitted calls above hold the default's programs
    yield request.param
    if request.param is not None:
        monkeypatch.undo()
        jax.clear_caches()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_step_attends_to_the_dequantized_prefix_and_the_recent_tokens(params, bits, store_block):
    n = 23  # the next query's slot: Q(23) = 16 slots read quantized, 7 at full precision
    prompt = tokens(n + 1)
    cache = init_cache(CONFIG, 2, 64, group_size=G, max_call=4)
    _, cache = feed(params, cache, prompt[:, :n], 0, 4)
    if bits == 4:
        cache = cache.draft()
    got, _ = _apply(params, prompt[:, n:], arange(n, n + 1), cache)
    # The reference: a plain KV cache whose first Q(n) keys and values are replaced by
    # their quantize -> dequantize round trip.
    keys, values = full_precision_kv(params, prompt[:, :n])
    q = int(cutoff(jnp.asarray(n), G))
    assert q == 16
    deq_k = dequantize(quantize(keys[:, :, :q], group_axis=2, group_size=G), bits=bits)
    deq_v = dequantize(quantize(values[:, :, :q], group_axis=3, group_size=G), bits=bits)
    ref = lm.init_cache(CONFIG, 2, 64)
    ref_keys = ref.keys[0].at[:, :, :q].set(deq_k).at[:, :, q:n].set(keys[:, :, q:])
    ref_values = ref.values[0].at[:, :, :q].set(deq_v).at[:, :, q:n].set(values[:, :, q:])
    ref = ref.replace(
        keys=(ref_keys,),
        values=(ref_values,),
        positions=ref.positions.at[:, :n].set(arange(0, n)),
        lengths=jnp.full((2,), n, jnp.int32),
    )
    want, _ = MODEL.apply({"params": params}, prompt[:, n:], arange(n, n + 1), ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    plain, _ = MODEL.apply({"params": params}, prompt, arange(0, n + 1))
    assert float(jnp.abs(got[:, 0] - plain[:, -1]).max()) > 1e-6  # quantization did act


def test_one_call_of_several_tokens_reads_like_calls_of_one(params):
    seq = tokens(30, seed=1)
    cache = init_cache(CONFIG, 2, 64, group_size=G, max_call=4)
    _, cache = feed(params, cache, seq[:, :14], 0, 4)
    together, _ = feed(params, cache, seq[:, 14:18], 14, 4)  # slots 14-17 cross Q's step at 16
    apart, _ = feed(params, cache, seq[:, 14:18], 14, 1)
    np.testing.assert_allclose(together, apart, rtol=2e-5, atol=2e-5)


def test_after_flushes_and_rewinds_the_store_is_quantizing_from_scratch(params):
    seq, other, more = tokens(40, seed=2), tokens(40, seed=3), tokens(8, seed=4)
    cache = init_cache(CONFIG, 2, 64, group_size=G, max_call=4)
    _, cache = feed(params, cache, seq[:, :17], 0, 4)
    _, cache = feed(params, cache, seq[:, 17:22], 17, 1)
    cache = cache.truncate(19)  # back 3 (into a quantized group), then other tokens
    _, cache = feed(params, cache, other[:, 19:24], 19, 4)
    lengths = np.array([21, 24])
    cache = cache.truncate(jnp.asarray(lengths))  # the rows rewind differently
    for s in range(0, 8, 4):  # and go on, flushing again
        start = jnp.asarray(lengths + s, jnp.int32)[:, None]
        positions = start + jnp.arange(4, dtype=jnp.int32)[None]
        _, cache = _apply(params, more[:, s : s + 4], positions, cache)
    assert np.asarray(cache.intact).all()
    for b, n in enumerate(lengths):
        kept = jnp.concatenate([seq[b, :19], other[b, 19:n], more[b]])[None]
        quantized = int(cache.quantized[b])
        assert quantized == int(cutoff(jnp.asarray(n + 7), G))  # the last query's cut
        keys, values = full_precision_kv(params, kept)
        qk = quantize(keys[:, :, :quantized], group_axis=2, group_size=G)
        qv = quantize(values[:, :, :quantized], group_axis=3, group_size=G)
        row = {name: np.asarray(x[0, b : b + 1]) for name, x in cache.store.items()}
        for name, want in (
            ("k_upper", qk.upper),
            ("k_lower", qk.lower),
            ("v_upper", qv.upper),
            ("v_lower", qv.lower),
            ("v_scale", qv.scale),
            ("v_min", qv.minimum),
        ):
            np.testing.assert_array_equal(row[name][:, :, :quantized], want, err_msg=name)
        for name, want in (("k_scale", qk.scale), ("k_min", qk.minimum)):
            np.testing.assert_array_equal(row[name][:, :, : quantized // G], want, err_msg=name)


def test_bytes_per_token_against_bfloat16():
    config = lm.LMConfig(
        vocab_size=8,
        num_layers=2,
        embed_dim=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        mlp_dim=8,
        max_len=512,
    )
    sizes = kv_bytes_per_token(init_cache(config, 1, 512, group_size=128))
    assert sizes["bf16"] == 2 * 2 * 2 * 128 * 2  # K and V, 2 layers, 2 heads, 128 channels
    assert sizes["bits8"] / sizes["bf16"] <= 0.55 and sizes["bits4"] / sizes["bf16"] <= 0.30
    # The traffic model's (1 + 4/G) E and (0.5 + 4/G) E bytes against 2 E.
    np.testing.assert_allclose(sizes["bits8"] / sizes["bf16"], (1 + 4 / 128) / 2)
    np.testing.assert_allclose(sizes["bits4"] / sizes["bf16"], (0.5 + 4 / 128) / 2)


def test_bad_input_is_a_clear_error(params):
    with pytest.raises(ValueError, match="group_size must be an int >= 2 dividing head_dim=8"):
        init_cache(CONFIG, 2, 64, group_size=3)
    cache = init_cache(CONFIG, 2, 64, group_size=G, max_call=4)
    with pytest.raises(ValueError, match="at most max_call=4 tokens per call, got 5"):
        MODEL.apply({"params": params}, tokens(5), arange(0, 5), cache)
    with pytest.raises(
        ValueError, match=r"max_call .* must be an int in \[1, group_size=4\], got 5"
    ):
        init_cache(CONFIG, 2, 64, group_size=G, max_call=5)
    _, cache = feed(params, cache, tokens(30), 0, 4)
    deep = cache.truncate(20)  # back 10 > max_call: keys the ring no longer holds
    assert not np.asarray(deep.intact).any()
    with pytest.raises(ValueError, match="truncated back by more than max_call=4"):
        MODEL.apply({"params": params}, tokens(1), arange(20, 21), deep)
    logits, _ = _apply(params, tokens(1), arange(20, 21), deep)
    assert np.isnan(np.asarray(logits)).all()


def test_the_pallas_kernel_path_equals_the_xla_path(params):
    # G = head_dim = 8: whole-head value groups, which the kernel needs.
    pallas_model = lm.Transformer(CONFIG.replace(attention_impl="pallas"))
    seq = tokens(30, seed=5)
    outs = {}
    for name, model in (("xla", MODEL), ("pallas", pallas_model)):
        apply = jax.jit(lambda p, t, pos, c, model=model: model.apply({"params": p}, t, pos, c))
        cache = init_cache(CONFIG, 2, 64, group_size=8, max_call=5)
        logits = []
        for s in range(0, 30, 5):
            out, cache = apply(params, seq[:, s : s + 5], arange(s, s + 5), cache)
            logits.append(out)
        draft, _ = apply(params, seq[:, :1], arange(30, 31), cache.draft())
        outs[name] = (jnp.concatenate(logits, axis=1), draft)
    np.testing.assert_allclose(outs["pallas"][0], outs["xla"][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(outs["pallas"][1], outs["xla"][1], rtol=2e-5, atol=2e-5)
