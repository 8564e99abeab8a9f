"""RAPID's retrieval: BM25 against its formula in numpy, the budget rule, the threshold,
document order, dense retrieval with an lhc model's pooled hidden states, bad input."""

import math

import flax.linen as nn
import jax
import numpy as np
import pytest

from lhc import lm
from lhc.rapid import (
    RetrievalConfig,
    bm25_scores,
    chunk_tokens,
    pooled_hidden_states,
    rag_prompt,
    retrieval_budget,
    select_chunks,
    word_terms,
)
from lhc.train.passkey import NEEDLE, QUESTION, Filler


def _lucene_bm25(docs, query, k1=1.5, b=0.75):
    """BM25 as Lucene computes it, query term by query term."""
    n = len(docs)
    average = sum(len(d) for d in docs) / n
    scores = np.zeros(n)
    for term in query:  # a repeated query term counts each time, as in Lucene
        df = sum(term in d for d in docs)
        if df == 0:
            continue
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        for i, doc in enumerate(docs):
            tf = doc.count(term)
            scores[i] += idf * tf / (tf + k1 * (1 - b + b * len(doc) / average))
    return scores


def test_bm25_scores_are_lucene_bm25():
    rng = np.random.default_rng(0)
    docs = [[f"t{x}" for x in rng.integers(0, 12, size=rng.integers(3, 20))] for _ in range(7)]
    query = ["t1", "t3", "t3", "t11", "unseen"]
    np.testing.assert_allclose(bm25_scores(docs, query), _lucene_bm25(docs, query), rtol=1e-5)
    np.testing.assert_allclose(
        bm25_scores(docs, ["t2"], k1=0.9, b=0.3), _lucene_bm25(docs, ["t2"], 0.9, 0.3), rtol=1e-5
    )
    assert not bm25_scores(docs, ["unseen"]).any()


def test_budget_rule():
    assert retrieval_budget(10_000) == 4096
    assert retrieval_budget(4096 * 24 + 1) == 4097
    assert retrieval_budget(1_000_000, min_budget=8192, ratio=32) == 31_250
    assert retrieval_budget(100, min_budget=16, ratio=4) == 25
    # The paper's defaults: 4096 tokens, lambda 24, similarity threshold 0.3 (dense).
    assert RetrievalConfig(method="dense").score_floor == 0.3
    assert RetrievalConfig().score_floor == 0.0 and RetrievalConfig(threshold=-1).score_floor == -1
    assert (RetrievalConfig().min_budget, RetrievalConfig().ratio) == (4096, 24.0)


def test_chunks_by_count_and_at_boundaries():
    tokens = [1, 2, 0, 3, 4, 5, 6, 7, 0, 8, 9]
    assert [c.tolist() for c in chunk_tokens(tokens, 4)] == [[1, 2, 0, 3], [4, 5, 6, 7], [0, 8, 9]]
    # Each chunk ends after its window's last boundary token (0); none in the window:
    # a full chunk.
    want = [[1, 2, 0], [3, 4, 5, 6], [7, 0, 8, 9]]  # the last window reaches the end
    assert [c.tolist() for c in chunk_tokens(tokens, 4, boundaries=[0])] == want
    assert [c.tolist() for c in chunk_tokens(tokens, 100, boundaries=[0])] == [tokens]


def test_selection_takes_the_best_within_budget_in_document_order():
    scores = np.array([0.5, 0.9, 0.1, 0.9, 0.7, -0.2])
    lengths = [4, 4, 4, 4, 4, 2]
    # Best first (ties to the earlier chunk): 1, 3, then 4; sorted back to document order.
    np.testing.assert_array_equal(select_chunks(scores, lengths, 12, -1.0), [1, 3, 4])
    # A chunk that would overflow is skipped, a shorter one still fits.
    np.testing.assert_array_equal(select_chunks(scores, lengths, 14, -1.0), [1, 3, 4, 5])
    np.testing.assert_array_equal(select_chunks(scores, [4, 4, 4, 4, 7, 2], 14, -1.0), [0, 1, 3, 5])
    # The threshold drops chunks however much budget is left.
    np.testing.assert_array_equal(select_chunks(scores, lengths, 100, 0.6), [1, 3, 4])
    np.testing.assert_array_equal(select_chunks(scores, lengths, 100, 0.0), [0, 1, 2, 3, 4])


