"""QuantSpec decoding: greedy self-speculation equals plain decoding on the 8-bit path
token for token across many buffer flushes; sampled self-speculation follows the
target's distribution (a chi-square test, with a draft far from the target); bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from lhc import lm, quantspec


def _model(vocab, seed, max_len=256):
    config = lm.LMConfig(
        vocab_size=vocab,
        num_layers=2,
        embed_dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_len=max_len,
    )
    model = lm.Transformer(config)
    one = jnp.zeros((1, 1), jnp.int32)
    params = model.init(jax.random.key(seed), one, one)["params"]
    unboxed = jax.tree.map(
        lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value")
    )
    return model, unboxed


def test_greedy_self_speculation_equals_plain_decoding_across_flushes():
    model, params = _model(64, 0)
    r = np.random.default_rng(0)
    prompts = [list(r.integers(0, 64, n)) for n in (13, 7, 20)]
    # G = 8: the buffer flushes a group every 8 tokens, 5 times in 40 new tokens.
    plain = quantspec.generate(
        model, params, prompts, max_new_tokens=40, group_size=8, stop_tokens=(7,)
    )
    settings = dict(gamma=4, max_new_tokens=40, group_size=8, stop_tokens=(7,))
    spec = quantspec.speculative_generate(model, params, prompts, weight_group_size=8, **settings)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    for row, n in enumerate(np.asarray(plain.lengths)):
        np.testing.assert_array_equal(spec.tokens[row, :n], plain.tokens[row, :n])
    rate = float(spec.acceptance_rate)
    assert 0 < rate < 1  # the 4-bit draft differs from the target, and mostly agrees
    assert int(spec.num_iterations) < 40
    # A draft that reads the cache at 8 bits with the target's weights is the target:
    # every draft is accepted (and the output is still plain decoding's).
    same = quantspec.speculative_generate(
        model, params, prompts, draft_params=params, draft_kv_bits=8, **settings
    )
    assert float(same.acceptance_rate) == 1.0
    for row, n in enumerate(np.asarray(plain.lengths)):
        np.testing.assert_array_equal(same.tokens[row, :n], plain.tokens[row, :n])


def test_scanned_layers_speculate_as_looped_ones():
    # One compiled block for every layer: the store is indexed by the traced layer and
    # the stacked MLP kernels are quantized layer by layer. The looped calls are those of
    # the test above (compiled once in a run).
    model, params = _model(64, 0)
    scanned = lm.Transformer(model.config.replace(scan_layers=True))
    stacked = lm.stack_layer_params(params, model.config.num_layers)
    looped_draft = quantspec.quantize_params(params, group_size=8)
    stacked_draft = quantspec.quantize_params(stacked, group_size=8)
    for name in ("gate", "up", "down"):
        for field in ("codes", "scale"):
            per_layer = [
                getattr(looped_draft[f"layers_{i}"]["mlp"][name]["kernel"], field)
                for i in range(model.config.num_layers)
            ]
            np.testing.assert_array_equal(
                getattr(stacked_draft["layers"]["mlp"][name]["kernel"], field), np.stack(per_layer)
            )
    r = np.random.default_rng(0)
    prompts = [list(r.integers(0, 64, n)) for n in (13, 7, 20)]
    kwargs = dict(max_new_tokens=40, group_size=8, stop_tokens=(7,))
    plain = quantspec.generate(model, params, prompts, **kwargs)
    looped = quantspec.speculative_generate(
        model, params, prompts, gamma=4, weight_group_size=8, **kwargs
    )
    spec = quantspec.speculative_generate(
        scanned, stacked, prompts, gamma=4, weight_group_size=8, **kwargs
    )
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    for row, n in enumerate(np.asarray(plain.lengths)):
        np.testing.assert_array_equal(spec.tokens[row, :n], plain.tokens[row, :n])
    assert int(spec.num_iterations) == int(looped.num_iterations)
    assert float(spec.acceptance_rate) == float(looped.acceptance_rate)


def _exact_two_token_distribution(model, params, prompt, group_size):
    """p(t1, t2) of the 8-bit target path after ``prompt``, by enumerating t1."""
    target = quantspec.quantspec_model(model, group_size=group_size)
    vocab = model.config.vocab_size
    cache = target.init_cache(vocab, 64)  # one row per t1
    for start in range(0, len(prompt), group_size):  # prefill in chunks of at most G
        chunk = jnp.asarray(prompt[start : start + group_size], jnp.int32)
        positions = jnp.arange(start, start + len(chunk), dtype=jnp.int32)
        logits, cache = target.apply(
            {"params": params}, jnp.tile(chunk, (vocab, 1)), jnp.tile(positions, (vocab, 1)), cache
        )
    p1 = np.asarray(jax.nn.softmax(logits[0, -1]), np.float64)
    nxt = jnp.arange(vocab, dtype=jnp.int32)[:, None]
    logits, _ = target.apply({"params": params}, nxt, jnp.full((vocab, 1), len(prompt)), cache)
    p2 = np.asarray(jax.nn.softmax(logits[:, 0]), np.float64)
    return p1[:, None] * p2


def _chi_square(tokens, joint):
    vocab = joint.shape[0]
    counts = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    expected = joint.reshape(-1) * len(tokens)
    big = expected >= 5  # pool the rare cells
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def test_sampled_self_speculation_follows_the_target_distribution():
    vocab, group = 8, 4
    model, params = _model(vocab, 1, max_len=64)
    _, other = _model(vocab, 2, max_len=64)  # a draft far from the target
    prompt = [1, 5, 2, 6, 3, 0, 4]
    joint = _exact_two_token_distribution(model, params, prompt, group)
    draft_joint = _exact_two_token_distribution(model, other, prompt, group)
    draft = quantspec.quantize_params(other, group_size=8)
    out = quantspec.speculative_generate(
        model,
        params,
        [prompt] * 4000,
        gamma=2,
        max_new_tokens=2,
        group_size=group,
        draft_params=draft,
        sampling=lm.SamplingParams(temperature=1.0),
        rng=jax.random.key(3),
    )
    tokens = np.asarray(out.tokens)[:, :2]
    assert 0.05 < float(out.acceptance_rate) < 0.95
    assert _chi_square(tokens, joint) > 1e-3
    # The test can tell: the same samples are far from the draft's own distribution.
    assert _chi_square(tokens, draft_joint) < 1e-6


def test_bad_input_is_a_clear_error():
    model, params = _model(64, 0)
    with pytest.raises(ValueError, match=r"gamma \+ 1 = 9 tokens .* headroom of group_size = 8"):
        quantspec.speculative_generate(
            model, params, [[1, 2]], gamma=8, max_new_tokens=4, group_size=8
        )
    with pytest.raises(ValueError, match="group_size must be an int >= 2 dividing head_dim=8"):
        quantspec.generate(model, params, [[1, 2]], max_new_tokens=4, group_size=16)
    with pytest.raises(ValueError, match="draft_kv_bits must be 4 or 8, got 2"):
        quantspec.speculative_generate(
            model, params, [[1, 2]], max_new_tokens=4, group_size=8, draft_kv_bits=2
        )
    # Gemma 3's local layers attend within a window, which the quantized store does not
    # serve: the model is refused before anything is compiled.
    gemma = lm.Transformer(
        model.config.replace(sliding_window=4, full_attention_layers=(0,), local_rope_theta=1e4)
    )
    with pytest.raises(ValueError, match="serves full attention; this model has a sliding window"):
        quantspec.generate(gemma, params, [[1, 2]], max_new_tokens=4, group_size=8)
