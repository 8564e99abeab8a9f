"""Iterative Vectors and the Task Vectors baseline against a direct computation with the
float64 numpy decoder, one prompt and one episode at a time."""

import numpy as np
import pytest

from lhc.icl import iterative
from lhc.icl.config import ExtractConfig
from lhc.icl.iterative import Examples, Format, build_prompt

from ..support import forward
from .conftest import CONFIG

FMT = Format(labels=((90,), (91, 7)), separator=10, block=(11, 11))


def _examples(count=8, seed=0):
    rng = np.random.default_rng(seed)
    inputs = [list(rng.integers(20, 80, rng.integers(2, 4))) for _ in range(count)]
    return Examples(inputs, [i % 2 for i in range(count)], 2)


def _numpy_attention(params, tokens, at, adds):
    """Attention outputs [L, K, D] at ``at`` with {layer: [T, D]} added there."""
    states = {}
    logits = forward(CONFIG, params, tokens, attention_add=adds, states=states)
    return np.stack([states["attention", i][at] for i in range(CONFIG.num_layers)]), logits


def _adds(prompt, classes, vectors, strength):
    if vectors is None:
        return {}
    dense = np.zeros((CONFIG.num_layers, len(prompt.tokens), CONFIG.embed_dim))
    for k, sep in enumerate(prompt.separators):
        which = classes[k] if k < len(classes) else -1
        dense[:, sep] = strength * vectors[which]
    return dict(enumerate(dense))


def test_extraction_against_a_direct_computation(tiny):
    model, params = tiny
    train = _examples()
    config = ExtractConfig(ext_shot=1, ext_strength=0.7, episodes=4, ext_batch=2, seed=3)
    got = iterative.extract(model, params, FMT, train, config)
    # The same episodes, drawn in the same order; the released loop, one episode at a time.
    rng = np.random.default_rng(3)
    episodes = [train.episode(rng, 1) for _ in range(4)]
    vectors, collected = None, []
    for index, (support, (query, label)) in enumerate(episodes):
        prompt = build_prompt(FMT, support, query, label)
        classes = [c for _, c in support]
        pos, _ = _numpy_attention(
            params, prompt.tokens, prompt.separators, _adds(prompt, classes, vectors, 0.7)
        )
        alone = build_prompt(FMT, [], query, label)
        neg, _ = _numpy_attention(params, alone.tokens, alone.separators - 1, {})
        diff = pos - neg  # [L, K, D]
        per_class = [
            diff[:, [k for k, c in enumerate(classes) if c == cls]].mean(1) for cls in range(2)
        ]
        collected.append(np.stack(per_class + [diff[:, -1]]))
        if index % 2 == 0 or index == 3:
            vectors = np.mean(collected, axis=0)
    assert got.shape == (3, CONFIG.num_layers, CONFIG.embed_dim)
    np.testing.assert_allclose(got, vectors, rtol=1e-4, atol=1e-5)


def test_prediction_with_vectors_against_the_numpy_decoder(tiny):
    model, params = tiny
    vectors = np.random.default_rng(1).normal(size=(3, CONFIG.num_layers, CONFIG.embed_dim))
    episodes = iterative.evaluation_episodes(_examples(), 2, 6, seed=5)
    got = iterative.predict(model, params, FMT, episodes, vectors, strength=0.9, batch_size=4)
    for (support, (query, _)), guess in zip(episodes, got):
        prompt = build_prompt(FMT, support, query)
        adds = _adds(prompt, [c for _, c in support], vectors, 0.9)
        _, logits = _numpy_attention(params, prompt.tokens, prompt.separators, adds)
        assert guess == np.argmax(logits[prompt.separators[-1], [90, 91]])


def test_task_vectors_baseline(tiny):
    model, params = tiny
    train = _examples()
    tv = iterative.TaskVectors.extract(
        model, params, FMT, train, shots=1, episodes=5, seed=2, batch_size=2
    )
    rng = np.random.default_rng(2)
    states_at_query = []
    for support, (query, _) in [train.episode(rng, 1) for _ in range(5)]:
        prompt = build_prompt(FMT, support, query)
        states = {}
        forward(CONFIG, params, prompt.tokens, states=states)
        states_at_query.append(
            [states["residual", i][prompt.separators[-1]] for i in range(CONFIG.num_layers)]
        )
    np.testing.assert_allclose(tv.vectors, np.mean(states_at_query, 0), rtol=1e-4, atol=1e-5)
    validation = iterative.evaluation_episodes(train, 1, 8, seed=9)
    scores = tv.choose_layer(model, params, FMT, validation)
    assert len(scores) == CONFIG.num_layers and tv.layer == int(np.argmax(scores))


