"""Shared-prefix answer scores against each full sequence run alone in a plain forward
pass (no cache), and first-token probabilities against a numpy softmax of the logits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.icl import shared_prefix

from .conftest import CONFIG, random_params

RNG = np.random.default_rng(3)
PROMPTS = [list(RNG.integers(0, CONFIG.vocab_size, n)) for n in (5, 9, 3, 12, 7)]
ANSWERS = [[list(RNG.integers(0, CONFIG.vocab_size, n)) for n in (1, 4, 2)] for _ in PROMPTS]


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model.apply({"params": params}, tokens, positions)[0]


def _logits(model, params, sequences):
    """float64 ``[N, T, V]`` logits of each sequence, a plain forward pass without a
    cache; the sequences are right-padded to 24 tokens (causal: the padding after a
    sequence changes none of its logits)."""
    tokens = np.zeros((len(sequences), 24), np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    return np.asarray(_forward(model, params, jnp.asarray(tokens)), np.float64)


def _softmax(logits):
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _reference(model, params):
    """Per prompt and answer: log p(answer), p(first token), first-token rank, greedy;
    each ``prompt + answer`` run on its own."""
    logp, first, ranks, greedy = (np.zeros((len(PROMPTS), 3)) for _ in range(4))
    logits = _logits(model, params, [p + a for p, group in zip(PROMPTS, ANSWERS) for a in group])
    for i, prompt in enumerate(PROMPTS):
        for k, answer in enumerate(ANSWERS[i]):
            probs = _softmax(logits[3 * i + k])
            steps = probs[len(prompt) - 1 : len(prompt) - 1 + len(answer)]
            chosen = steps[np.arange(len(answer)), answer]
            logp[i, k] = np.log(chosen).sum()
            first[i, k] = chosen[0]
            ranks[i, k] = (steps[0] > chosen[0]).sum()
            greedy[i, k] = all(steps.argmax(-1) == answer)
    return logp, first, ranks, greedy


@pytest.mark.parametrize("scan_layers", [False, True])
def test_shared_prefix_scores_equal_scoring_each_sequence_alone(tiny, scan_layers):
    model, params = tiny
    if scan_layers:
        config = dataclasses.replace(CONFIG, scan_layers=True)
        model, params = lm.Transformer(config), random_params(config)
    # 5 prompts in calls of 2: left padding, and a last call filled up with copies.
    got = shared_prefix.score_answers(model, params, PROMPTS, ANSWERS, batch_size=2)
    logp, first, ranks, greedy = _reference(model, params)
    np.testing.assert_allclose(got.logprobs, logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.first_probabilities, first, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(got.first_ranks, ranks)
    np.testing.assert_array_equal(got.greedy, greedy)
    if scan_layers:
        return
    # One wider call, every prompt at once: the same scores.
    wide = shared_prefix.score_answers(model, params, PROMPTS, ANSWERS, batch_size=8, width=20)
    np.testing.assert_allclose(wide.logprobs, got.logprobs, rtol=1e-5, atol=1e-5)


def test_greedy_answers_and_first_token_ranks(tiny):
    """Answers built from the model's own argmax continuations are greedy with rank 0;
    the second and third most probable first tokens have ranks 1 and 2."""
    model, params = tiny
    prompt = PROMPTS[1]
    answer = []
    for _ in range(3):
        answer.append(
            int(
                _logits(model, params, [prompt + answer])[0, len(prompt) + len(answer) - 1].argmax()
            )
        )
    order = np.argsort(-_logits(model, params, [prompt])[0, len(prompt) - 1])
    answers = [[answer, [int(order[1])], [int(order[2]), answer[0]]]]
    got = shared_prefix.score_answers(model, params, [prompt], answers, batch_size=2)
    np.testing.assert_array_equal(got.greedy, [[True, False, False]])
    np.testing.assert_array_equal(got.first_ranks, [[0, 1, 2]])


def test_repeat_rows_copies_each_sequence_in_a_row(tiny):
    model, _ = tiny
    cache = model.init_cache(2, 8)
    cache = cache.replace(lengths=jnp.array([3, 5], jnp.int32))
    repeated = shared_prefix.repeat_rows(cache, 3)
    np.testing.assert_array_equal(repeated.lengths, [3, 3, 3, 5, 5, 5])
    assert repeated.keys[0].shape[0] == 6 and repeated.positions.shape == (6, 8)


def test_bad_input_is_refused(tiny):
    model, params = tiny
    score = lambda p, a, **kw: shared_prefix.score_answers(model, params, p, a, **kw)
    with pytest.raises(ValueError, match=r"answers: expected one list per prompt \(2\), got 1"):
        score([[1], [2]], [[[3]]])
    with pytest.raises(ValueError, match=r"same number \(>= 1\) of answers.*\[1, 2\]"):
        score([[1], [2]], [[[3]], [[3], [4]]])
    with pytest.raises(ValueError, match="prompt 0: expected a non-empty prompt"):
        score([[1]], [[[]]])
    with pytest.raises(ValueError, match="within the model's max_len 64, got 66 tokens"):
        score([[1] * 60], [[[2] * 6]])
    with pytest.raises(ValueError, match=r"width: expected at least the longest \(3\), got 2"):
        score([[1, 2, 3]], [[[4]]], width=2)
    with pytest.raises(ValueError, match="batch_size: expected an integer >= 1, got 0"):
        score([[1]], [[[4]]], batch_size=0)
