"""The from-scratch superposition data, checked by decoding the generated text."""

import numpy as np
import pytest

from lhc.icl import superposition
from lhc.icl.superposition import ScratchTask, mixture_prompt, training_row


def _demos(text: str):
    lines = text.split("\n")
    return [line.split(">") for line in lines[:-1]], lines[-1]


def _params_of(task, inputs: str, answer: str):
    """Every hidden parameter under which ``inputs`` gives ``answer`` (brute force)."""
    if task.kind == "bias_add":
        return {b for b in range(10) if str((int(inputs) + b) % 10) == answer}
    return {k for k in range(8) if inputs[k] == answer}


@pytest.mark.parametrize("kind", ["bias_add", "copy"])
def test_a_training_prompt_holds_one_task(kind):
    task = ScratchTask(kind=kind, demos=12)
    for seed in range(5):
        row = training_row(np.random.default_rng(seed), task)
        tokens = np.concatenate([row["tokens"][0], row["targets"][0, -1:]])
        demos, rest = _demos(bytes(tokens.astype(np.uint8)).decode())
        assert len(demos) == 12 and rest == ""
        shared = set.intersection(*(_params_of(task, x, y) for x, y in demos))
        assert len(shared) >= 1  # one hidden parameter explains every demonstration
        if kind == "copy":
            assert all(len(set(x)) == 8 for x, _ in demos)
        # Weights: the answer and its newline of every demonstration, nothing else.
        scored = bytes(row["targets"][0][row["weights"][0] > 0].astype(np.uint8)).decode()
        assert scored == "".join(y + "\n" for _, y in demos)


@pytest.mark.parametrize("kind", ["bias_add", "copy"])
def test_a_mixture_prompt_follows_its_proportion(kind):
    task = ScratchTask(kind=kind, demos=30)
    rng = np.random.default_rng(0)
    for proportion in (0.0, 0.3, 1.0):
        prompt = mixture_prompt(rng, task, proportion, params=(2, 6))
        demos, query = _demos(bytes(prompt.tokens.astype(np.uint8)).decode())
        assert query.endswith(">") and len(demos) == 30
        first = sum(
            2 in _params_of(task, x, y) and 6 not in _params_of(task, x, y) for x, y in demos
        )
        second = sum(6 in _params_of(task, x, y) for x, y in demos)
        assert (first, second) == prompt.counts
        if proportion in (0.0, 1.0):
            assert prompt.counts[0] == 30 * proportion
        query_input = query[:-1]
        for param, answer in zip((2, 6), prompt.answers):
            assert _params_of(task, query_input, chr(answer[0])) >= {param}
            assert answer[1] == ord("\n")
        assert prompt.answers[0] != prompt.answers[1]
    realised = [mixture_prompt(rng, task, 0.3).counts[0] for _ in range(200)]
    assert abs(np.mean(realised) / 30 - 0.3) < 0.03


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        ScratchTask(kind="sort")
    with pytest.raises(ValueError, match="proportion must be in"):
        mixture_prompt(np.random.default_rng(0), ScratchTask(), 1.5)
    with pytest.raises(ValueError, match="different parameters"):
        mixture_prompt(np.random.default_rng(0), ScratchTask(), 0.5, params=(3, 3))
    with pytest.raises(ValueError, match=r"parameter must be in \[0, 8\)"):
        ScratchTask(kind="copy").answer(np.arange(8), 8)
    assert superposition.KINDS == ("bias_add", "copy")
