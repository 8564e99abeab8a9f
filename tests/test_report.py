"""lhc report: an experiment's tables from its results files, into its README."""

import gzip
import json

import pytest

from lhc import cli, report

REPORT = """
from lhc import stats

def render(results):
    out = {}
    for name, rows in results.items():
        hits = sum(r["correct"] for r in rows)
        low, high = stats.wilson_interval(hits, len(rows))
        out[name] = f"{name}: {hits}/{len(rows)} [{low:.2f}, {high:.2f}]"
    return out
"""


def experiment(tmp_path, readme):
    (tmp_path / "results").mkdir()
    for name, correct in (("a", [1, 1, 0, 1]), ("b", [0, 0])):
        lines = [json.dumps({"test": i, "correct": bool(c)}) for i, c in enumerate(correct)]
        (tmp_path / "results" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def test_report_prints_and_writes_the_readme_blocks(tmp_path, capsys):
    readme = (
        "# x\n\n<!-- report: a -->\nstale\n<!-- /report -->\n\ntext\n"
        "<!-- report: b -->\n<!-- /report -->\nend\n"
    )
    directory = experiment(tmp_path, readme)
    assert cli.main(["report", str(directory)]) == 0
    # 3 of 4: the Wilson interval is (0.30, 0.95), written here from its closed form.
    assert "a: 3/4 [0.30, 0.95]" in capsys.readouterr().out
    assert cli.main(["report", str(directory), "--write"]) == 0
    assert (directory / "README.md").read_text() == (
        "# x\n\n<!-- report: a -->\na: 3/4 [0.30, 0.95]\n<!-- /report -->\n\ntext\n"
        "<!-- report: b -->\nb: 0/2 [0.00, 0.66]\n<!-- /report -->\nend\n"
    )


def test_missing_pieces_are_named(tmp_path):
    directory = experiment(tmp_path, "<!-- report: a -->\n<!-- /report -->\n")
    with pytest.raises(ValueError, match=r"no '<!-- report: NAME -->' .* block for \['b'\]"):
        report.write_readme(str(directory), report.render(str(directory)))
    (directory / "report.py").unlink()
    with pytest.raises(SystemExit, match="lhc report: .* has no report.py"):
        cli.main(["report", str(directory)])


def test_compressed_results_are_read_and_one_name_in_both_forms_is_refused(tmp_path):
    directory = experiment(tmp_path, "<!-- report: a -->\n<!-- /report -->\n")
    plain = directory / "results" / "b.jsonl"
    (directory / "results" / "b.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    with pytest.raises(ValueError, match=r"b.jsonl.gz: results 'b' are also in b.jsonl"):
        report.load_results(str(directory))
    plain.unlink()
    assert report.render(str(directory))["b"] == "b: 0/2 [0.00, 0.66]"
