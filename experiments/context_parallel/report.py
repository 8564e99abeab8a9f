"""The table of ``experiments/context_parallel`` from its raw results.

    lhc report experiments/context_parallel [--write]

``cpu_overhead``: the step time of each setting of ``cpu_overhead.py``, the median of
its repeats, against one device measured in the same run.
"""

from __future__ import annotations


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: _overhead(rows) for name, rows in results.items() if name == "cpu_overhead"}


def _overhead(rows: list[dict]) -> str:
    lines = [
        "| date | commit | tokens | setting | step (median) | repeats | over one device "
        "| compile | ring sends per device |",
        "|---|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        sent = row["ring_bytes_sent_per_device"]
        repeats = ", ".join(f"{t:.2f}" for t in row["step_seconds_all"])
        lines.append(
            f"| {row['date']} | {row['lhc_commit']} | {row['length']:,} | {row['setting']} "
            f"| {row['step_seconds']:.2f} s | {repeats} | {row['over_one_device']:.2f}x "
            f"| {row['compile_seconds']:.0f} s | {f'{sent / 1e6:.1f} MB' if sent else '-'} |"
        )
    return "\n".join(lines) + "\n"
