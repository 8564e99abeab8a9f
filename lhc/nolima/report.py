"""The tables of a NoLiMa sweep from its results file, with intervals and paired tests.

    records = lhc.stats.read_records("results.jsonl")
    print(lhc.nolima.report.render(records))

Per model (the ``model`` field of the records; rows of the knowledge check, ``set:
probe``, apart):

* scores by length for all pairs, literal, latent and each question type, the 95%
  interval of each from a bootstrap over pairs (a pair's tests at several depths and
  haystacks are one draw), the base score and the effective length with theirs (pairs
  resampled jointly for every length, so the interval of the effective length is that
  of the whole curve);
* latent pairs split by the knowledge check: known when the latent question was
  answered in at least 2 of its 3 tests at 250 tokens of the held-out haystack;
* literal against one-hop questions about the same needle in the same context
  (McNemar's exact test per length, its p-value also Bonferroni-adjusted for the number
  of lengths compared).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from lhc.nolima.scores import BASE_LENGTHS, LITERAL, pair_scores
from lhc.stats import markdown_table, mcnemar

KNOWN_AT_LEAST = 2  # of the knowledge check's 3 tests


def known_pairs(records: Sequence[Mapping]) -> dict[str, bool]:
    """``{pair: known}`` from the knowledge check's records (``set: probe``)."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        if r.get("set") == "probe":
            hits[r["pair"]].append(bool(r["correct"]))
    return {pair: sum(v) >= KNOWN_AT_LEAST for pair, v in hits.items()}


def curve_intervals(
    records: Sequence[Mapping],
    *,
    resamples: int = 2000,
    seed: int = 0,
    threshold: float = 0.85,
    base_lengths: Sequence[int] = BASE_LENGTHS,
) -> dict:
    """Scores by length, base score and effective length of ``records``, each with a 95%
    percentile interval from resampling pairs with replacement."""
    pairs = pair_scores(records)
    names = sorted(pairs)
    lengths = sorted({n for scores in pairs.values() for n in scores})
    matrix = np.array([[pairs[p].get(n, np.nan) for n in lengths] for p in names])
    draws = np.random.default_rng(seed).integers(len(names), size=(resamples, len(names)))
    samples = np.concatenate([matrix[None], matrix[draws]])  # [1 + R, P, L]; 0: the data
    with warnings.catch_warnings():  # a draw with no pair scored at a length: NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        by_length = np.nanmean(samples, axis=1)  # [1 + R, L]
    out = {
        "pairs": len(names),
        "lengths": lengths,
        "score": by_length[0].tolist(),
        "score_interval": np.nanpercentile(by_length[1:], [2.5, 97.5], axis=0).T.tolist(),
    }
    base_columns = [i for i, n in enumerate(lengths) if n in base_lengths]
    if base_columns:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            base = np.nanmean(np.nanmax(samples[..., base_columns], axis=2), axis=1)
        below = by_length < threshold * base[:, None]
        # The effective length: the longest length before the first below the threshold
        # (index -1: even the shortest is below; len(lengths) - 1: none is).
        first = np.where(below.any(axis=1), below.argmax(axis=1), len(lengths))
        first = np.where(base > 0, first, 0)
        effective = first - 1
        low, high = np.percentile(effective[1:], [2.5, 97.5], method="nearest")
        name = lambda i: lengths[int(i)] if i >= 0 else None  # noqa: E731
        out.update(
            base=float(base[0]),
            base_interval=np.percentile(base[1:], [2.5, 97.5]).tolist(),
            effective=name(effective[0]),
            effective_interval=(name(low), name(high)),
        )
    return out


def paired_literal_latent(
    records: Sequence[Mapping], latent: str = "onehop", pairs: set[str] | None = None
) -> list[dict]:
    """Per length: literal against ``latent`` questions about the same needle in the
    same context (same name, haystack and depth), McNemar's exact test, and its p-value
    times the number of lengths (Bonferroni). ``pairs``: keep only needles whose latent
    pair is in it."""
    by_placement: dict[tuple, dict[str, bool]] = defaultdict(dict)
    for r in records:
        if r["question_type"] in (*LITERAL, latent):
            kind = "literal" if r["question_type"] in LITERAL else "latent"
            placement = (r["experiment"], r["test"], r["haystack"], r["length"], r["depth"])
            by_placement[placement][kind] = bool(r["correct"])
            if kind == "latent":
                by_placement[placement]["pair"] = r["pair"]
    by_length: dict[int, list[tuple[bool, bool]]] = defaultdict(list)
    for placement, v in by_placement.items():
        if "literal" in v and "latent" in v and (pairs is None or v["pair"] in pairs):
            by_length[int(placement[3])].append((v["literal"], v["latent"]))
    rows = []
    for length, scored in sorted(by_length.items()):
        literal, latent_ = zip(*scored)
        test = mcnemar(literal, latent_)
        rows.append(
            {
                "length": length,
                "placements": len(scored),
                "literal": float(np.mean(literal)),
                "latent": float(np.mean(latent_)),
                "only_literal": test["only_first"],
                "only_latent": test["only_second"],
                "p": test["p_value"],
                "p_adjusted": min(1.0, test["p_value"] * len(by_length)),
            }
        )
    return rows


