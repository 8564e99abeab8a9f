"""The acceptance tables of ``experiments/quantspec`` from its raw results.

    lhc report experiments/quantspec [--write]

Each ``results/<model>_acceptance.jsonl`` (``lhc bench quantspec --drafts ...
--results``) holds one record per draft, prompt length, gamma and temperature with
each prompt's accepted and drafted tokens. Per row: the acceptance (accepted over
drafted tokens of all prompts) with a 95% bootstrap interval over the prompts, and,
greedy, on how many prompts the output equals plain decoding on the 8-bit path (a
difference is a near-tie rounded the other way, counted here rather than hidden);
sampled, the p-value of Pearson's test of the speculative samples of the first two
tokens against the target's exact distribution (``--sampled-check``).
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """Two blocks per acceptance results file (``lhc report``): ``<file>`` the
    acceptance, ``<file minus _acceptance>_memory`` the caches' sizes."""
    blocks = {}
    for name, rows in results.items():
        if name.endswith("_acceptance"):
            blocks[name] = table(rows)
            blocks[name.removesuffix("_acceptance") + "_memory"] = memory_table(rows)
    return blocks


def memory_table(rows: list[dict]) -> str:
    """Per model, KV group and prompt length: the prefilled hierarchical cache against a
    full-precision cache of the same capacity (the model's dtype), per prompt."""
    lines = [
        "| model | KV group | prompt tokens | cache slots | hierarchical cache (MiB) "
        "| full-precision cache (MiB) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    seen = {}
    for row in rows:
        if "cache_bytes" in row:
            key = (row["model"], row["setting"]["group_size"], row["prompt"])
            batch = row["setting"]["batch"]
            seen[key] = (row["cache_slots"], row["cache_bytes"], row["full_cache_bytes"], batch)
    for (model, group, prompt), (slots, cache, full, batch) in sorted(seen.items()):
        lines.append(
            f"| {model} | {group} | {prompt:,} | {slots:,} | {cache / batch / 2**20:.1f} "
            f"| {full / batch / 2**20:.1f} | {cache / full:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _ratio_interval(accepted: np.ndarray, drafted: np.ndarray) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    picks = rng.integers(len(accepted), size=(RESAMPLES, len(accepted)))
    ratios = accepted[picks].sum(1) / np.maximum(drafted[picks].sum(1), 1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | KV group | draft | prompt tokens | gamma | T | prompts | acceptance "
        "| greedy output = 8-bit decoding | sampled: chi-square p (samples) |",
        "|---|---:|---|---:|---:|---:|---:|---|---|---|",
    ]
    key = lambda r: (
        r["setting"]["group_size"],
        r["draft"],
        r["prompt"],
        r["gamma"],
        r["temperature"],
    )  # noqa: E731
    for row in sorted(rows, key=key):
        accepted = np.asarray(row["per_prompt"]["accepted"], float)
        drafted = np.asarray(row["per_prompt"]["drafted"], float)
        low, high = _ratio_interval(accepted, drafted)
        same = row["per_prompt"]["same_as_8bit"]
        equal = "-" if same is None else f"{sum(same)}/{len(same)}"
        check = row.get("sampled")
        sampled = "-" if not check else f"{check['p_value']:.3g} ({check['samples']:,})"
        lines.append(
            f"| {row['model']} | {row['setting']['group_size']} | {row['draft']} "
            f"| {row['prompt']:,} | {row['gamma']} | {row['temperature']:g} | {len(accepted)} "
            f"| {accepted.sum() / max(drafted.sum(), 1):.3f} ({low:.3f}-{high:.3f}) | {equal} "
            f"| {sampled} |"
        )
    return "\n".join(lines) + "\n"
