"""``lhc.data.haystack.Haystack.insert``: several lines at several depths, checked
against the haystack's tokens and line starts computed here line by line."""

import numpy as np
import pytest

from lhc import lm
from lhc.data.haystack import Haystack

WORDS = "the river ran past old stone houses while a quiet wind moved over green hills".split()


def text_lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(5, 14))).capitalize() + "." for _ in range(n)]


def test_lines_inserted_at_their_depths_leave_the_haystack_in_order():
    tokenizer = lm.ByteTokenizer()
    text = text_lines(200)
    haystack = Haystack(text, tokenizer)
    flat, starts = [], []
    for line in text:
        starts.append(len(flat))
        flat += tokenizer.encode(line + "\n")
    inserts = [(0.8, "Marisol's code word is lantern."), (0.05, "Kenji has a parrot."),
               (0.8, "Same point, second."), (1.0, "At the very end.")]  # fmt: skip
    ids = [tokenizer.encode(t + "\n") for _, t in inserts]
    for length in (300, 1200):
        budget = length - sum(map(len, ids))
        tokens, where = haystack.insert(inserts, length=length)
        assert len(tokens) == length
        inside = [s for s in starts if s < budget]
        end = budget if budget in starts else inside[-1]
        points = [next((s for s in inside if s >= round(d * budget)), end) for d, _ in inserts]
        # Lines at the same point keep their order; each start counts the lines before it.
        rest, cursor = list(tokens), 0
        for i in sorted(range(len(inserts)), key=lambda i: (points[i], i)):
            assert where[i] == points[i] + cursor
            assert tokens[where[i] : where[i] + len(ids[i])] == ids[i]
            cursor += len(ids[i])
        for i in sorted(range(len(inserts)), key=lambda i: -where[i]):
            del rest[where[i] : where[i] + len(ids[i])]
        assert rest == flat[:budget]
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\], got -0.1"):
        haystack.insert([(-0.1, "x")], length=300)
    with pytest.raises(ValueError, match="leaves no haystack tokens"):
        haystack.insert([(0.5, "x" * 400)], length=300)
