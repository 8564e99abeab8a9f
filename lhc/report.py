"""``lhc report EXPERIMENT_DIR``: an experiment's tables from its committed raw results.

An experiment directory holds ``results/*.jsonl`` (one JSON record per test, see
``lhc.stats``; ``*.jsonl.gz`` when compressed) and ``report.py``, which defines::

    def render(results: dict[str, list[dict]]) -> dict[str, str]

``results`` maps each results file's name (without ``.jsonl[.gz]``) to its records; the
returned mapping names markdown blocks. ``lhc report DIR`` prints them; ``--write`` puts
each into ``DIR/README.md`` between ``<!-- report: NAME -->`` and ``<!-- /report -->``,
so every table in a README can be rendered again from the files it came from.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

from lhc.stats import read_records


def load_results(directory: str) -> dict[str, list[dict]]:
    """``{file name without .jsonl: records}`` of ``directory/results/*.jsonl`` and
    ``*.jsonl.gz``.

    Raises:
        ValueError: one name in both forms (which of the two is meant is unclear).
    """
    results = {}
    for suffix in (".jsonl", ".jsonl.gz"):
        for path in sorted(glob.glob(os.path.join(directory, "results", "*" + suffix))):
            name = os.path.basename(path)[: -len(suffix)]
            if name in results:
                raise ValueError(
                    f"{path}: results {name!r} are also in {name}.jsonl; keep one of the two"
                )
            results[name] = read_records(path)
    return dict(sorted(results.items()))


def render(directory: str) -> dict[str, str]:
    """The experiment's markdown blocks (its ``report.py`` applied to its results).

    Raises:
        FileNotFoundError: no ``report.py`` or no results in ``directory``.
    """
    script = os.path.join(directory, "report.py")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{directory!r} has no report.py (expected {script})")
    results = load_results(directory)
    if not results:
        raise FileNotFoundError(f"{directory!r} has no results/*.jsonl or *.jsonl.gz")
    spec = importlib.util.spec_from_file_location("_experiment_report", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "render", None)):
        raise FileNotFoundError(f"{script} defines no render(results)")
    return dict(module.render(results))


BLOCK = re.compile(r"(<!-- report: (\S+) -->\n)(.*?)(<!-- /report -->)", re.DOTALL)


def write_readme(directory: str, blocks: dict[str, str]) -> list[str]:
    """Replaces each ``<!-- report: NAME -->`` block of ``directory/README.md`` with
    ``blocks[NAME]``; returns the names written.

    Raises:
        ValueError: a block of the README that ``blocks`` lacks, or a block of ``blocks``
            that the README lacks (named).
    """
    path = os.path.join(directory, "README.md")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    found = [m.group(2) for m in BLOCK.finditer(text)]
    missing = sorted(set(found) - set(blocks))
    if missing:
        raise ValueError(f"{path}: blocks {missing} are not rendered by report.py")
    unplaced = sorted(set(blocks) - set(found))
    if unplaced:
        raise ValueError(
            f"{path}: no '<!-- report: NAME -->' ... '<!-- /report -->' block for {unplaced}"
        )
    text = BLOCK.sub(lambda m: m.group(1) + blocks[m.group(2)].strip() + "\n" + m.group(4), text)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return found
