"""lhc.icl.mixtures: tokenized superposition prompts and the statistics of the paper's
measurement, against direct computations."""

import numpy as np
import pytest

from lhc import lm
from lhc.icl import mixtures
from lhc.icl.families import Family, get_family

BYTES = lm.ByteTokenizer()


def test_token_prompts_decode_to_the_prompt_and_distinct_first_tokens():
    family = get_family("copy")
    tasks = ["sum", "copy_a", "copy_b"]
    rng = np.random.default_rng(0)
    prompts = mixtures.token_prompts(rng, family, tasks, {"sum": 0.5, "copy_a": 0.5}, 6, 20, BYTES)
    assert len(prompts) == 20
    for prompt in prompts:
        text = BYTES.decode(prompt.tokens)
        assert text.endswith("=") and text.count("\n") == 6
        assert prompt.counts == {"copy_a": 3, "copy_b": 0, "sum": 3}
        a, b = map(int, text.split("\n")[-1][:-1].split("@"))
        answers = [BYTES.decode(answer) for answer in prompt.answers]
        assert answers == [f"{a + b}\n", f"{a}\n", f"{b}\n"]
        assert len({answer[0] for answer in prompt.answers}) == 3


def test_token_prompts_refuse_tasks_that_always_start_alike():
    same = Family("same", ("a", "b"), "->", lambda rng: ("x", {"a": "x1", "b": "x2"}))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="tasks a, b of family 'same': no query in 5 draws"):
        mixtures.token_prompts(rng, same, ["a", "b"], {"a": 1.0}, 2, 1, BYTES, tries=5)
    with pytest.raises(ValueError, match=r"tasks: expected distinct tasks of family 'same' \(a, b"):
        mixtures.token_prompts(rng, same, ["a", "c"], {"a": 1.0}, 2, 1, BYTES)


def test_spread_and_top_k_share():
    probs = np.array([[0.5, 0.1, 0.0], [0.9, 0.05, 0.05], [0.2, 0.3, 0.4], [0.0, 0.0, 0.0]])
    assert mixtures.spread(probs) == 0.5  # rows 0 and 2 have two or more entries >= 0.1
    assert mixtures.spread(probs, at=0.3) == 0.25
    # K = 3: a prompt counts when its three answers are the three most probable tokens.
    ranks = np.array([[0, 1, 2], [2, 0, 1], [0, 1, 3], [5, 0, 1]])
    assert mixtures.top_k_share(ranks) == 0.5
    assert mixtures.top_k_share(ranks[:, :2]) == 0.5  # K = 2: rows 0 and 2
    assert mixtures.top_k_share(np.array([[0, 1]])) == 1.0


def test_sweep_proportions_and_calibration():
    shares = [0.0, 0.25, 0.5, 0.75, 1.0]
    proportions = mixtures.sweep_proportions(3, shares)
    np.testing.assert_allclose(proportions[1], [0.25, 0.375, 0.375])
    np.testing.assert_allclose(proportions.sum(1), 1)
    # A model that follows the mixture exactly, at half the mass (the rest "other").
    exact = mixtures.calibration(proportions, 0.5 * proportions)
    assert exact["grows"] == exact["monotone"] == [True] * 3
    assert exact["r"] == pytest.approx(1) and exact["slope"] == pytest.approx(1)
    # One that always answers task 0 a little more as its share falls.
    probs = np.stack([np.linspace(0.6, 0.5, 5), np.full(5, 0.2), np.full(5, 0.2)], axis=1)
    flat = mixtures.calibration(proportions, probs)
    assert flat["grows"] == [False, False, False] and flat["monotone"] == [False, True, True]
    x, y = proportions.ravel(), (probs / probs.sum(1, keepdims=True)).ravel()
    assert flat["r"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert flat["slope"] == pytest.approx(np.polyfit(x, y, 1)[0])
    with pytest.raises(ValueError, match=r"sweep: expected >= 2 tasks and shares in \[0, 1\]"):
        mixtures.sweep_proportions(2, [0.5, 1.5])
