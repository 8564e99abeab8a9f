"""The tables of ``experiments/context_extension`` from its raw results.

    lhc report experiments/context_extension [--write]

Passkey accuracy per model and length with Wilson intervals (and per depth), McNemar's
exact test for each model against the first on the same keys, the held-out loss per
position bucket, and the short-context loss.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from lhc import stats


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: tables(rows) for name, rows in results.items()}


def tables(rows: list[dict]) -> str:
    models = list(dict.fromkeys(row["model"] for row in rows))
    out = []
    passkey = [row for row in rows if row["kind"] == "passkey"]
    lengths = sorted({row["test"].split("/")[1] for row in passkey}, key=int)
    table = []
    for model in models:
        for length in lengths:
            cell = [r for r in passkey if r["model"] == model and r["test"].split("/")[1] == length]
            if not cell:
                continue
            hits = sum(r["correct"] for r in cell)
            low, high = stats.wilson_interval(hits, len(cell))
            by_depth = defaultdict(list)
            for r in cell:
                by_depth[r["depth"]].append(r["correct"])
            entry = {
                "model": model,
                "length": int(length),
                "n": len(cell),
                "accuracy": hits / len(cell),
                "interval": f"{low:.2f}-{high:.2f}",
                "depths": " / ".join(f"{sum(v)}/{len(v)}" for _, v in sorted(by_depth.items())),
            }
            first = {
                r["test"]: r["correct"]
                for r in passkey
                if r["model"] == models[0] and r["test"].split("/")[1] == length
            }
            paired = [(first[r["test"]], r["correct"]) for r in cell if r["test"] in first]
            if model != models[0] and paired:
                entry["p"] = stats.mcnemar(*zip(*paired))["p_value"]
            table.append(entry)
    out.append(
        "Passkey retrieval (depths 10% / 50% / 90%; p: McNemar's exact test against "
        f"{models[0]} on the same keys):\n"
    )
    out.append(
        stats.markdown_table(
            [
                ("model", "model"),
                ("prompt tokens", "length", ","),
                ("keys", "n"),
                ("accuracy", "accuracy", ".2f"),
                ("95% interval", "interval"),
                ("by depth", "depths"),
                ("p", "p", ".2g"),
            ],
            table,
        )
    )
    position = [row for row in rows if row["kind"] == "position"]
    if position:
        buckets = max(len(r["nll"]) for r in position)
        columns = [("model", "model"), ("windows", "windows")] + [
            (f"{b}K-{b + 1}K", f"b{b}", ".3f") for b in range(buckets)
        ]
        entries = []
        for model in dict.fromkeys(r["model"] for r in position):
            mine = [r for r in position if r["model"] == model]  # a row per window, or one
            windows = sum(r["windows"] for r in mine)
            nll = sum(np.asarray(r["nll"]) * r["windows"] for r in mine) / windows
            entries.append(
                {"model": model, "windows": windows, **{f"b{i}": v for i, v in enumerate(nll)}}
            )
        out.append("\nHeld-out loss (nats per token) by position:\n")
        out.append(stats.markdown_table(columns, entries))
    short = [row for row in rows if row["kind"] == "short_loss"]
    if short:
        out.append("\nShort context (512-token held-out windows):\n")
        out.append(
            stats.markdown_table(
                [("model", "model"), ("windows", "windows"), ("loss", "nll", ".3f")], short
            )
        )
    return "\n".join(out)
