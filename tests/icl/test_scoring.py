"""Teacher-forced answer probabilities, patches and task vectors against the float64
numpy decoder, run one sequence (and one answer token) at a time."""

import numpy as np
import pytest
from scipy.special import log_softmax

from lhc.icl import scoring, taskvectors

from ..support import forward
from .conftest import CONFIG

RNG = np.random.default_rng(7)
PROMPTS = [list(RNG.integers(0, CONFIG.vocab_size, n)) for n in (5, 9, 3)]
ANSWERS = [[list(RNG.integers(0, CONFIG.vocab_size, n)) for n in (1, 3)] for _ in PROMPTS]


def _numpy_logprob(params, prompt, answer, residual_add=None):
    """Sum over answer tokens of log p(token | prompt, earlier answer tokens), each from
    its own forward pass of the numpy decoder."""
    total = 0.0
    for j, token in enumerate(answer):
        length = len(prompt) + j
        add = {k: v[:length] for k, v in (residual_add or {}).items()}
        logits = forward(CONFIG, params, prompt + answer[:j], residual_add=add)
        total += log_softmax(logits[-1])[token]
    return total


def test_answer_probabilities_are_products_of_per_token_probabilities(tiny):
    model, params = tiny
    got = scoring.answer_probabilities(model, params, PROMPTS, ANSWERS, batch_size=4)
    want = np.exp(
        [[_numpy_logprob(params, p, a) for a in group] for p, group in zip(PROMPTS, ANSWERS)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-4)
    other = scoring.with_other(got)[:, -1]
    np.testing.assert_allclose(other, 1 - want.sum(1), rtol=1e-4, atol=1e-12)


def test_a_replace_patch_at_the_last_prompt_token(tiny):
    """Replacing the residual after layer 1 at the prompt's last token by v == adding
    v - (the unedited residual there) in the numpy decoder."""
    model, params = tiny
    layer = 1
    vectors = RNG.normal(size=(CONFIG.num_layers, CONFIG.embed_dim))
    got = taskvectors.patched_probabilities(model, params, vectors, layer, PROMPTS, ANSWERS)
    for i, prompt in enumerate(PROMPTS):
        states = {}
        forward(CONFIG, params, prompt, states=states)
        delta = np.zeros((len(prompt) + 3, CONFIG.embed_dim))
        delta[len(prompt) - 1] = vectors[layer] - states["residual", layer][-1]
        for k, answer in enumerate(ANSWERS[i]):
            want = np.exp(_numpy_logprob(params, prompt, answer, residual_add={layer: delta}))
            np.testing.assert_allclose(got[i, k], want, rtol=1e-4)


def test_task_vector_is_the_mean_last_token_residual(tiny):
    model, params = tiny
    got = taskvectors.task_vector(model, params, PROMPTS, batch_size=2)
    states = [{} for _ in PROMPTS]
    for prompt, s in zip(PROMPTS, states):
        forward(CONFIG, params, prompt, states=s)
    for layer in range(CONFIG.num_layers):
        want = np.mean([s["residual", layer][-1] for s in states], axis=0)
        np.testing.assert_allclose(got[layer], want, rtol=1e-4, atol=1e-5)


def test_best_layer_scores_each_layer_by_its_patch(tiny):
    model, params = tiny
    vectors = taskvectors.task_vector(model, params, PROMPTS)
    layer, scores = taskvectors.best_layer(model, params, vectors, PROMPTS, ANSWERS, task=1)
    assert scores.shape == (CONFIG.num_layers,) and layer == int(np.argmax(scores))
    for candidate in range(CONFIG.num_layers):
        probs = []
        for i, prompt in enumerate(PROMPTS):
            states = {}
            forward(CONFIG, params, prompt, states=states)
            delta = np.zeros((len(prompt) + 2, CONFIG.embed_dim))
            delta[len(prompt) - 1] = vectors[candidate] - states["residual", candidate][-1]
            add = {candidate: delta}
            probs.append(np.exp(_numpy_logprob(params, prompt, ANSWERS[i][1], residual_add=add)))
        np.testing.assert_allclose(scores[candidate], np.mean(probs), rtol=1e-4)


def test_kl_and_composition_closed_forms():
    probs = np.array([[0.5, 0.25], [0.1, 0.1]])
    d = [0.5, 0.5]
    want = [0.5 * np.log(0.5 / 0.5) + 0.5 * np.log(0.5 / 0.25), 2 * 0.5 * np.log(0.5 / 0.1)]
    np.testing.assert_allclose(scoring.kl_to_proportions(probs, d), want)
    assert scoring.kl_to_proportions(np.array([0.7, 0.1]), [1.0, 0.0]) == pytest.approx(
        np.log(1 / 0.7)
    )
    vectors = np.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(
        taskvectors.compose(vectors, [0.2, 0.3, 0.5]),
        0.2 * vectors[0] + 0.3 * vectors[1] + 0.5 * vectors[2],
    )
    with pytest.raises(ValueError, match="non-negative and sum to 1"):
        taskvectors.compose(vectors, [0.5, 0.6, -0.1])
    with pytest.raises(ValueError, match=r"weights must be \[3\]"):
        taskvectors.compose(vectors, [0.5, 0.5])
    with pytest.raises(ValueError, match="sum to 1"):
        scoring.kl_to_proportions(probs, [0.5, 0.6])


def test_bad_input_is_refused(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="2 prompts, 1 continuations"):
        scoring.continuation_logprobs(model, params, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="pair 0: the prompt and the continuation must not"):
        scoring.continuation_logprobs(model, params, [[]], [[3]])
    with pytest.raises(ValueError, match="beyond the model's max_len 64"):
        scoring.continuation_logprobs(model, params, [[1] * 60], [[2] * 5])
    with pytest.raises(ValueError, match=r"layer 3 lies outside \[0, num_layers=3\)"):
        taskvectors.patched_probabilities(model, params, np.zeros((3, 32)), 3, PROMPTS, ANSWERS)
    with pytest.raises(ValueError, match="same number of answers"):
        scoring.answer_probabilities(model, params, PROMPTS[:2], [[[1]], [[1], [2]]])
