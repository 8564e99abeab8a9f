"""Speculative decoding against the target model alone.

The acceptance rule is checked by Monte Carlo against the distributions it must
reproduce; the whole loop against greedy ``generate`` of the target (token for token)
and, when sampling, against the exact joint distribution of the first two tokens
computed from full forward passes of the target.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.lm.speculative import speculative_generate, verify_drafts

from ..support import random_params

TARGET = lm.LMConfig.tiny(vocab_size=64, max_len=64)
DRAFT = lm.LMConfig.tiny(vocab_size=64, max_len=64, num_layers=1, embed_dim=16, mlp_dim=32)


def _perturbed(params, seed, scale):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda leaf: leaf + jnp.asarray(rng.normal(size=leaf.shape) * scale, leaf.dtype), params
    )


def _simplex(rng, shape, zeros=0):
    """Random distributions over the last axis, ``zeros`` entries per row set to 0."""
    probs = rng.gamma(0.7, size=shape)
    for index in np.ndindex(shape[:-1]):
        probs[index][rng.choice(shape[-1], zeros, replace=False)] = 0.0
    return probs / probs.sum(-1, keepdims=True)


@pytest.mark.parametrize("zeros", [0, 2])
def test_acceptance_rule_reproduces_the_target_distribution(zeros):
    rng = np.random.default_rng(zeros)
    vocab, num_draft, samples = 6, 2, 200_000
    p = jnp.asarray(_simplex(rng, (num_draft + 1, vocab), zeros), jnp.float32)
    q = jnp.asarray(_simplex(rng, (num_draft, vocab), zeros), jnp.float32)
    draft_key, verify_key = jax.random.split(jax.random.key(zeros))
    drafts = jax.random.categorical(draft_key, jnp.log(q), shape=(samples, num_draft))
    num_accepted, next_token = verify_drafts(
        verify_key,
        drafts,
        jnp.broadcast_to(q, (samples, *q.shape)),
        jnp.broadcast_to(p, (samples, *p.shape)),
    )
    num_accepted, next_token, drafts = map(np.asarray, (num_accepted, next_token, drafts))
    first = np.where(num_accepted >= 1, drafts[:, 0], next_token)
    np.testing.assert_allclose(np.bincount(first, minlength=vocab) / samples, p[0], atol=5e-3)
    # Given that d_1 was accepted, the second emitted token follows p_2.
    kept = num_accepted >= 1
    second = np.where(num_accepted[kept] >= 2, drafts[kept, 1], next_token[kept])
    np.testing.assert_allclose(np.bincount(second, minlength=vocab) / kept.sum(), p[1], atol=1e-2)
    # The acceptance probability of d_1 is sum_x min(p_1, q_1).
    np.testing.assert_allclose(kept.mean(), np.minimum(p[0], q[0]).sum(), atol=5e-3)


def test_identical_distributions_accept_everything():
    rng = np.random.default_rng(0)
    p = jnp.asarray(_simplex(rng, (64, 4, 10)), jnp.float32)
    drafts = jax.random.categorical(jax.random.key(1), jnp.log(p[:, :3]))
    num_accepted, _ = verify_drafts(jax.random.key(2), drafts, p[:, :3], p)
    assert (np.asarray(num_accepted) == 3).all()


PROMPTS = [[3, 9, 27, 17, 51, 25], [5], [60, 1, 2, 7], [11, 13]]


@pytest.mark.parametrize(
    ("draft_name", "num_draft"), [("random", 3), ("target", 4), ("perturbed", 2), ("perturbed", 5)]
)
def test_greedy_equals_greedy_generation_of_the_target(draft_name, num_draft):
    target_params = random_params(TARGET, scale=0.5)
    target = lm.Transformer(TARGET)
    if draft_name == "random":
        draft, draft_params = lm.Transformer(DRAFT), random_params(DRAFT, 1, scale=0.5)
    elif draft_name == "target":
        draft, draft_params = target, target_params
    else:
        draft, draft_params = target, _perturbed(target_params, 2, 0.1)
    steps = 12
    want = lm.generate(target, target_params, PROMPTS, max_new_tokens=steps)
    got = speculative_generate(
        target,
        target_params,
        draft,
        draft_params,
        PROMPTS,
        max_new_tokens=steps,
        num_draft=num_draft,
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), steps)
    rate = float(got.acceptance_rate)
    if draft_name == "target":
        assert rate == 1.0
        assert int(got.num_iterations) == -(-steps // (num_draft + 1))
    elif draft_name == "perturbed":
        assert 0.0 < rate < 1.0
        # fewer target passes than tokens: the drafts did save work
        assert int(got.num_iterations) < steps


def test_stop_tokens_end_each_sequence_where_generate_does():
    target_params = random_params(TARGET, scale=0.5)
    target = lm.Transformer(TARGET)
    draft_params = _perturbed(target_params, 3, 0.1)
    free = lm.generate(target, target_params, PROMPTS, max_new_tokens=10)
    # A token that the first sequence emits mid-way, as a stop token.
    stop = int(np.asarray(free.tokens)[0, 4])
    want = lm.generate(target, target_params, PROMPTS, max_new_tokens=10, stop_tokens=[stop])
    got = speculative_generate(
        target,
        target_params,
        target,
        draft_params,
        PROMPTS,
        max_new_tokens=10,
        num_draft=3,
        stop_tokens=[stop],
    )
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(np.asarray(got.lengths)[0]) <= 5


def test_sampling_follows_the_target_joint_distribution():
    """Two sampled tokens after one prompt, many rows: the empirical joint distribution
    matches p(t1) p(t2 | t1) of the target, and not that of the draft."""
    vocab, temperature, rows = 6, 1.0, 8192
    target_config = lm.LMConfig.tiny(vocab_size=vocab, max_len=16)
    draft_config = lm.LMConfig.tiny(vocab_size=vocab, max_len=16, num_layers=1)
    target, draft = lm.Transformer(target_config), lm.Transformer(draft_config)
    target_params, draft_params = (
        random_params(target_config, scale=0.3),
        random_params(draft_config, 1, scale=0.3),
    )
    prompt = [1, 4, 2]
    sampling = lm.SamplingParams(temperature=temperature)

    def joint(config, params):
        model = lm.Transformer(config)
        sequences = np.array([prompt + [a, 0] for a in range(vocab)], np.int32)
        positions = np.broadcast_to(np.arange(len(prompt) + 2), sequences.shape)
        logits, _ = model.apply({"params": params}, sequences, positions)
        probs = np.asarray(jax.nn.softmax(logits / temperature, axis=-1), np.float64)
        first = probs[0, len(prompt) - 1]
        return first[:, None] * probs[:, len(prompt)]

    want, draft_joint = joint(target_config, target_params), joint(draft_config, draft_params)
    out = speculative_generate(
        target,
        target_params,
        draft,
        draft_params,
        [prompt] * rows,
        max_new_tokens=2,
        num_draft=2,
        sampling=sampling,
        rng=jax.random.key(7),
    )
    tokens = np.asarray(out.tokens)
    counts = np.zeros((vocab, vocab))
    for a, b in itertools.product(range(vocab), repeat=2):
        counts[a, b] = np.sum((tokens[:, 0] == a) & (tokens[:, 1] == b))
    empirical = counts / rows
    total_variation = 0.5 * np.abs(empirical - want).sum()
    assert total_variation < 0.03, total_variation
    # The test can tell: the draft's own distribution is far away.
    assert 0.5 * np.abs(draft_joint - want).sum() > 0.1
    assert 0.0 < float(out.acceptance_rate) < 1.0


def test_bad_arguments():
    target = lm.Transformer(TARGET)
    params = random_params(TARGET, scale=0.5)
    other = lm.Transformer(lm.LMConfig.tiny(vocab_size=32, max_len=64))
    with pytest.raises(ValueError, match="draft vocab_size 32 differs"):
        speculative_generate(target, params, other, params, PROMPTS, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_draft must be >= 1"):
        speculative_generate(target, params, target, params, PROMPTS, max_new_tokens=4, num_draft=0)
    with pytest.raises(ValueError, match="exceeds the target model's max_len 64"):
        speculative_generate(target, params, target, params, PROMPTS, max_new_tokens=60)
    with pytest.raises(ValueError, match="rng is required"):
        speculative_generate(
            target,
            params,
            target,
            params,
            PROMPTS,
            max_new_tokens=4,
            sampling=lm.SamplingParams(temperature=1.0),
        )
    with pytest.raises(ValueError, match="target_probs"):
        verify_drafts(
            jax.random.key(0),
            jnp.zeros((2, 3), jnp.int32),
            jnp.ones((2, 3, 5)),
            jnp.ones((2, 3, 5)),
        )


def test_self_drafter_in_the_target_cache_and_a_drafter_with_its_own_prompt():
    """A SelfDrafter writes its drafts into the target's cache, which the verification
    overwrites; a ModelDrafter may read a shorter prompt of its own. Both leave greedy
    decoding of the target unchanged."""
    from lhc.lm.speculative import ModelDrafter, SelfDrafter

    target_params = random_params(TARGET, scale=0.5)
    target = lm.Transformer(TARGET)
    steps = 12
    want = lm.generate(target, target_params, PROMPTS, max_new_tokens=steps)
    quantized_like = _perturbed(target_params, 6, 0.1)
    got = speculative_generate(
        target,
        target_params,
        SelfDrafter(target),
        quantized_like,
        PROMPTS,
        max_new_tokens=steps,
        num_draft=3,
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert 0.0 < float(got.acceptance_rate) < 1.0
    # A drafter that sees only the last two prompt tokens.
    short = [p[-2:] for p in PROMPTS]
    got = speculative_generate(
        target,
        target_params,
        ModelDrafter(target),
        target_params,
        PROMPTS,
        max_new_tokens=steps,
        num_draft=3,
        draft_prompts=short,
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    with pytest.raises(ValueError, match="ending with the target prompt's last token"):
        speculative_generate(
            target,
            target_params,
            target,
            target_params,
            PROMPTS,
            max_new_tokens=4,
            draft_prompts=[[1], [2], [3], [4]],
        )


def test_a_verifier_variant_changes_only_what_it_overrides():
    """A verifier whose acceptance test uses the draft's own distribution (p_hat = q)
    accepts every draft: the output is then the draft's greedy decoding."""
    from lhc.lm.speculative import SpeculativeSampling

    class AcceptAll(SpeculativeSampling):
        def adjust(self, target_logits, draft_probs, sampling):
            target_probs, _ = super().adjust(target_logits, draft_probs, sampling)
            padded = jnp.concatenate([draft_probs, target_probs[:, -1:]], axis=1)
            return target_probs, padded

    target, draft = lm.Transformer(TARGET), lm.Transformer(DRAFT)
    target_params, draft_params = (
        random_params(TARGET, scale=0.5),
        random_params(DRAFT, 1, scale=0.5),
    )
    got = speculative_generate(
        target,
        target_params,
        draft,
        draft_params,
        PROMPTS,
        max_new_tokens=8,
        num_draft=3,
        verifier=AcceptAll(),
    )
    assert float(got.acceptance_rate) == 1.0
    drafts_only = lm.generate(draft, draft_params, PROMPTS, max_new_tokens=8)
    # Rounds of 3 drafts and a bonus token from the target: columns 0-2, 4-6 are drafts.
    tokens = np.asarray(got.tokens)
    np.testing.assert_array_equal(tokens[:, :3], np.asarray(drafts_only.tokens)[:, :3])


