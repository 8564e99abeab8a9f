"""Fact questions in a book: reproducible, one mention of each person and answer, the
same facts at the same depths at every length."""

import re

import pytest

from lhc import lm
from lhc.rapid import facts as facts_lib

BOOK = [
    "And the river ran past the old stone houses of the city, and the wind was quiet.",
    "Then the king said unto his servants, Go ye into the field and gather the grain.",
    "Behold, the parrot of the captain sat upon the mast, and the boat was built of cedar.",
    "And they paid silver coins for the map, and the fruit of the garden was a mango.",
    "Lucian sailed from Oslo with a jar of marmalade.",  # names seed 1's people and answers
] * 40


def name_of(text):
    return re.search(r"\b(" + "|".join(facts_lib.NAMES) + r")\b", text)[1]


def test_facts_are_reproducible_and_name_different_people():
    a, b = facts_lib.make_facts(30, seed=3), facts_lib.make_facts(30, seed=3)
    assert a == b and a != facts_lib.make_facts(30, seed=4)
    names = [name_of(f.statement) for f in a]
    assert len(set(names)) == 30
    for fact, name in zip(a, names):
        assert fact.answer in fact.statement and fact.answer not in fact.question
        assert name in fact.question
    # Every template is used, in turn.
    assert len({f.question.replace(n, "") for f, n in zip(a, names)}) == len(facts_lib.TEMPLATES)
    with pytest.raises(ValueError, match="count must lie in"):
        facts_lib.make_facts(len(facts_lib.NAMES) + 1)


def test_fact_contexts_hold_each_fact_once_at_spread_depths(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("\n".join(BOOK))
    tokenizer = lm.ByteTokenizer()
    out = facts_lib.fact_contexts(
        [str(book)], tokenizer, [600, 1500], num_contexts=3, facts_per_context=2, seed=1
    )
    depths = sorted(d for ds in out[600].depths for d in ds)
    assert depths == pytest.approx([(k + 0.5) / 6 for k in range(6)])
    for length, bucket in out.items():
        assert [len(c) for c in bucket.contexts] == [length] * 3
        assert bucket.facts == out[600].facts and bucket.depths == out[600].depths
        for c, context in enumerate(bucket.contexts):
            text = tokenizer.decode(context.tolist())
            for j, fact in enumerate(bucket.facts[c]):
                statement = tokenizer.encode(fact.statement + "\n")
                start = bucket.starts[c][j]
                assert context[start : start + len(statement)].tolist() == statement
                # The book's lines that name a person or an answer are dropped.
                for word in (fact.answer, name_of(fact.question)):
                    assert len(re.findall(r"\b" + re.escape(word) + r"\b", text, re.I)) == 1
                assert abs(start / length - bucket.depths[c][j]) < 0.15
        assert bucket.questions(1)[0].endswith(out[600].facts[0][1].question)
        assert bucket.answers(0) == [f[0].answer for f in bucket.facts]
