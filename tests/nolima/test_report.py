"""lhc.nolima.report: bootstrap intervals over pairs, the knowledge split, paired tests."""

import pytest
from scipy.stats import binomtest

from lhc.nolima import report


def records():
    """4 needles x 2 haystacks at 250/1000/4000 tokens: literal questions always right,
    one-hop ones right at 250 tokens for needles 0-2 only; the knowledge check knows
    needles 0 and 1 (2 and 3 of 3 right), not 2 and 3 (1 and 0)."""
    rows = []
    for fact in range(4):
        for haystack in ("h0", "h1"):
            for length in (250, 1000, 4000):
                for kind in ("direct", "onehop"):
                    right = kind == "direct" or (length == 250 and fact < 3)
                    rows.append(
                        dict(
                            model="m",
                            pair=f"e/T{fact}/{kind}",
                            experiment="e",
                            test=f"T{fact}",
                            question_type=kind,
                            haystack=haystack,
                            length=length,
                            depth=0.5,
                            correct=right,
                        )
                    )
        for depth, right in zip(
            (0.0, 0.5, 1.0), [(1, 1, 0), (1, 1, 1), (1, 0, 0), (0, 0, 0)][fact]
        ):
            rows.append(
                dict(
                    model="m", set="probe", pair=f"e/T{fact}/onehop", experiment="e",
                    test=f"T{fact}", question_type="onehop", haystack="held", length=250,
                    depth=depth, correct=bool(right),
                )
            )  # fmt: skip
    return rows


def test_curve_intervals_and_effective_length():
    sweep = [r for r in records() if r.get("set") != "probe"]
    c = report.curve_intervals(sweep, resamples=500)
    # Pair scores: 4 literal pairs at 1, one-hop 1, 1, 1, 0 at 250 and 0 after.
    assert c["score"] == pytest.approx([7 / 8, 4 / 8, 4 / 8])
    assert c["base"] == pytest.approx(7 / 8) and c["effective"] == 250
    low, high = c["score_interval"][1]
    assert 0.1 < low < 0.5 < high < 0.9  # pairs resampled: 0/1 scores, 8 pairs
    literal = report.curve_intervals([r for r in sweep if r["question_type"] == "direct"])
    assert literal["score_interval"] == [[1.0, 1.0]] * 3 and literal["effective"] == 4000
    assert literal["effective_interval"] == (4000, 4000)


def test_knowledge_check_and_the_paired_test():
    rows = records()
    assert report.known_pairs(rows) == {
        "e/T0/onehop": True, "e/T1/onehop": True, "e/T2/onehop": False, "e/T3/onehop": False
    }  # fmt: skip
    sweep = [r for r in rows if r.get("set") != "probe"]
    paired = {p["length"]: p for p in report.paired_literal_latent(sweep)}
    # At 1000 tokens the 8 placements all differ, every one for the literal question.
    assert paired[1000]["only_literal"] == 8 and paired[1000]["only_latent"] == 0
    assert paired[1000]["p"] == pytest.approx(binomtest(8, 8, 0.5).pvalue)
    assert paired[1000]["p_adjusted"] == pytest.approx(3 * binomtest(8, 8, 0.5).pvalue)
    assert paired[250]["p"] == pytest.approx(binomtest(2, 2, 0.5).pvalue)
    known = report.paired_literal_latent(sweep, pairs={"e/T0/onehop", "e/T1/onehop"})
    assert [p["placements"] for p in known] == [4, 4, 4]
    text = report.render(rows, resamples=200)
    assert "knowledge check: 2 of 4 latent pairs known" in text
    # Tests per length in the caption, so that an unfinished length shows as such.
    lengths = [r["length"] for r in sweep]
    counts = ", ".join(f"{n:,}: {lengths.count(n)}" for n in sorted(set(lengths)))
    assert f"{len(sweep)} tests ({counts})" in text
    unfinished = [r for r in rows if r.get("length") != 4000 or r["test"] == "T0"]
    left = sum(r["length"] == 4000 and r["test"] == "T0" for r in sweep)
    assert 0 < left < lengths.count(4000)
    assert f"4,000: {left})" in report.render(unfinished, resamples=200)
    assert "| latent, known | 2 | 1.00 [1.00, 1.00] | 1.00 [1.00, 1.00] | 0.00 [0.00, 0.00]" in text
    assert "| literal | 4 | 1.00 [1.00, 1.00] |" in text
