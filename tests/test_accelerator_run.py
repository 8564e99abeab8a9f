"""The accelerator run (experiments/accelerator/run.sh) in --smoke mode: every section
runs on this CPU with tiny shapes and the GPU kernels interpreted, so the script a GPU
machine runs cannot rot. Each kernel's output is checked against its float32 jnp
reference, QuantSpec's speculative tokens against plain decoding on the same cache,
and lhc's TabICL probabilities against tabicl 0.1.4's."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "experiments" / "accelerator" / "run.sh"
SECTIONS = ("ceilings", "flash", "chunk", "quant", "decode", "quantspec", "tabicl")


@pytest.mark.slow
def test_the_smoke_run(tmp_path):
    """One test (the run takes about a minute and a half; under pytest-xdist a module
    fixture would run it once per worker): every section and row, then each check."""
    smoke = _smoke(tmp_path)
    for check in (
        _every_section_ran_every_row,
        _kernels_match_their_references,
        _decoding_and_quantspec,
        _tabicl_matches_the_reference,
    ):
        check(smoke)


def _smoke(out):
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", LHC_WHEELS=str(out / "none"))
    proc = subprocess.run(
        [str(RUN), str(out), "--smoke"], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    return out, results["rows"]


def _table(rows, name):
    return [row for row in rows if row["table"] == name]


def _every_section_ran_every_row(smoke):
    out, rows = smoke
    assert {row["section"] for row in rows} == set(SECTIONS)
    broken = [row for row in rows if "error" in row or "skipped" in row]
    assert not broken, json.dumps(broken, indent=1)[:4000]
    assert not _table(rows, "section_failed")
    report = (out / "report.md").read_text()
    for title in (
        "Flash attention",
        "Chunk retrieval",
        "QuantSpec store attention",
        "Greedy decoding",
        "QuantSpec self-speculation",
        "TabICL: reference / lhc",
    ):
        assert f"## {title}" in report
    assert (out / "log.txt").read_text().count("accelerator: section") == len(SECTIONS)


def _kernels_match_their_references(smoke):
    _, rows = smoke
    impls = {
        (row["table"], row.get("impl") or row.get("store")) for row in rows if "rel_err" in row
    }
    # Pallas and XLA for each kernel, the vendor attention and both store widths.
    assert {
        ("flash", "pallas"),
        ("flash", "xla"),
        ("flash", "jax.nn (xla)"),
        ("chunk", "pallas"),
        ("quant", "4-bit (pallas)"),
        ("quant", "8-bit (pallas)"),
        ("buffer", None),
    } <= impls
    for row in rows:
        if "rel_err" not in row:
            continue
        assert math.isfinite(row["rel_err"]) and math.isfinite(row["max_abs_err"]), row
        # bf16 inputs, float32 accumulation: rounding bf16 outputs alone costs ~4e-3;
        # the quantized store is dequantized exactly as the reference does, in float32.
        tolerance = 1e-5 if row["table"] in ("quant", "buffer") else 1e-2
        assert row["rel_err"] < tolerance, row
    directions = {(row["table"], row["direction"]) for row in rows if "direction" in row}
    assert {("flash", "fwd+bwd"), ("chunk", "fwd+bwd"), ("flash_blocks", "fwd")} <= directions


def _decoding_and_quantspec(smoke):
    _, rows = smoke
    decode = _table(rows, "decode")
    assert [row["batch"] for row in decode] == [1, 2]
    for row in decode:
        assert row["tokens_per_s"] > 0 and row["gb_per_step"] > 0
    paths = {row["path"]: row for row in _table(rows, "quantspec")}
    assert len(paths) == 4
    speculative = [row for path, row in paths.items() if path.startswith("speculative")]
    for row in speculative:
        assert 0 <= row["acceptance"] <= 1 and row["rounds"] >= 1
    # Greedy self-speculation emits exactly plain decoding's tokens on the same cache.
    plain = paths["plain, 8-bit QuantSpec cache"]
    assert plain["spec_bf16_equal"] is True and plain["spec_int4_equal"] is True


def _tabicl_matches_the_reference(smoke):
    _, rows = smoke
    measured = _table(rows, "tabicl")
    assert {row["impl"] for row in measured} == {"reference", "lhc"}
    (ratio,) = _table(rows, "tabicl_ratio")
    assert ratio["max_abs_proba_diff"] < 1e-4 and ratio["time_ratio"] > 0


def test_run_sh_rejects_a_missing_out_and_a_cpu_without_smoke(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", LHC_WHEELS=str(tmp_path))
    proc = subprocess.run([str(RUN)], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    proc = subprocess.run(
        [str(RUN), str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "JAX sees no accelerator (platform 'cpu'); pass --smoke" in proc.stdout + proc.stderr
