"""EMLoC's compression against full recomputation and a float64 numpy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax

from lhc import emloc, lm
from lhc.emloc import EMLoCConfig, Example
from lhc.emloc.compress import _prefill, _student, _teacher

from ..support import forward, random_params

CONFIG = lm.LMConfig.tiny(num_layers=3, max_len=128)
MODEL = lm.Transformer(CONFIG)


@pytest.fixture(scope="module")
def params():
    """Random parameters (weights of standard deviation 8 ** -0.5, norm scales near one),
    with attention sharp enough that pruning changes the answers: queries 3 times
    larger."""
    drawn = random_params(CONFIG, scale=8**-0.5, norms=0.2)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: 3 * leaf if "query" in jax.tree_util.keystr(path) else leaf, drawn
    )


def _examples(count, seed, length=7, answers=2, image_at=None):
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(count):
        answer = np.zeros(length, bool)
        answer[-answers:] = True
        tokens = rng.integers(3, CONFIG.vocab_size, length)
        if i == image_at:
            embedded = np.zeros(length, bool)
            embedded[1:3] = True
            embeddings = rng.normal(size=(length, CONFIG.embed_dim)).astype(np.float32)
            examples.append(Example(tokens, answer, embeddings, embedded))
        else:
            examples.append(Example(tokens, answer))
    return examples


def _inputs(examples):
    """Concatenated tokens, and [T, D] inputs with NaN where the token's embedding is used."""
    tokens = np.concatenate([e.tokens for e in examples])
    inputs = np.full((tokens.size, CONFIG.embed_dim), np.nan)
    start = 0
    for e in examples:
        if e.embeddings is not None:
            rows = start + np.flatnonzero(e.embedded)
            inputs[rows] = e.embeddings[e.embedded]
        start += len(e)
    return tokens, inputs


def _js(p_logits, q_logits):
    lp, lq = log_softmax(p_logits, axis=-1), log_softmax(q_logits, axis=-1)
    p, q = np.exp(lp), np.exp(lq)
    m = (p + q) / 2
    return 0.5 * np.sum(p * (lp - np.log(m)), -1) + 0.5 * np.sum(q * (lq - np.log(m)), -1)


def test_delta_zero_keeps_everything_and_answers_like_the_full_context(params):
    examples = _examples(4, seed=1, image_at=2)
    compression = emloc.compress(MODEL, params, examples, EMLoCConfig(chunk_size=2, delta=0.0))
    context = sum(len(e) for e in examples)
    assert list(compression.memory.sizes()) == [context] * CONFIG.num_layers
    assert all(d.ratio == 1.0 for d in compression.decisions)

    query = np.array([5, 17, 33, 9], np.int32)
    tokens, inputs = _inputs(examples)
    full_tokens = np.concatenate([tokens, query])
    full_inputs = np.concatenate([inputs, np.full((4, CONFIG.embed_dim), np.nan)])
    embedded = ~np.isnan(full_inputs[:, 0])
    full, _ = MODEL.apply(
        {"params": params},
        jnp.asarray(full_tokens[None]),
        jnp.arange(full_tokens.size, dtype=jnp.int32)[None],
        embeddings=jnp.asarray(np.nan_to_num(full_inputs)[None], jnp.float32),
        embedding_mask=jnp.asarray(embedded[None]),
    )
    memory = compression.memory.with_tail(CONFIG, 8)
    on_memory, _ = MODEL.apply(
        {"params": params},
        jnp.asarray(query[None]),
        jnp.arange(context, context + 4, dtype=jnp.int32)[None],
        memory,
    )
    np.testing.assert_allclose(on_memory[0], full[0, context:], rtol=1e-4, atol=1e-4)

    # Greedy generation on the memory continues like generation on the whole context
    # (its image tokens fed as embeddings in the full forward above; here, token-only
    # examples so that lm.generate can take the whole context as a prompt).
    plain = _examples(2, seed=5)
    compression = emloc.compress(MODEL, params, plain, EMLoCConfig(chunk_size=2, delta=0.0))
    on_memory = lm.generate(
        MODEL,
        params,
        [query],
        max_new_tokens=5,
        cache=compression.memory.broadcast(1).with_tail(CONFIG, 16),
    )
    whole = lm.generate(
        MODEL, params, [np.concatenate([e.tokens for e in plain] + [query])], max_new_tokens=5
    )
    np.testing.assert_array_equal(on_memory.tokens, whole.tokens)


def _row_predictions(example):
    return np.flatnonzero(example.answer[1:])


