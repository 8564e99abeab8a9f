"""The word tasks: classes that do not share an input, disjoint parts that cover every
input, balanced sampling that repeats an input only when it must."""

import collections

import numpy as np
import pytest

from lhc.data import word_tasks
from lhc.data.word_tasks import PARTS, TASKS


@pytest.mark.parametrize("name", sorted(TASKS))
def test_classes_and_parts(name):
    task = TASKS[name]
    texts = [t for group in task.inputs for t in group]
    assert len(set(texts)) == len(texts), "an input in two classes, or twice in one"
    assert len(task.label_texts()) == task.num_classes and all(
        label.startswith(" ") for label in task.label_texts()
    )
    for seed in (0, 1):
        parts = [task.part(which, seed) for which in PARTS]
        for c, group in enumerate(task.inputs):
            pieces = [set(p.inputs[c]) for p in parts]
            assert sorted(set.union(*pieces)) == sorted(group)
            assert sum(len(p) for p in pieces) == len(group)
            assert len(pieces[0]) == len(group) // 2 and len(pieces[2]) >= 2
    assert task.part("test", 0).inputs != task.part("test", 1).inputs


def test_sampling_is_balanced_and_repeats_last():
    task = TASKS["category-letters"].part("validation", 3)  # 5 words per class
    texts, classes = task.sample(np.random.default_rng(0), 32)
    assert collections.Counter(classes.tolist()) == {0: 8, 1: 8, 2: 8, 3: 8}
    for c in range(4):
        drawn = [t for t, k in zip(texts, classes) if k == c]
        assert len(set(drawn[:5])) == 5 and set(drawn) == set(task.inputs[c])
        assert all(t in word_tasks.CATEGORIES[list(word_tasks.CATEGORIES)[c]] for t in drawn)


def test_the_layouts():
    assert TASKS["category-letters"].prompt_input("plum") == "Word: plum\nCategory"
    assert TASKS["sentiment-flipped"].label_texts() == (" negative", " positive")
    assert TASKS["sentiment-flipped"].inputs[0][0] == "The movie was wonderful."
    case = TASKS["case-letters"]
    assert case.inputs[1][0] == "RED DOG" and case.inputs[2][0] == "Red Dog"
    assert TASKS["topic-swapped"].label_texts()[0] == " food"
    assert (
        TASKS["topic-letters"].inputs[0][216]
        == "The striker scored twice in the final match last week."
    )
    # At least 100 distinct test inputs per class, but for the category words.
    for name, task in TASKS.items():
        smallest = min(len(texts) for texts in task.part("test", 0).inputs)
        assert smallest >= 100 or name.startswith("category"), (name, smallest)


def test_bad_names_and_parts():
    with pytest.raises(
        ValueError, match="unknown word task 'category-leters'; did you mean category-letters"
    ):
        word_tasks.task("category-leters")
    with pytest.raises(ValueError, match="which: expected one of"):
        TASKS["case-letters"].part("dev", 0)
