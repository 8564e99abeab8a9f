"""Fact questions in a book: reproducible, one mention of each person and answer, the
same facts at the same depths at every length; paraphrased questions share no content
word with their facts (BM25 misses them), literal ones do (BM25 finds them)."""

import re
from collections import Counter

import numpy as np
import pytest

from lhc import lm
from lhc.rapid import bm25_scores, word_terms
from lhc.rapid import facts as facts_lib
from lhc.rapid.bench.facts import fact_summary, fact_table

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


# Lucene's English stop words, as bm25s drops them.
STOPWORDS = set(
    "a an and are as at be but by for if in into is it no not of on or such that the their "
    "then there these they this to was will with".split()
)


def words(text):
    """Lower-cased words without punctuation, a possessive 's or a stop word."""
    return set(re.findall(r"[^\W_]+", re.sub(r"'s\b", "", text.lower()))) - STOPWORDS


def test_old_selection_rule_is_kept_without_paraphrases():
    for seed, count in [(0, 40), (3, 12), (7, 1)]:
        rng = np.random.default_rng(seed)
        names = rng.permutation(facts_lib.NAMES[:40])[:count]
        order = rng.permutation(len(facts_lib.TEMPLATES))
        want = []
        for i, name in enumerate(names):
            statement, question, values = facts_lib.TEMPLATES[order[i % len(order)]]
            value = values[rng.integers(len(values))]
            want.append(
                (statement.format(name=name, value=value), question.format(name=name), value)
            )
        got = facts_lib.make_facts(count, seed=seed)
        assert [(f.statement, f.question, f.answer) for f in got] == want
        assert got == facts_lib.make_facts(count, seed=seed, paraphrased=0.0)
        assert not any(f.paraphrased for f in got)


def test_paraphrased_questions_share_no_word_with_their_facts():
    count = 120
    facts = facts_lib.make_facts(count, seed=0, paraphrased=0.5)
    literal = facts_lib.make_facts(count, seed=0)
    # Every other fact; the rest are the facts of paraphrased=0.
    assert [f.paraphrased for f in facts] == [i % 2 == 1 for i in range(count)]
    assert [f for f in facts if not f.paraphrased] == literal[::2]
    names = [name_of(f.statement) for f in facts]
    assert len(set(names)) == count
    used = []
    for fact, name in zip(facts, names):
        if not fact.paraphrased:
            assert words(fact.question) & words(fact.statement)
            assert name in fact.question and fact.answer == fact.value in fact.statement
            continue
        assert not words(fact.question) & words(fact.statement), fact
        assert fact.answer == name and name not in fact.question
        (template,) = [t for t in facts_lib.PARAPHRASE_TEMPLATES if fact.value in t[2]]
        statement, question, descriptions = template
        assert fact.statement == statement.format(name=name, value=fact.value)
        assert fact.question == question.format(description=descriptions[fact.value])
        used.append(statement)
    # 60 different values and descriptions, the paraphrase templates taken in turn.
    paraphrased = [f for f in facts if f.paraphrased]
    assert len({f.value for f in paraphrased}) == len({f.question for f in paraphrased}) == 60
    assert sorted(Counter(used).values()) == [7, 7, 7, 7, 8, 8, 8, 8]


def test_bm25_finds_literal_facts_and_misses_paraphrased_ones():
    facts = facts_lib.make_facts(120, seed=0, paraphrased=0.5)
    tokenizer = lm.ByteTokenizer()
    terms = word_terms(tokenizer.decode)
    documents = [terms(tokenizer.encode(f.statement)) for f in facts]
    for i, fact in enumerate(facts):
        scores = bm25_scores(documents, terms(tokenizer.encode(fact.question)))
        if fact.paraphrased:
            assert scores[i] == 0
            continue
        best = np.flatnonzero(scores == scores.max())
        assert i in best
        # Ties only where the name is also a value word (Santiago the city, the Salt Wren).
        for other in set(best.tolist()) - {i}:
            assert name_of(fact.statement) in facts[other].value, (fact, facts[other])


def test_paraphrase_tables():
    values = [v for _, _, descriptions in facts_lib.PARAPHRASE_TEMPLATES for v in descriptions]
    assert len(set(values)) == len(values) >= len(facts_lib.NAMES) >= 120
    assert len(set(facts_lib.NAMES)) == len(facts_lib.NAMES)
    assert not set(values) & {v for _, _, vs in facts_lib.TEMPLATES for v in vs}
    names = {n.lower() for n in facts_lib.NAMES}
    for statement, question, descriptions in facts_lib.PARAPHRASE_TEMPLATES:
        assert len(set(descriptions.values())) == len(descriptions)
        for value, description in descriptions.items():
            asked = question.format(description=description)
            assert not words(asked) & (words(statement.format(name="", value=value)) | names)
    # Paraphrased 1.0: as many different values as names.
    everyone = facts_lib.make_facts(len(facts_lib.NAMES), seed=5, paraphrased=1.0)
    assert all(f.paraphrased for f in everyone)
    assert len({f.value for f in everyone}) == len(everyone)


