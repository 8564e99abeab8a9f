"""RAPID decoding against the target alone: greedy output token for token with eta = 0,
the sampled joint distribution of two tokens with eta = 0 (and not with eta > 0), the
drafter on its own shorter prompt, upward speculation, bad input."""

import itertools

import jax
import numpy as np
import pytest

from lhc import lm
from lhc.rapid import RetrievalConfig, build_prompts, rag_generate, rapid_generate, target_generate

from ..support import random_params

VOCAB = 64
TARGET = lm.LMConfig.tiny(vocab_size=VOCAB, max_len=128)
LARGER = lm.LMConfig.tiny(vocab_size=VOCAB, max_len=128, num_layers=3, embed_dim=48, mlp_dim=96)
RETRIEVAL = RetrievalConfig(chunk_size=8, min_budget=24, ratio=4)


def _examples(count, length, seed=0, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    contexts = [rng.integers(1, vocab, size=length - 3 * i) for i in range(count)]
    # Each question repeats a piece of its context, which BM25 over token ids finds.
    questions = [np.concatenate([c[20:24], [vocab - 1]]) for c in contexts]
    return contexts, questions


def test_prompts():
    contexts, questions = _examples(3, 60)
    prompts = build_prompts(contexts, questions, RETRIEVAL, prefix=[1], separator=[2])
    for context, question, full, rag in zip(contexts, questions, prompts.full, prompts.rag):
        np.testing.assert_array_equal(full, np.concatenate([[1], context, [2], question]))
        assert len(rag.tokens) < len(full) and rag.tokens[-len(question) :].tolist() == list(
            question
        )
        assert 20 // 8 in rag.chunks  # the chunk the question was taken from
    with pytest.raises(ValueError, match="as many contexts as questions"):
        build_prompts(contexts, questions[:2], RETRIEVAL)


@pytest.mark.parametrize("drafter_name", ["self", "larger"])
def test_greedy_with_eta_zero_is_greedy_decoding_of_the_target(drafter_name):
    target, target_params = lm.Transformer(TARGET), random_params(TARGET, scale=0.5)
    drafter, draft_params = (
        (None, None)
        if drafter_name == "self"
        else (lm.Transformer(LARGER), random_params(LARGER, 1, scale=0.5))
    )
    prompts = build_prompts(*_examples(3, 60), RETRIEVAL)
    want = target_generate(target, target_params, prompts, max_new_tokens=14)
    got = rapid_generate(
        target,
        target_params,
        prompts,
        max_new_tokens=14,
        drafter=drafter,
        draft_params=draft_params,
        eta=0.0,
        gamma=4,
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    rate = float(got.acceptance_rate)
    assert rate < 1.0 and (rate > 0.0 or drafter_name == "larger")  # a random larger drafter
    if drafter_name == "larger":
        return
    # Infinite transfer keeps every draft.
    keen = rapid_generate(
        target,
        target_params,
        prompts,
        max_new_tokens=14,
        drafter=drafter,
        draft_params=draft_params,
        eta=1e6,
        gamma=4,
    )
    assert float(keen.acceptance_rate) == 1.0
    assert not np.array_equal(np.asarray(keen.tokens), np.asarray(want.tokens))


def test_a_drafter_that_reads_the_whole_context_agrees_with_the_target():
    target, params = lm.Transformer(TARGET), random_params(TARGET, scale=0.5)
    prompts = build_prompts(*_examples(2, 40), RetrievalConfig(chunk_size=8, min_budget=64))
    for full, rag in zip(prompts.full, prompts.rag):
        np.testing.assert_array_equal(full, rag.tokens)
    got = rapid_generate(target, params, prompts, max_new_tokens=10, eta=5.0, gamma=3)
    assert float(got.acceptance_rate) == 1.0
    want = rag_generate(target, params, prompts, max_new_tokens=10)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_sampling_with_eta_zero_follows_the_target_and_not_with_eta_positive():
    """Two sampled tokens, many rows: with eta = 0 the joint distribution is the target's
    p(t1) p(t2 | t1) on the full prompt, computed from full forward passes; with eta > 0
    it moves toward the drafter."""
    vocab, rows = 6, 8192
    config = lm.LMConfig.tiny(vocab_size=vocab, max_len=64)
    target, params = lm.Transformer(config), random_params(config, scale=0.4)
    draft_params = random_params(config, 5, scale=0.4)
    contexts, questions = _examples(1, 30, seed=3, vocab=vocab)
    prompts = build_prompts(contexts, questions, RetrievalConfig(chunk_size=6, min_budget=12))
    full = prompts.full[0].tolist()
    sequences = np.array([full + [a, 0] for a in range(vocab)], np.int32)
    logits, _ = target.apply(
        {"params": params},
        sequences,
        np.broadcast_to(np.arange(sequences.shape[1]), sequences.shape),
    )
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    want = probs[0, len(full) - 1][:, None] * probs[:, len(full)]
    batch = build_prompts(
        contexts * rows, questions * rows, RetrievalConfig(chunk_size=6, min_budget=12)
    )

    def variation(eta):
        out = rapid_generate(
            target,
            params,
            batch,
            max_new_tokens=2,
            drafter=target,
            draft_params=draft_params,
            eta=eta,
            gamma=2,
            sampling=lm.SamplingParams(temperature=1.0),
            rng=jax.random.key(1),
        )
        tokens = np.asarray(out.tokens)
        counts = np.zeros((vocab, vocab))
        for a, b in itertools.product(range(vocab), repeat=2):
            counts[a, b] = np.sum((tokens[:, 0] == a) & (tokens[:, 1] == b))
        return 0.5 * np.abs(counts / rows - want).sum(), float(out.acceptance_rate)

    exact, rate = variation(0.0)
    assert exact < 0.03, exact
    moved, moved_rate = variation(4.0)
    assert moved > 0.06, moved
    assert moved_rate > rate


def test_bad_input():
    target, params = lm.Transformer(TARGET), random_params(TARGET, scale=0.5)
    prompts = build_prompts(*_examples(1, 40), RETRIEVAL)
    other = lm.LMConfig.tiny(vocab_size=VOCAB + 1, max_len=128)
    with pytest.raises(ValueError, match="vocab_size 65 differs from the target's 64"):
        rapid_generate(
            target,
            params,
            prompts,
            max_new_tokens=2,
            drafter=lm.Transformer(other),
            draft_params=random_params(other, 1, scale=0.5),
        )
    with pytest.raises(ValueError, match="draft_params is required"):
        rapid_generate(target, params, prompts, max_new_tokens=2, drafter=target)
    with pytest.raises(ValueError, match="non-empty"):
        build_prompts([[]], [[1, 2]], RETRIEVAL)
    with pytest.raises(ValueError, match="longer than the retrieval budget"):
        build_prompts([list(range(1, 60))], [list(range(1, 30))], RETRIEVAL)


def test_decoding_after_a_prefilled_context_equals_decoding_the_whole_prompt():
    from lhc.rapid import prefill_contexts

    target, params = lm.Transformer(TARGET), random_params(TARGET, scale=0.5)
    prompts = build_prompts(*_examples(3, 50), RETRIEVAL, prefix=[1], separator=[2])
    want_target = target_generate(target, params, prompts, max_new_tokens=8)
    want = rapid_generate(target, params, prompts, max_new_tokens=8, eta=3.0, gamma=3)
    cache = prefill_contexts(target, params, prompts, extra=30)
    got = rapid_generate(
        target, params, prompts, max_new_tokens=8, eta=3.0, gamma=3, target_cache=cache
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.accepted), np.asarray(want.accepted))
    got_target = target_generate(target, params, prompts, max_new_tokens=8, cache=cache)
    np.testing.assert_array_equal(np.asarray(got_target.tokens), np.asarray(want_target.tokens))
