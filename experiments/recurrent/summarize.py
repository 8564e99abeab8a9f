"""Mean and range over seeds of the curves of several ``curves.py`` outputs.

    python experiments/recurrent/summarize.py \
        /tmp/runs/mamba2_s0_curves /tmp/runs/mamba2_s1_curves /tmp/runs/mamba2_s2_curves

Runs are grouped by their name with the seed taken out (``mamba2_s1_noise`` ->
``mamba2_noise``). Prints, for each group, the mean over seeds and the smallest and
largest value in brackets: perplexity by position, passkey accuracy by length (mean over
depths) and EffRem at a few t.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np


def _group(name: str) -> str:
    return re.sub(r"_s\d+_", "_", name)


def _cell(values, fmt: str) -> str:
    values = np.asarray(values)
    return (
        f"{format(values.mean(), fmt)} [{format(values.min(), fmt)}, {format(values.max(), fmt)}]"
    )


def _table(title, rows, groups: dict, key: str, fmt: str, pick=slice(None)) -> str:
    names = list(groups)
    lines = [f"| {title} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i in range(len(rows))[pick]:
        cells = [_cell([run[key][i] for run in groups[name]], fmt) for name in names]
        lines.append(f"| {rows[i]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="curves.py --out folders")
    args = parser.parse_args(argv)
    groups: dict[str, list[dict]] = {}
    meta = None
    for folder in args.folders:
        with open(os.path.join(folder, "results.json")) as handle:
            results = json.load(handle)
        meta = meta or results
        for name in results["perplexity"]:
            groups.setdefault(_group(name), []).append(
                {key: results[key].get(name) for key in ("perplexity", "effrem", "passkey")}
            )
    seeds = {name: len(runs) for name, runs in groups.items()}
    print(f"Runs per group: {seeds}; mean [min, max] over them.\n")
    print("Perplexity by position:\n")
    print(_table("positions", meta["buckets"], groups, "perplexity", ".2f"))
    if meta["passkey_lengths"]:
        print(f"\nPasskey accuracy (mean over depths, {meta['passkey_samples']} keys per depth):\n")
        print(_table("length", meta["passkey_lengths"], groups, "passkey", ".2f"))
    print(f"\nEffective Remembrance at T = {meta['effrem_length']}:\n")
    print(_table("t", meta["effrem_t"], groups, "effrem", ".3f", pick=slice(None, None, 3)))


if __name__ == "__main__":
    main()
