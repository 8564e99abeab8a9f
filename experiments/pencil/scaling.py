"""The scaling table: accuracy against problem size for runs evaluated on a ``Mixture``.

    python experiments/pencil/scaling.py PENCIL=/tmp/runs/qbf_pencil CoT=/tmp/runs/qbf_cot

Each argument is ``LABEL=PATH``: a workdir (its last ``metrics.jsonl`` record with
generation metrics, the evaluation at the end of training) or a JSON file written from
``lhc eval``'s output.
Sizes are read from the keys ``eval/<method>/n<size>/...`` that ``PencilTask`` writes
for a mixture; a run on one size writes ``eval/<method>/...``, its size read from the
workdir's config (``--size`` for such a JSON file). One row per size and run, accuracy
with its 95% Wilson interval; the share of exact traces where the run recorded it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from lhc.stats import wilson_interval

_KEY = re.compile(r"^eval/(pencil|cot)/n(\d+)/(\w+)$")
_PLAIN_KEY = re.compile(r"^eval/(pencil|cot)/(\w+)$")
_GENERATION = "generated_tokens_mean"  # a metric only the evaluation by generation writes


def _has_generation(record: dict) -> bool:
    return any(key.endswith("/" + _GENERATION) for key in record)


def generation_metrics(path: str, instances: int | None, size: int | None = None) -> dict:
    """The generation metrics of one run: ``{(method, size): {name: value}}``. Runs
    evaluated before the metrics held ``accuracy_low`` / ``accuracy_high`` get them from
    ``instances`` per size (a workdir's ``config.pencil_eval.num_instances`` when
    ``None``). ``size`` is the problem size of a single-size JSON file."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)["config"]
        if instances is None:
            instances = int(config["pencil_eval"]["num_instances"])
        if size is None:
            sizes = [v for v in config["data"]["problem_params"].values() if isinstance(v, int)]
            size = sizes[0] if len(sizes) == 1 else None
        with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        records = [r for r in records if _has_generation(r)]
        if not records:
            raise SystemExit(f"{path}: no record with eval/<method>/ generation metrics")
        record = records[-1]
    else:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    parts: dict = {}
    generated = _has_generation(record)
    for key, value in record.items():
        match = _KEY.match(key)
        if match:
            method, n, name = match.groups()
            parts.setdefault((method, int(n)), {})[name] = value
        elif generated and (match := _PLAIN_KEY.match(key)):
            method, name = match.groups()
            if size is None:
                raise SystemExit(f"--size: needed for the single-size results in {path}")
            parts.setdefault((method, size), {})[name] = value
    parts = {key: m for key, m in parts.items() if _GENERATION in m}
    if not parts:
        raise SystemExit(f"{path}: no eval/<method>/ generation metrics")
    for m in parts.values():
        if "accuracy_low" in m:  # written by the evaluation itself
            continue
        if instances is None:
            raise SystemExit(f"--instances: needed for the JSON file {path}")
        correct = round(m["accuracy"] * instances)
        m["accuracy_low"], m["accuracy_high"] = wilson_interval(correct, instances)
    return parts


def table(runs: list[tuple[str, dict]]) -> str:
    lines = [
        "| n | run | method | accuracy (95% CI) | trace rate | exact traces | finished "
        "| over the limit | largest context (mean / max) | generated tokens (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sizes = sorted({size for _, parts in runs for _, size in parts})
    for size in sizes:
        for label, parts in runs:
            for (method, n), m in sorted(parts.items()):
                if n != size:
                    continue
                exact = f"{m['exact_trace']:.2f}" if "exact_trace" in m else "-"
                lines.append(
                    f"| {n} | {label} | {method} | {m['accuracy']:.2f} ({m['accuracy_low']:.2f}-"
                    f"{m['accuracy_high']:.2f}) | {m['trace_rate']:.3f} | {exact} "
                    f"| {m['finished']:.2f} "
                    f"| {m['over_limit']:.2f} | {m['max_context_mean']:.0f} / "
                    f"{m['max_context_max']:.0f} | {m['generated_tokens_mean']:.0f} |"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH (a workdir or an lhc eval JSON)")
    parser.add_argument("--instances", type=int, default=None, help="instances per size")
    parser.add_argument("--size", type=int, default=None, help="the size of one-size JSON files")
    args = parser.parse_args(argv)
    runs = []
    for run in args.runs:
        label, sep, path = run.rpartition("=")
        if not sep or not path:
            raise SystemExit(f"runs: expected LABEL=PATH, got {run!r}")
        runs.append((label, generation_metrics(path, args.instances, args.size)))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
