"""The GCA model: incremental decoding against the full forward pass, causality, the
retriever's gradients and learning, the protocol (generate, truncation), bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lhc import lm
from lhc.gca import GCA, GCAConfig, gca_from_config, init_params, retrieve

# Two retrieval groups; 8-position chunks (7 text tokens and a landmark), top-2 retrieval,
# a 12-position window: 40 text tokens span 6 chunks, so later chunks retrieve from
# chunks the window no longer sees.
CONFIG = GCAConfig.tiny(upper_layers=(1, 1))
BATCH, LENGTH = 2, 40
LEFT_PAD = 3  # row 1 is left-padded
# Pieces of an incremental run: single tokens, and calls that cross chunk boundaries
# (two shapes, so two compilations).
PIECES = (9, 1) * 4


@functools.cache
def _setup(impl: str = "xla", offload: bool = False):
    config = CONFIG.replace(gca_impl=impl, offload_memory=offload)
    model = GCA(config)
    params = init_params(config.replace(offload_memory=False), jax.random.key(0))
    return model, params, jax.jit(model.apply)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size - 1, size=(BATCH, LENGTH)).astype(np.int32)
    positions = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
    positions[1] = np.concatenate([[-1] * LEFT_PAD, np.arange(LENGTH - LEFT_PAD)])
    return jnp.asarray(tokens), jnp.asarray(positions)


def _real(positions):
    return np.asarray(positions) >= 0


def _incremental(apply, params, tokens, positions, cache, pieces):
    outs, start = [], 0
    for size in pieces:
        logits, cache = apply(
            {"params": params},
            tokens[:, start : start + size],
            positions[:, start : start + size],
            cache,
        )
        outs.append(logits)
        start += size
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_incremental_decoding_equals_full_forward(offload):
    model, params, apply = _setup(offload=offload)
    tokens, positions = _batch()
    full, _ = apply({"params": params}, tokens, positions)
    assert full.shape == (BATCH, LENGTH, CONFIG.vocab_size)
    cache = model.init_cache(BATCH, 256)
    incremental, cache = _incremental(apply, params, tokens, positions, cache, PIECES)
    real = _real(positions)
    np.testing.assert_allclose(np.asarray(incremental)[real], np.asarray(full)[real], atol=2e-5)
    assert np.asarray(cache.next_positions()).tolist() == [LENGTH, LENGTH - LEFT_PAD]
    assert np.asarray(cache.num_chunks()).tolist() == [LENGTH // 7, (LENGTH - LEFT_PAD) // 7]
    # The landmark is never predicted as text.
    assert np.all(np.argmax(np.asarray(full), axis=-1) != CONFIG.landmark_id)
    # With offload, the chunk memory stays in host memory through every call.
    memory_kind = "pinned_host" if offload else jax.devices()[0].default_memory().kind
    for stored in (cache.memory_keys, cache.memory_values):
        assert stored.sharding.memory_kind == memory_kind
    assert cache.landmark_keys.sharding.memory_kind != "pinned_host"


def test_retrieval_changes_the_output_beyond_the_window():
    # The GCA path matters: with the chunk memory zeroed, the last tokens' logits (whose
    # window no longer covers the first chunks) change.
    model, params, apply = _setup()
    tokens, positions = _batch()
    cache = model.init_cache(BATCH, 256)
    _, cache = _incremental(apply, params, tokens, positions, cache, PIECES[:6])
    last = (tokens[:, 30:], positions[:, 30:])
    with_memory, _ = apply({"params": params}, *last, cache)
    emptied = cache.replace(memory_values=jnp.zeros_like(cache.memory_values))
    without, _ = apply({"params": params}, *last, emptied)
    assert np.max(np.abs(np.asarray(with_memory) - np.asarray(without))) > 1e-3


def test_causality():
    model, params, apply = _setup()
    tokens, positions = _batch()
    full, _ = apply({"params": params}, tokens, positions)
    t = 23
    changed = tokens.at[:, t:].set((tokens[:, t:] + 5) % (CONFIG.vocab_size - 1))
    other, _ = apply({"params": params}, changed, positions)
    np.testing.assert_array_equal(np.asarray(other)[:, :t], np.asarray(full)[:, :t])
    assert not np.allclose(np.asarray(other)[:, t:], np.asarray(full)[:, t:])


def test_pallas_chunk_retrieval_path_matches_xla():
    _, params, apply = _setup("xla")
    _, _, apply_pallas = _setup("pallas")
    tokens, positions = _batch()
    expected, _ = apply({"params": params}, tokens, positions)
    got, _ = apply_pallas({"params": params}, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


def test_truncation_then_reappend_equals_full_forward_of_the_new_sequence():
    model, params, apply = _setup()
    tokens, positions = _batch()
    cache = model.init_cache(BATCH, 256)
    _, cache = _incremental(apply, params, tokens, positions, cache, PIECES[:3])  # 19 tokens
    # Back to text position 12 / 9 (row 1 is 3 behind): across the landmark after text 13
    # in row 0, into the last completed chunk (positions 7..13).
    cache = cache.truncate_at_position(jnp.array([12, 9]))
    assert np.asarray(cache.next_positions()).tolist() == [12, 9]
    assert np.asarray(cache.complete).all()
    other = (tokens[:, 12:] * 3 + 1) % (CONFIG.vocab_size - 1)
    new_tokens = tokens.at[:, 12:].set(other)
    new_positions = positions
    full, _ = apply({"params": params}, new_tokens, new_positions)
    rest, _ = _incremental(
        apply, params, new_tokens[:, 12:], new_positions[:, 12:], cache, (1, 9, 18)
    )
    real = _real(new_positions[:, 12:])
    np.testing.assert_allclose(np.asarray(rest)[real], np.asarray(full)[:, 12:][real], atol=2e-5)

    # truncate(new_lengths) counts appended columns, padding included.
    cache = model.init_cache(BATCH, 256)
    _, cache = _incremental(apply, params, tokens, positions, cache, PIECES)
    by_length = cache.truncate(jnp.array([33, 33]))
    assert np.asarray(by_length.next_positions()).tolist() == [33, 33 - LEFT_PAD]
    assert np.asarray(by_length.complete).all()
    # Further back than the last completed chunk's start: the states are gone.
    too_far = cache.truncate_at_position(2)
    assert not np.asarray(too_far.complete).any()
    with pytest.raises(ValueError, match="truncated back further"):
        model.apply({"params": params}, tokens[:, 2:3], jnp.full((BATCH, 1), 2), too_far)


def test_generate_follows_the_full_forward_greedily():
    model, params, apply = _setup()
    tokens, _ = _batch()
    new = 12
    prompts = [np.asarray(tokens[0, :28]).tolist(), np.asarray(tokens[1, :21]).tolist()]
    out = lm.generate(model, params, prompts, max_new_tokens=new, cache_len=64)
    generated = np.asarray(out.tokens)
    # One full forward over both sequences (the second right-padded): each generated
    # token is the argmax after the tokens before it.
    sequences = np.zeros((BATCH, LENGTH), np.int32)
    positions = np.full((BATCH, LENGTH), -1, np.int32)
    for row, (prompt, continuation) in enumerate(zip(prompts, generated)):
        sequence = prompt + continuation.tolist()
        sequences[row, : len(sequence)] = sequence
        positions[row, : len(sequence)] = np.arange(len(sequence))
    logits, _ = apply({"params": params}, jnp.asarray(sequences), jnp.asarray(positions))
    for row, prompt in enumerate(prompts):
        greedy = np.argmax(np.asarray(logits[row, len(prompt) - 1 : len(prompt) + new - 1]), -1)
        np.testing.assert_array_equal(greedy, generated[row])


# --------------------------------------------------------------------------------------
# The retriever.
# --------------------------------------------------------------------------------------


def test_gradients_reach_the_retriever_through_the_fusion_weights():
    _, params, _ = _setup()
    model = GCA(CONFIG)
    tokens, positions = _batch()
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(params, rng):
        logits, _ = model.apply({"params": params}, tokens, positions, rngs={"train": rng})
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    grads = jax.jit(jax.grad(loss))(params, jax.random.key(1))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    # The landmark norms act only on the retrieval queries, which reach the loss only
    # through the fusion weights (the indices carry no gradient).
    for group in range(CONFIG.num_groups):
        assert np.max(np.abs(grads[f"landmark_norm_{group}"]["scale"])) > 0
    for name in ("chunk_key", "chunk_value"):
        assert np.max(np.abs(grads[name]["kernel"])) > 0
    assert np.max(np.abs(grads["upper_0_0"]["gca"]["query"]["kernel"])) > 0


def _retrieve_brute_force(queries, keys, query_chunks, valid, top_k):
    queries, keys = np.asarray(queries, np.float64), np.asarray(keys, np.float64)
    batch, num_queries, dim = queries.shape
    indices = np.full((batch, num_queries, top_k), -1)
    weights = np.zeros((batch, num_queries, top_k))
    for b in range(batch):
        for m in range(num_queries):
            visible = list(range(min(query_chunks[b, m], keys.shape[1]))) if valid[b, m] else []
            scores = {j: queries[b, m] @ keys[b, j] / np.sqrt(dim) for j in visible}
            chosen = sorted(scores, key=lambda j: -scores[j])[:top_k]
            if chosen:
                e = np.exp(np.array([scores[j] for j in chosen]) - max(scores.values()))
                indices[b, m, : len(chosen)] = chosen
                weights[b, m, : len(chosen)] = e / e.sum()
    return indices, weights


def test_retrieve_matches_brute_force():
    rng = np.random.default_rng(0)
    batch, num_queries, num_chunks, dim, top_k = 2, 5, 6, 8, 3
    queries = rng.standard_normal((batch, num_queries, dim)).astype(np.float32)
    keys = rng.standard_normal((batch, num_chunks, dim)).astype(np.float32)
    # Chunk 0 sees nothing, chunk 2 fewer than top_k, the last query is invalid.
    query_chunks = np.tile(np.array([0, 2, 4, 5, 6]), (batch, 1))
    valid = np.ones((batch, num_queries), bool)
    valid[:, -1] = False
    indices, weights = retrieve(
        jnp.asarray(queries),
        jnp.asarray(keys),
        jnp.asarray(query_chunks),
        jnp.asarray(valid),
        top_k=top_k,
    )
    want_indices, want_weights = _retrieve_brute_force(queries, keys, query_chunks, valid, top_k)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_allclose(np.asarray(weights), want_weights, atol=1e-6)
    # More slots than stored chunks: the extra slots are empty.
    indices, _ = retrieve(
        jnp.asarray(queries),
        jnp.asarray(keys[:, :2]),
        jnp.asarray(query_chunks),
        jnp.asarray(valid),
        top_k=top_k,
    )
    assert np.all(np.asarray(indices)[..., 2] == -1)


def test_retrieval_learns_to_pick_the_needle_chunk():
    # A toy of GCA's retriever: 16 chunks with fixed random landmark keys; the query is a
    # learned linear map of a context vector that is a noisy copy of the needle chunk's
    # key. The only training signal is the fusion weight on the needle (the loss GCA's
    # LM loss reduces to when only the needle chunk predicts the next token), with
    # Gumbel noise on the selection as in training. The retriever starts at chance.
    num_chunks, dim, top_k, batch = 16, 16, 2, 64
    keys = jax.random.normal(jax.random.key(0), (num_chunks, dim))

    def sample(rng):
        needle_rng, noise_rng = jax.random.split(rng)
        needle = jax.random.randint(needle_rng, (batch,), 0, num_chunks)
        context = keys[needle] + 0.3 * jax.random.normal(noise_rng, (batch, dim))
        return needle, context

    def retrieval(w, context, rng=None):
        queries = (context @ w)[:, None]
        return retrieve(
            queries,
            jnp.broadcast_to(keys, (batch, num_chunks, dim)),
            jnp.full((batch, 1), num_chunks),
            jnp.ones((batch, 1), bool),
            top_k=top_k,
            noise_rng=rng,
        )

    def loss(w, rng):
        data_rng, noise_rng = jax.random.split(rng)
        needle, context = sample(data_rng)
        indices, weights = retrieval(w, context, noise_rng)
        on_needle = jnp.sum(jnp.where(indices[:, 0] == needle[:, None], weights[:, 0], 0), -1)
        return -jnp.mean(jnp.log(on_needle + 1e-3))

    def accuracy(w):
        needle, context = sample(jax.random.key(99))
        indices, _ = retrieval(w, context)
        return float(jnp.mean(indices[:, 0, 0] == needle))

    w = jnp.zeros((dim, dim))
    optimizer = optax.adam(0.05)
    state = optimizer.init(w)

    @jax.jit
    def step(w, state, rng):
        grads = jax.grad(loss)(w, rng)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(w, updates), state

    before = accuracy(w)
    for i in range(300):
        w, state = step(w, state, jax.random.key(i + 1))
    after = accuracy(w)
    assert before <= 0.2 and after >= 0.95, (before, after)


# --------------------------------------------------------------------------------------
# Protocol plumbing and bad input.
# --------------------------------------------------------------------------------------


def test_model_factory_builds_from_a_config_dict():
    import ml_collections

    model = gca_from_config(ml_collections.ConfigDict(CONFIG.to_dict()))
    assert isinstance(model, GCA) and model.config == CONFIG
    with pytest.raises(ValueError, match="unknown GCAConfig keys"):
        gca_from_config({**CONFIG.to_dict(), "num_layers": 2})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(upper_layers=()), "upper_layers must be a non-empty sequence"),
        (dict(num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads"),
        (dict(chunk_size=1), "chunk_size must be >= 2"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(landmark_id=64), "landmark_id must be None or an int in"),
        (dict(gca_impl="triton"), "gca_impl must be one of"),
        (dict(head_dim=7), "head_dim must be even"),
    ],
)
def test_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        CONFIG.replace(**overrides)


def test_bad_inputs_raise():
    model, params, _ = _setup()
    tokens, positions = _batch()
    variables = {"params": params}
    with pytest.raises(ValueError, match="must not be the landmark id"):
        model.apply(variables, tokens.at[0, 3].set(CONFIG.landmark_id), positions)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=64\)"):
        model.apply(variables, tokens.at[0, 3].set(64), positions)
    with pytest.raises(ValueError, match="positions of row 0 must run contiguously from 0"):
        model.apply(variables, tokens, positions + 1)
    with pytest.raises(ValueError, match="tokens and positions must both be int"):
        model.apply(variables, tokens, positions[:, :-1])
    cache = model.init_cache(BATCH, 64)
    with pytest.raises(ValueError, match="the cache's next position 0"):
        model.apply(variables, tokens[:, 5:7], positions[:, 5:7], cache)
    with pytest.raises(ValueError, match="exceeds the model's max_len 64"):
        model.apply(
            variables, jnp.zeros((BATCH, 65), jnp.int32), jnp.tile(jnp.arange(65), (2, 1)), cache
        )
    with pytest.raises(ValueError, match="cache must be None or a GCACache"):
        model.apply(variables, tokens, positions, lm.init_cache(lm.LMConfig.tiny(), BATCH, 64))
    with pytest.raises(ValueError, match="init_cache: max_len must be an int in"):
        model.init_cache(BATCH, CONFIG.max_len + 1)


def test_retriever_ablations():
    """``no_grad``: no gradient into the retriever's scores (the rest still learns);
    ``mean_pool``: chunks retrieved by the cosine similarity of their unit-length pooled
    representations (the closing chunk's against each earlier one), brute-forced here
    from the cache."""
    _, params, _ = _setup()
    tokens, positions = _batch()
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(params):
        logits, _ = GCA(CONFIG.replace(retriever="no_grad")).apply(
            {"params": params}, tokens, positions
        )
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    grads = jax.jit(jax.grad(loss))(params)
    for group in range(CONFIG.num_groups):
        assert np.max(np.abs(grads[f"landmark_norm_{group}"]["scale"])) == 0
    assert np.max(np.abs(grads["upper_0_0"]["gca"]["query"]["kernel"])) > 0

    config = CONFIG.replace(retriever="mean_pool")
    model, pooled_params = GCA(config), init_params(config, jax.random.key(0))
    assert not any(name.startswith("landmark_norm") for name in pooled_params)
    _, cache = model.apply(
        {"params": pooled_params}, tokens, positions, model.init_cache(BATCH, 256)
    )
    keys = np.asarray(cache.landmark_keys, np.float64)
    chunks = np.asarray(cache.retrieval_chunks)
    indices = np.asarray(cache.retrieval_indices)  # [B, groups, rows, top_k]
    assert chunks.min() >= CONFIG.top_k  # every retrieval has a choice to make
    for b in range(BATCH):
        assert np.allclose(np.linalg.norm(keys[b, : chunks[b].max() + 1], axis=-1), 1, atol=1e-5)
        for row, closing in enumerate(chunks[b]):
            cosine = keys[b, :closing] @ keys[b, closing]
            want = sorted(np.argsort(-cosine)[: CONFIG.top_k].tolist())
            for group in range(CONFIG.num_groups):
                assert sorted(indices[b, group, row].tolist()) == want, (b, row, group)