def _context_prefilled(target, target_params, questions):
    """``(questions, whole prompts, their greedy 9 tokens, a cache of the shared context)``."""
    context = [[3, 9, 27, 17, 51, 25, 8], [5, 1, 2, 7, 60, 33, 4]]
    whole = [c + q for c, q in zip(context, questions)]
    want = lm.generate(target, target_params, whole, max_new_tokens=9)
    cache = target.init_cache(2, 40)
    positions = np.broadcast_to(np.arange(7), (2, 7))
    _, cache = lm.prefill(target, target_params, np.asarray(context), positions, cache)
    return questions, whole, want, cache


def test_continuing_from_a_prefilled_target_cache():
    """A shared context prefilled once, the rest of each prompt appended by the loop: the
    same tokens as speculating on the whole prompts, and as greedy generation."""
    target_params = random_params(TARGET, scale=0.5)
    target = lm.Transformer(TARGET)
    draft_params = _perturbed(target_params, 2, 0.1)
    questions, whole, want, cache = _context_prefilled(target, target_params, [[11, 13, 2], [6, 9]])
    got = speculative_generate(
        target,
        target_params,
        target,
        draft_params,
        questions,
        max_new_tokens=9,
        num_draft=3,
        target_cache=cache,
        draft_prompts=whole,
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert 0.0 < float(got.acceptance_rate) < 1.0
    with pytest.raises(ValueError, match="free slots"):
        speculative_generate(
            target,
            target_params,
            target,
            draft_params,
            questions,
            max_new_tokens=40,
            num_draft=3,
            target_cache=cache,
        )


def test_a_self_drafter_continuing_a_prefilled_cache_drafts_at_the_target_positions():
    """Drafting in the target's own cache with the target's weights proposes exactly the
    target's tokens: every draft is accepted, after a prefilled ``target_cache`` too
    (the drafts are fed at the cache's positions, not from 0)."""
    from lhc.lm.speculative import SelfDrafter

    target_params = random_params(TARGET, scale=0.5)
    target = lm.Transformer(TARGET)
    questions, _, want, cache = _context_prefilled(target, target_params, [[11, 13, 2], [6, 9, 30]])
    got = speculative_generate(
        target,
        target_params,
        SelfDrafter(target),
        target_params,
        questions,
        max_new_tokens=9,
        num_draft=3,
        target_cache=cache,
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert float(got.acceptance_rate) == 1.0
