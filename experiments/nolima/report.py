"""The tables of ``experiments/nolima`` from its raw results (``lhc report``): one block
per results file, rendered by ``lhc.nolima.report``."""

from __future__ import annotations

from lhc.nolima import report


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    return {name: report.render(records) for name, records in results.items()}