def _needle_context(tokenizer, length, at, key=12345, seed=0):
    filler = Filler().tokens(tokenizer, np.random.default_rng(seed), length)
    return filler[:at] + tokenizer.encode(NEEDLE.format(key=key)) + filler[at:]


def test_bm25_finds_the_needle_and_builds_the_prompt():
    tokenizer = lm.ByteTokenizer()
    context = _needle_context(tokenizer, 6000, at=3000)
    question = tokenizer.encode(QUESTION)
    separator = tokenizer.encode("\n\n")
    config = RetrievalConfig(chunk_size=200, min_budget=700, ratio=24, threshold=0.5)
    prompt = rag_prompt(
        context,
        question,
        config,
        terms=word_terms(tokenizer.decode),
        prefix=[257],
        separator=separator,
    )
    chunks = chunk_tokens(context, 200)
    needle = 3000 // 200
    # Only the chunks holding the needle's words score above the threshold.
    assert needle in prompt.chunks and all(prompt.scores[c] >= 0.5 for c in prompt.chunks)
    assert prompt.budget == 700
    want = [257]
    for i, index in enumerate(prompt.chunks):
        if i and index != prompt.chunks[i - 1] + 1:
            want += separator
        want += list(chunks[index])
    want += separator + question
    np.testing.assert_array_equal(prompt.tokens, want)
    assert len(prompt.tokens) <= 700 + len(separator) * len(prompt.chunks)
    assert str(12345) in tokenizer.decode(prompt.tokens.tolist())
    # Without a threshold the budget fills up with the best remaining chunks.
    loose = rag_prompt(
        context,
        question,
        RetrievalConfig(chunk_size=200, min_budget=700),
        terms=word_terms(tokenizer.decode),
    )
    used = sum(chunks[c].size for c in loose.chunks)
    left_out = set(range(len(chunks))) - set(loose.chunks.tolist())
    assert used <= 700 - len(question) and needle in loose.chunks
    assert all(chunks[c].size > 700 - len(question) - used for c in left_out)


def test_dense_retrieval_with_pooled_hidden_states():
    config = lm.LMConfig.tiny(vocab_size=32, max_len=64, tie_embeddings=True)
    model = lm.Transformer(config)
    variables = model.init(
        jax.random.key(0), np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32)
    )
    params = nn.meta.unbox(variables["params"])
    embed = pooled_hidden_states(model, params, batch_size=2)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 32, size=n) for n in (5, 9, 3)]
    got = embed(sequences)
    # With tied embeddings the logits are the final norm's output times the table: the
    # mean of a sequence's logits is its pooled state times the table.
    table = np.asarray(params["embed"]["embedding"])
    for sequence, pooled in list(zip(sequences, got))[:2]:  # the first is padded to 9
        logits, _ = model.apply({"params": params}, sequence[None], np.arange(sequence.size)[None])
        np.testing.assert_allclose(
            pooled @ table.T, np.asarray(logits[0]).mean(0), rtol=1e-4, atol=1e-4
        )
    # Dense retrieval ranks a chunk equal to the question first.
    context = np.concatenate([rng.integers(0, 32, size=16) for _ in range(4)])
    question = context[32:48]
    prompt = rag_prompt(
        context,
        question,
        RetrievalConfig(chunk_size=16, method="dense", min_budget=32, threshold=-1.0),
        embed=embed,
    )
    assert int(np.argmax(prompt.scores)) == 2 and 2 in prompt.chunks
    np.testing.assert_allclose(prompt.scores[2], 1.0, atol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        rag_prompt([], [1, 2])
    with pytest.raises(ValueError, match="at least one token"):
        rag_prompt([1, 2, 3], [])
    with pytest.raises(ValueError, match="longer than the retrieval budget of 16"):
        rag_prompt(list(range(40)), list(range(17)), RetrievalConfig(min_budget=16))
    with pytest.raises(ValueError, match="embedding function"):
        rag_prompt([1, 2, 3], [1], RetrievalConfig(method="dense"))
    with pytest.raises(ValueError, match="method"):
        RetrievalConfig(method="tfidf")
    with pytest.raises(ValueError, match="chunk_size"):
        RetrievalConfig(chunk_size=0)