def test_task_vector_patch_at_every_layer_against_the_numpy_decoder(tiny):
    # The cached layer search (prompt prefilled once, the separator run per layer) against
    # full passes of the float64 decoder with the residual there replaced.
    model, params = tiny
    train = _examples(count=10)
    vectors = np.random.default_rng(3).normal(size=(CONFIG.num_layers, CONFIG.embed_dim))
    tv = iterative.TaskVectors(vectors)
    episodes = iterative.evaluation_episodes(train, 1, 5, seed=4)
    logits = iterative.separator_logits(
        model, params, FMT, episodes, vectors, range(CONFIG.num_layers), batch_size=2
    )
    assert logits.shape == (1 + CONFIG.num_layers, 5, 2)
    np.testing.assert_allclose(tv.layer_logits(model, params, FMT, episodes), logits, atol=1e-4)
    for e, (support, (query, _)) in enumerate(episodes):
        prompt = build_prompt(FMT, support, query)
        sep = prompt.separators[-1]
        states = {}
        plain = forward(CONFIG, params, prompt.tokens, states=states)
        np.testing.assert_allclose(logits[0, e], plain[sep, [90, 91]], rtol=1e-4, atol=1e-4)
        for layer in range(CONFIG.num_layers):
            delta = np.zeros((len(prompt.tokens), CONFIG.embed_dim))
            delta[sep] = vectors[layer] - states["residual", layer][sep]
            expected = forward(CONFIG, params, prompt.tokens, residual_add={layer: delta})
            np.testing.assert_allclose(
                logits[1 + layer, e], expected[sep, [90, 91]], rtol=1e-4, atol=1e-4
            )


def test_macro_f1_matches_scikit_learn():
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    for _ in range(5):
        true, predicted = rng.integers(0, 4, 30), rng.integers(0, 4, 30)
        predicted[predicted == 3] = 2  # a class never predicted
        want = f1_score(true, predicted, average="macro", labels=range(4), zero_division=0)
        assert iterative.macro_f1(predicted, true, 4) == pytest.approx(want)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="first tokens must differ"):
        Format(labels=((5, 1), (5, 2)), separator=10, block=(11,))
    with pytest.raises(ValueError, match=r"classes \[1\] have fewer than 2 examples"):
        Examples([[1], [2], [3]], [0, 0, 1], 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        iterative.extract(None, None, FMT, _examples(), ExtractConfig(episodes=0))


def test_evaluation_episodes_with_every_input_the_query_once():
    inputs = [[20 + i, 30 + i] for i in range(9)]  # distinct inputs, told apart by value
    examples = Examples(inputs, [i % 3 for i in range(9)], 3)
    episodes = iterative.evaluation_episodes(examples, 2, None, seed=1)
    queries = [tuple(int(t) for t in query) for _, (query, _) in episodes]
    assert sorted(queries) == sorted(tuple(x) for x in inputs)
    for support, (query, query_class) in episodes:
        assert query_class == (int(query[0]) - 20) % 3
        shown = [tuple(int(t) for t in x) for x, _ in support]
        assert tuple(int(t) for t in query) not in shown and len(set(shown)) == 6
        assert sorted(c for _, c in support) == [0, 0, 1, 1, 2, 2]
    assert queries != [tuple(x) for x in inputs]  # shuffled


def test_prompts_start_with_bos_for_a_tokenizer_that_adds_one():
    from lhc.data.word_tasks import TASKS
    from lhc.icl.classification import text_format

    class Chars:  # one token per character (surrounding spaces dropped)
        bos_id = 1

        def __init__(self, add_bos_token):
            self.add_bos_token = add_bos_token

        def encode(self, text):
            return [ord(c) for c in (text.strip() or text)]

    task = TASKS["sentiment-letters"]
    plain = text_format(Chars(False), task)
    fmt = text_format(Chars(True), task)
    assert plain.prefix == () and fmt.prefix == (1,)
    support = [([70, 71], 0), ([72], 1)]
    with_bos, without = build_prompt(fmt, support, [73], 1), build_prompt(plain, support, [73], 1)
    assert with_bos.tokens.tolist() == [1, *without.tokens.tolist()]
    assert (with_bos.separators == without.separators + 1).all()
    assert with_bos.tokens[with_bos.separators].tolist() == [ord(":")] * 3