def test_every_accepted_layer_holds_the_bound_recomputed_in_float64(params):
    examples = _examples(3, seed=2)
    config = EMLoCConfig(chunk_size=3, delta=0.05)
    compression = emloc.compress(MODEL, params, examples, config)
    decisions = {d.layer: d for d in compression.decisions}
    accepted = [d for d in compression.decisions if d.ratio < 1]
    assert accepted, "no layer was pruned: the test would check nothing"
    chunk = np.concatenate([e.tokens for e in examples])
    length = chunk.size
    p64 = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)

    def answers(example, masks):
        sequence = np.concatenate([chunk, example.tokens])
        key_mask = {
            layer: np.concatenate([m, np.ones((CONFIG.num_kv_heads, len(example)), bool)], 1)
            for layer, m in masks.items()
        }
        logits = forward(CONFIG, p64, sequence, key_mask=key_mask, masked_from=length)
        return logits[length + _row_predictions(example)]

    teacher = [answers(e, {}) for e in examples]
    for decision in accepted:
        masks = {}
        for layer in range(decision.layer, CONFIG.num_layers):
            mask = np.zeros((CONFIG.num_kv_heads, length), bool)
            np.put_along_axis(mask, decisions[layer].tokens, True, axis=1)
            masks[layer] = mask
        js = np.concatenate([_js(t, answers(e, masks)) for t, e in zip(teacher, examples)])
        assert js.mean() <= config.delta + 1e-6
        np.testing.assert_allclose(js.mean(), decision.js, rtol=2e-3, atol=1e-6)
        assert decision.tokens.shape == (CONFIG.num_kv_heads, int(length * decision.ratio))
    for decision in compression.decisions:  # a rejected ratio really broke the bound
        for ratio, js in decision.tried:
            if ratio != decision.ratio and not np.isnan(js):
                assert js > config.delta


def test_importance_matches_the_full_attention_probabilities(params):
    first, second = _examples(2, seed=3), _examples(2, seed=4)
    config = EMLoCConfig(chunk_size=2, delta=0.0)
    compression = emloc.compress(MODEL, params, first + second, config)
    decisions = [d for d in compression.decisions if d.chunk == 1]
    before = np.concatenate([e.tokens for e in first])
    chunk = np.concatenate([e.tokens for e in second])
    answer = np.concatenate([e.answer for e in second])
    p64 = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    expected = np.zeros((CONFIG.num_layers, CONFIG.num_kv_heads, chunk.size))
    for example in second:
        probs = {}
        forward(CONFIG, p64, np.concatenate([before, chunk, example.tokens]), probs=probs)
        start = before.size + chunk.size
        for layer in range(CONFIG.num_layers):
            rows = probs[layer][:, start + _row_predictions(example)]  # [N, Q, T]
            own = rows[..., before.size :]  # the chunk and the row: memory left out
            own = own / own.sum(-1, keepdims=True)
            summed = own[..., : chunk.size].sum(1)  # [N, C]
            expected[layer] += summed.reshape(CONFIG.num_kv_heads, group, -1).sum(1)
    padded = np.pad(expected, ((0, 0), (0, 0), (2, 2)))
    pooled = sum(padded[..., i : i + chunk.size] for i in range(5)) / 5
    expected = pooled + 100.0 * answer
    for decision in decisions:
        np.testing.assert_allclose(decision.scores, expected[decision.layer], rtol=1e-4, atol=1e-6)


def test_memory_accounting(params):
    examples = _examples(4, seed=6)
    compression = emloc.compress(MODEL, params, examples, EMLoCConfig(chunk_size=2, delta=0.05))
    memory = compression.memory
    kept = np.zeros(CONFIG.num_layers, int)
    for d in compression.decisions:
        kept[d.layer] += d.kept
    np.testing.assert_array_equal(memory.sizes(), kept)
    itemsize = jnp.dtype(CONFIG.dtype).itemsize
    assert memory.nbytes() == int(2 * CONFIG.num_kv_heads * CONFIG.head_dim * itemsize * kept.sum())
    assert compression.kept_fraction() == pytest.approx(kept.mean() / 28)
    for layer, positions in enumerate(memory.positions):  # what a head holds is what it kept
        held = np.sort(np.asarray(positions)[0], axis=-1)
        held = held[held >= 0].reshape(CONFIG.num_kv_heads, -1)
        expected = []
        for chunk, offset in ((0, 0), (1, 14)):
            d = next(d for d in compression.decisions if d.chunk == chunk and d.layer == layer)
            expected.append(np.sort(d.tokens, axis=-1) + offset)
        np.testing.assert_array_equal(held, np.concatenate(expected, axis=1))


def test_chunks_of_one_shape_share_one_compiled_program_each(params):
    # The layer index is traced and the memory grows in coarse steps: every chunk (here
    # within one step) and every layer runs the same three programs.
    programs = (_prefill, _teacher, _student)
    for program in programs:
        program.clear_cache()
    compression = emloc.compress(
        MODEL, params, _examples(6, seed=7), EMLoCConfig(chunk_size=2, delta=0.05)
    )
    assert len({d.chunk for d in compression.decisions}) == 3
    assert sum(len(d.tried) for d in compression.decisions) > CONFIG.num_layers
    assert [program._cache_size() for program in programs] == [1, 1, 1]