def test_paraphrased_share_and_bad_input():
    for count, share, want in [
        (5, 0.5, 3),
        (120, 0.25, 30),
        (1, 1.0, 1),
        (40, 0.0, 0),
        (7, 0.3, 2),
    ]:
        got = facts_lib.make_facts(count, seed=2, paraphrased=share)
        assert sum(f.paraphrased for f in got) == want
    for share in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="paraphrased must lie in"):
            facts_lib.make_facts(10, paraphrased=share)
    with pytest.raises(ValueError, match="count must lie in"):
        facts_lib.make_facts(len(facts_lib.NAMES) + 1, paraphrased=0.5)


def test_fact_contexts_drop_lines_naming_paraphrased_values(tmp_path):
    facts = facts_lib.make_facts(4, seed=1, paraphrased=0.5)
    values = [f.value for f in facts if f.paraphrased]
    assert len(values) == 2
    book = tmp_path / "book.txt"
    book.write_text("\n".join(BOOK + [f"They spoke of {v} at the gate." for v in values] * 40))
    tokenizer = lm.ByteTokenizer()
    out = facts_lib.fact_contexts(
        [str(book)], tokenizer, [1500], num_contexts=2, facts_per_context=2, seed=1,
        paraphrased=0.5,
    )  # fmt: skip
    bucket = out[1500]
    assert [f for fs in zip(*bucket.facts) for f in fs] == facts
    text = "\n".join(tokenizer.decode(c.tolist()) for c in bucket.contexts)
    assert "at the gate" not in text
    for value in values:
        assert len(re.findall(r"\b" + re.escape(value) + r"\b", text, re.I)) == 1
    assert [bucket.answers(j) for j in range(2)] == [
        [f.answer for f in facts[j * 2 : j * 2 + 2]] for j in range(2)
    ]


def test_fact_summary_splits_literal_from_paraphrased():
    kinds = [False, True, False, True]
    records = [
        dict(length=512, method="target", batch=4, seconds=2.0, **{"pass": "prefill"}),
        dict(length=512, method="target", set=0, correct=[True, True, False, True],
             lengths=[4] * 4, paraphrased=kinds, **{"pass": "accuracy"}),
        dict(length=512, method="rapid", set=0, correct=[True, False, False, False],
             lengths=[4] * 4, paraphrased=kinds, accepted=[3, 1, 2, 0], drafted=[4] * 4,
             rounds=2, **{"pass": "accuracy"}),
        dict(length=512, method="target", set=0, seconds=1.0, lengths=[4] * 4,
             **{"pass": "speed"}),
    ]  # fmt: skip
    rows = {(r["method"], r["question_kind"]): r for r in fact_summary(records, new_tokens=4)}
    assert set(rows) == {(m, k) for m in ("target", "rapid") for k in ("all", "literal", "paraphrased")}  # fmt: skip
    assert rows["target", "all"]["accuracy"] == 0.75 and rows["target", "all"]["questions"] == 4
    assert rows["target", "literal"]["accuracy"] == 0.5
    assert rows["target", "paraphrased"]["accuracy"] == 1.0
    assert rows["target", "all"]["tokens_per_s"] == 16.0
    # 1 s for 4 questions, after 2 s of prefill for 4 contexts (one question each here).
    assert rows["target", "all"]["seconds_per_question"] == 0.25 + 0.5
    assert rows["target", "all"]["seconds_per_question_shared"] == 0.25 + 0.5
    assert rows["target", "literal"].get("tokens_per_s") is None
    assert rows["rapid", "literal"]["acceptance"] == 5 / 8
    assert rows["rapid", "paraphrased"]["acceptance"] == 1 / 8
    assert "| kind |" in fact_table(list(rows.values()))
    # Without paraphrased questions: one row per method, as before.
    literal = [{**r, "paraphrased": [False] * 4} if "correct" in r else r for r in records]
    assert [r["question_kind"] for r in fact_summary(literal, 4)] == ["all", "all"]
    assert "| kind |" not in fact_table(fact_summary(literal, 4))