def _groups(records: Sequence[Mapping], known: Mapping[str, bool]) -> list[tuple[str, list]]:
    literal = [r for r in records if r["question_type"] in LITERAL]
    latent = [r for r in records if r["question_type"] not in LITERAL]
    groups = [("all", list(records)), ("literal", literal), ("latent", latent)]
    if known:
        groups += [
            ("latent, known", [r for r in latent if known.get(r["pair"])]),
            ("latent, not known", [r for r in latent if known.get(r["pair"]) is False]),
        ]
    for kind in sorted({r["question_type"] for r in records}):
        groups.append((kind, [r for r in records if r["question_type"] == kind]))
    return [(name, rows) for name, rows in groups if rows]


def render(records: Sequence[Mapping], *, resamples: int = 2000, seed: int = 0) -> str:
    """Markdown: per model, the score table and the paired literal/latent table."""
    out = []
    models = list(dict.fromkeys(r.get("model", "model") for r in records))
    for model in models:
        mine = [r for r in records if r.get("model", "model") == model]
        known = known_pairs(mine)
        sweep = [r for r in mine if r.get("set") != "probe"]
        rows, lengths = [], set()
        for name, rows_ in _groups(sweep, known):
            c = curve_intervals(rows_, resamples=resamples, seed=seed)
            lengths.update(c["lengths"])
            row = {"questions": name, "pairs": c["pairs"]}
            if "base" in c:
                low, high = c["base_interval"]
                row["base"] = f"{c['base']:.2f} [{low:.2f}, {high:.2f}]"
                e, (e_low, e_high) = c["effective"], c["effective_interval"]
                row["effective"] = f"{_length(e)} [{_length(e_low)}, {_length(e_high)}]"
            for n, s, (low, high) in zip(c["lengths"], c["score"], c["score_interval"]):
                row[n] = f"{s:.2f} [{low:.2f}, {high:.2f}]"
            rows.append(row)
        lengths = sorted(lengths)
        columns = [("questions", "questions"), ("pairs", "pairs"), ("base", "base")]
        columns += [(f"{n:,}", n) for n in lengths] + [("effective length", "effective")]
        per_length = defaultdict(int)
        for r in sweep:
            per_length[int(r["length"])] += 1
        counts = ", ".join(f"{n:,}: {per_length[n]}" for n in lengths)
        out.append(
            f"**{model}**: score by length (95% bootstrap interval over pairs), {len(sweep)} "
            f"tests ({counts})"
            + (
                f"; knowledge check: {sum(known.values())} of {len(known)} latent pairs known"
                if known
                else ""
            )
            + "\n\n"
            + markdown_table(columns, rows, right=["base", "effective", *lengths])
        )
        for subset, pairs in (("all needles", None), ("known one-hop pairs", known)):
            if subset != "all needles" and not known:
                continue
            chosen = None if pairs is None else {p for p, k in pairs.items() if k}
            paired = paired_literal_latent(sweep, "onehop", chosen)
            if paired:
                out.append(
                    f"**{model}**: literal against one-hop questions about the same needle "
                    f"({subset}; McNemar's exact test, p x {len(paired)} lengths)\n\n"
                    + markdown_table(
                        [
                            ("length", "length", ","),
                            ("placements", "placements"),
                            ("literal", "literal", ".2f"),
                            ("one-hop", "latent", ".2f"),
                            ("only literal", "only_literal"),
                            ("only one-hop", "only_latent"),
                            ("p", "p", ".2g"),
                            ("p adjusted", "p_adjusted", ".2g"),
                        ],
                        paired,
                    )
                )
    return "\n\n".join(out)


def _length(n: int | None) -> str:
    return "<shortest" if n is None else f"{n:,}"