def test_bad_settings_and_inputs_are_refused(params):
    with pytest.raises(ValueError, match="ratios must be keep ratios in"):
        EMLoCConfig(ratios=(0.0, 0.5))
    with pytest.raises(ValueError, match="ratios must be keep ratios in"):
        EMLoCConfig(ratios=(0.5, 1.5))
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        EMLoCConfig(chunk_size=0)
    with pytest.raises(ValueError, match="delta must be >= 0"):
        EMLoCConfig(delta=-1.0)
    with pytest.raises(ValueError, match="chunk_size 5 is larger than the context"):
        emloc.compress(MODEL, params, _examples(3, seed=0), EMLoCConfig(chunk_size=5))
    with pytest.raises(ValueError, match="beyond the model's max_len"):
        emloc.compress(MODEL, params, _examples(20, seed=0), EMLoCConfig(chunk_size=20))
    with pytest.raises(ValueError, match="Example.answer must be bool"):
        Example(np.arange(3), np.ones(2, bool))
    scanned = dataclasses.replace(CONFIG, scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers=False"):
        emloc.empty_memory(scanned)


def test_packed_sequences_read_the_memory_as_if_each_had_a_row_of_its_own(params):
    # A memory pruned head by head, then three sequences of different lengths packed in
    # one row: each one's logits equal those of the sequence alone on the memory.
    examples = _examples(4, seed=8)
    compression = emloc.compress(MODEL, params, examples, EMLoCConfig(chunk_size=2, delta=0.05))
    memory = compression.memory
    assert any(d.ratio < 1 for d in compression.decisions), "nothing pruned: a weak test"
    start = 28
    rng = np.random.default_rng(9)
    sequences = [rng.integers(3, CONFIG.vocab_size, n).astype(np.int32) for n in (5, 3, 6)]
    alone = []
    for sequence in sequences:
        logits, _ = MODEL.apply(
            {"params": params},
            jnp.asarray(sequence[None]),
            jnp.arange(start, start + sequence.size, dtype=jnp.int32)[None],
            memory.with_tail(CONFIG, 8),
        )
        alone.append(np.asarray(logits[0]))
    tokens = np.concatenate(sequences + [np.zeros(2, np.int32)])  # two padding tokens
    positions = np.concatenate([start + np.arange(s.size) for s in sequences] + [[-1, -1]])
    segments = np.concatenate([np.full(s.size, i) for i, s in enumerate(sequences)] + [[-1, -1]])
    packed, after = MODEL.apply(
        {"params": params},
        jnp.asarray(tokens[None]),
        jnp.asarray(positions[None], jnp.int32),
        memory.with_tail(CONFIG, tokens.size).packed(segments[None]),
    )
    np.testing.assert_allclose(packed[0, :14], np.concatenate(alone), rtol=1e-5, atol=1e-5)
    assert after.segment_ids is None  # the packing held for that call only
    with pytest.raises(ValueError, match=r"segment_ids has shape \(1, 3\), the call's positions"):
        MODEL.apply(
            {"params": params},
            jnp.asarray(tokens[None]),
            jnp.asarray(positions[None], jnp.int32),
            memory.with_tail(CONFIG, tokens.size).packed(segments[None, :3]),
        )


def test_the_memory_serves_a_model_of_local_and_global_layers():
    """Gemma 3's block with a window in one of two layers: a memory that keeps every
    token (each layer's with its positions, so the window still masks them) answers as
    the whole context does."""
    config = lm.LMConfig.tiny(
        num_layers=2,
        max_len=128,
        sliding_window=6,
        full_attention_layers=(1,),
        local_rope_theta=1e4,
        qk_norm=True,
        post_norms=True,
        norm_scale_offset=1.0,
        embed_scale=True,
        mlp_type="geglu",
    )
    model = lm.Transformer(config)
    gemma_params = lm.random_params(config, 0)
    examples = _examples(3, seed=1)
    memory = emloc.baselines.uniform_memory(model, gemma_params, examples, keep=1.0)
    context = sum(len(e) for e in examples)
    query = np.array([5, 17, 33, 9], np.int32)
    tokens = np.concatenate([*(e.tokens for e in examples), query])
    full, _ = model.apply(
        {"params": gemma_params}, jnp.asarray(tokens[None]), jnp.arange(tokens.size)[None]
    )
    positions = jnp.arange(context, context + 4, dtype=jnp.int32)[None]
    on_memory, _ = model.apply(
        {"params": gemma_params}, jnp.asarray(query[None]), positions, memory.with_tail(config, 8)
    )
    np.testing.assert_allclose(on_memory, full[:, -4:], atol=1e-4)
