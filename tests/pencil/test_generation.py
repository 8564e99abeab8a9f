"""Reduction-aware generation on the KV cache against recomputing the reduced context
for every token (the official code's way), on a random model that emits the special
tokens often."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.lm.sampling import SamplingParams
from lhc.pencil import generation
from lhc.pencil.reduction import reduce
from lhc.pencil.tokenizer import PencilTokenizer

from ..support import random_params

TOKENIZER = PencilTokenizer(["a"])  # 8 ids: <UNK> a BOS EOP CALL SEP RETURN EOS
CONFIG = lm.LMConfig.tiny(vocab_size=TOKENIZER.vocab_size, max_len=64)
LIMIT = 28
SCALE = 0.1
PROMPTS = [[2, 1, 1, 3], [2, 3], [2, 1, 0, 1, 1, 3]]


# Log-odds the model favours each token by: the special tokens often, EOS rarely.
BIAS = np.array([-1.0, 0.0, -3.0, -3.0, 1.0, 1.0, 1.0, -2.0])


@functools.cache
def _params(scale=SCALE):
    """Random weights, plus a constant feature in the embeddings (dimension 0) that
    the output projection turns into a per-token bias (``BIAS``)."""
    params = jax.tree.map(np.array, random_params(CONFIG, scale=scale, norms=scale))
    params["embed"]["embedding"][:, 0] = 3.0
    # A weaker context-dependent part of the logits, so that the bias shows.
    params["lm_head"]["kernel"] *= 0.2
    normed = 3.0 / np.sqrt((9.0 + (CONFIG.embed_dim - 1) * scale**2) / CONFIG.embed_dim)
    params["lm_head"]["kernel"][0] = BIAS / normed
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def _run(fn, stop_tokens=(), max_new_tokens=48, **kwargs):
    return fn(
        lm.Transformer(CONFIG),
        _params(),
        PROMPTS,
        TOKENIZER,
        max_new_tokens=max_new_tokens,
        context_limit=LIMIT,
        sampling=SamplingParams(temperature=1.0),
        rng=jax.random.key(7),
        stop_tokens=list(stop_tokens),
        **kwargs,
    )


@functools.cache
def _recomputed(stop_tokens=()):
    return _run(generation.generate_recompute, stop_tokens)


@pytest.mark.parametrize("stop_tokens", [(), (TOKENIZER.eos_id,)])
def test_cache_rewind_equals_recomputing_the_reduced_context(stop_tokens):
    # Answers of several tokens are fed two at a time: several chunks per reduction.
    out = _run(generation.generate, stop_tokens, answer_chunk=2)
    expected = _recomputed(stop_tokens)
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    np.testing.assert_allclose(out.log_probs, expected.log_probs, atol=2e-4)
    for name in ("lengths", "context_lengths", "max_context", "reductions", "overflowed"):
        np.testing.assert_array_equal(getattr(out, name), getattr(expected, name), err_msg=name)
    np.testing.assert_array_equal(out.context, expected.context)
    if not stop_tokens:
        # The random model does reduce, nested and repeatedly, and overflows the limit.
        assert (np.asarray(out.reductions) >= 3).all()
        assert np.asarray(out.overflowed).any()
        overflowed = np.asarray(out.overflowed)
        assert (np.asarray(out.max_context)[~overflowed] <= LIMIT).all()
        assert (np.asarray(out.max_context)[overflowed] == LIMIT + 1).all()
    # The final context is the reduction of prompt and trace (a Python reference).
    for b, prompt in enumerate(PROMPTS):
        trace = np.asarray(out.tokens[b, : int(out.lengths[b])]).tolist()
        reduced = reduce(prompt + trace, TOKENIZER.call_id, TOKENIZER.sep_id, TOKENIZER.return_id)
        if not bool(out.overflowed[b]):
            assert reduced == np.asarray(out.context[b, : int(out.context_lengths[b])]).tolist()


def test_errors_and_trace_rate():
    model, params = lm.Transformer(CONFIG), _params()
    call = functools.partial(generation.generate, model, params, tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="context_limit must be an int in"):
        call(PROMPTS, max_new_tokens=4, context_limit=CONFIG.max_len + 1)
    with pytest.raises(ValueError, match="does not fit the context_limit"):
        call(PROMPTS, max_new_tokens=4, context_limit=5)
    with pytest.raises(ValueError, match="rng is required"):
        call(PROMPTS, max_new_tokens=4, context_limit=16, sampling=SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="vocab_size"):
        call([[3, 99]], max_new_tokens=4, context_limit=16)
    with pytest.raises(ValueError, match="at least one token"):
        call([[3], []], max_new_tokens=4, context_limit=16)
    assert generation.trace_rate([1, 2, 3, 9], [1, 5, 3]) == pytest.approx(2 / 3)
    assert generation.trace_rate([], [1, 2]) == 0.0


def test_recomputation_compiles_nothing_once_its_shapes_are_compiled():
    # A baseline that compiled per token (sampling's lax.cond run eagerly) would be
    # timed on compiling, not on recomputing.
    _recomputed()
    compiled = []

    def record(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        _run(generation.generate_recompute)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert compiled == []


def test_cot_window_equals_cropping_the_context_and_recomputing():
    # The official code crops the context to its last L tokens and runs the model on
    # them for every token; with RoPE the sliding window sees the same relative
    # positions. Greedy, a limit the traces pass.
    from lhc.pencil.evaluation import generate_cot

    model, params, limit, new = lm.Transformer(CONFIG), _params(), 10, 24
    tokens, lengths, contexts, over = generate_cot(
        model, params, PROMPTS, TOKENIZER, context_limit=limit, max_new_tokens=new
    )
    forward = jax.jit(lambda t, p: model.apply({"params": params}, t, p)[0][0, -1])
    for b, prompt in enumerate(PROMPTS):
        sequence = list(prompt)
        while len(sequence) - len(prompt) < new and sequence[-1] != TOKENIZER.eos_id:
            window = sequence[-limit:]
            pad = limit - len(window)  # left padding (negative positions): one shape
            positions = [-1] * pad + list(range(len(window)))
            window = [TOKENIZER.pad_id] * pad + window
            sequence.append(int(jnp.argmax(forward(jnp.array([window]), jnp.array([positions])))))
        expected = sequence[len(prompt) :]
        assert np.asarray(tokens[b, : int(lengths[b])]).tolist() == expected
        ended = expected[-1] == TOKENIZER.eos_id
        assert contexts[b] == len(sequence) - ended and over[b] == (contexts[b] > limit)
    assert over.any()
