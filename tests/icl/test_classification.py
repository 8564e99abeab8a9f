"""The pretraining prompts of ``lhc.icl.classification``."""

import numpy as np

from lhc.icl.classification import LABEL_WORDS, SEPARATOR, training_row


def _blocks(tokens):
    text = bytes(int(t) for t in tokens if t).decode()
    return [block.split("\n") for block in text.split("\n\n\n")]


def test_training_prompts_show_every_class_before_the_query():
    for seed in range(30):
        row = training_row(np.random.default_rng(seed), max_classes=5, max_shots=2, width=144)
        tokens = np.concatenate([row["tokens"][0, :1], row["targets"][0]])
        blocks = _blocks(tokens)
        labels = [label for _, label in blocks]
        assert all(label in LABEL_WORDS for label in labels)
        support, query = labels[:-1], labels[-1]
        counts = {label: support.count(label) for label in set(support)}
        # Every class the same number of times (1 or 2), and the query's label among them.
        assert len(set(counts.values())) == 1 and set(counts.values()) <= {1, 2}
        assert query in counts and 2 <= len(counts) <= 5
        # The loss weighs exactly the label words (5 letters each), nothing else.
        weights = row["weights"][0]
        weighted = bytes(int(t) for t in row["targets"][0][weights > 0]).decode()
        assert weighted == "".join(labels) and weights.sum() == 5 * len(labels)
        # Inputs: 4 lower-case letters before each separator.
        assert all(len(x) == 4 and x.isalpha() and x.islower() for x, _ in blocks)
        assert SEPARATOR == ord("\n")
