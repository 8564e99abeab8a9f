"""The passkey table of ``experiments/gca`` from its raw results.

    lhc report experiments/gca [--write]

``results/passkey.jsonl`` (``lhc eval`` with ``passkey_eval.results``; one record per
run, length and depth with every example's hit) gives, per retriever (the record's
label) and length: the accuracy over every seed and depth with a Wilson interval, each
seed's accuracy, and the learned retriever against each ablation by McNemar's exact
test on the same examples (runs of one seed draw the same examples).
"""

from __future__ import annotations

from lhc import stats


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: table(rows) for name, rows in results.items()}


def _hits(rows, label, length) -> dict[tuple, bool]:
    """``{(seed, depth, example): hit}`` of one retriever at one length."""
    return {
        (r["seed"], r["depth"], i): bool(hit)
        for r in rows
        if r["label"] == label and r["length"] == length
        for i, hit in enumerate(r["hits"])
    }


def table(rows: list[dict]) -> str:
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    lines = [
        "| retriever | tokens | seeds | examples | accuracy | 95% interval | per seed | "
        "against learned (McNemar p) |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for label in labels:
        for length in lengths:
            hits = _hits(rows, label, length)
            if not hits:
                continue
            seeds = sorted({key[0] for key in hits})
            found = sum(hits.values())
            low, high = stats.wilson_interval(found, len(hits))
            per_seed = ", ".join(
                f"{sum(v for k, v in hits.items() if k[0] == s) / sum(k[0] == s for k in hits):.2f}"
                for s in seeds
            )
            versus = "-"
            learned = _hits(rows, "learned", length)
            common = sorted(set(hits) & set(learned))
            if label != "learned" and common:
                test = stats.mcnemar([learned[k] for k in common], [hits[k] for k in common])
                versus = (
                    f"learned alone {test['only_first']}, this alone {test['only_second']} "
                    f"of {len(common)} (p {test['p_value']:.3g})"
                )
            lines.append(
                f"| {label} | {length:,} | {len(seeds)} | {len(hits)} | {found / len(hits):.2f} "
                f"| {low:.2f}-{high:.2f} | {per_seed} | {versus} |"
            )
    return "\n".join(lines) + "\n"
