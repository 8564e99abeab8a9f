"""The memory-traffic model's rows: for named model sizes and context lengths, the bytes
each kind of step reads and the predicted speedup (``lhc.quantspec.traffic``)."""

from __future__ import annotations

from lhc.quantspec import traffic
from lhc.stats import markdown_table


def traffic_rows(configs, contexts, *, gamma: int, acceptance: float, group_size: int = 128):
    rows = []
    for name in configs:
        size = traffic.NAMED[name]
        for context in contexts:
            mlp = traffic.step_bytes(size, context, group_size=group_size, weights="mlp")
            full = traffic.step_bytes(size, context, group_size=group_size, weights="all")
            speed = {
                w: traffic.predicted_speedup(
                    size,
                    context,
                    gamma=gamma,
                    acceptance=acceptance,
                    group_size=group_size,
                    weights=w,
                )
                for w in ("mlp", "all")
            }
            rows.append(
                dict(
                    config=name,
                    context=context,
                    ar_gb=mlp["ar"] / 1e9,
                    draft_mlp_gb=mlp["draft"] / 1e9,
                    draft_all_gb=full["draft"] / 1e9,
                    verify_gb=mlp["verify"] / 1e9,
                    speedup_mlp=speed["mlp"],
                    speedup_all=speed["all"],
                )
            )
    return rows


def traffic_table(rows, gamma, acceptance) -> str:
    predicted = f"predicted speedup, gamma {gamma}, a {acceptance:g}"
    columns = [
        ("config", "config"), ("context", "context"), ("AR GB", "ar_gb", ".1f"),
        ("draft GB (MLP 4-bit)", "draft_mlp_gb", ".1f"), ("draft GB (all)", "draft_all_gb", ".1f"),
        ("verify GB", "verify_gb", ".1f"), (f"{predicted} (MLP)", "speedup_mlp", ".2fx"),
        (f"{predicted} (all)", "speedup_all", ".2fx"),
    ]  # fmt: skip
    return markdown_table(columns, rows)
