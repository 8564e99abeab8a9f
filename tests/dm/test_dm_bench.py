"""lhc bench dm at the tiny size: the rows, DT's FLOPs per action against a count by
hand, DM's below DT's when its routed layer selects fewer tokens, the table and the JSON
file. The timer reports chosen seconds (the real ones are only checked to be positive),
so the actions per second are checked against closed forms."""

import contextlib
import io
import json
import math

import numpy as np
import pytest

from lhc.dm import bench

from ..support import fixed_timings

# Seconds per call the timer reports for each model and batch.
SECONDS = {
    ("dt", 1): 0.5,
    ("dt", 3): 0.6,
    ("dm", 1): 0.8,
    ("dm", 3): 1.2,
    ("dm_noaux", 1): 2.0,
    ("dm_noaux", 3): 2.5,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The result, the JSON file, what was printed and the real timings."""
    path = tmp_path_factory.mktemp("dm") / "dm.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as monkeypatch:
        measured = fixed_timings(monkeypatch, interleaved=SECONDS.__getitem__)
        result = bench.main(
            ["--size", "tiny", "--repeats", "1", "--batches", "1,3", "--json", str(path)]
        )
    return result, path, printed.getvalue(), measured


def test_rows(run):
    result, _, _, measured = run
    rows = result["rows"]
    assert [(r["model"], r["selection"], r["batch"]) for r in rows] == [
        ("dt", None, 1),
        ("dt", None, 3),
        ("dm", "aux", 1),
        ("dm", "aux", 3),
        ("dm_noaux", "topk", 1),
        ("dm_noaux", "topk", 3),
    ]
    assert len(measured) == 6 and all(0 < s < math.inf for s in measured)
    # One action per window of the batch: 1 / 0.5 s, 3 / 0.6 s, 1 / 0.8 s, ...
    actions_per_s = [2.0, 5.0, 1.25, 2.5, 0.5, 1.2]
    for row, want in zip(rows, actions_per_s, strict=True):
        assert row["seconds"] == SECONDS[row["model"], row["batch"]]
        assert row["actions_per_s"] == pytest.approx(want)
    dt, dm = rows[0], rows[2]
    assert dt["selected_tokens"] == [] and dt["selected_fraction"] is None
    # Same blocks; the router adds a score, a capacity MLP (12 * 16 -> 16 -> 1) and an
    # auxiliary predictor (16 -> 8 -> 2).
    router = (16 + 1) + (12 * 16 * 16 + 16) + (16 + 1) + (16 * 8 + 8) + (8 * 2 + 2)
    assert dm["parameters"] - dt["parameters"] == router
    for row in rows[2:]:
        (count,) = row["selected_tokens"]  # 2 layers: layer 1 routed
        assert 0 <= count <= 12 and row["selected_fraction"] == pytest.approx(count / 12)


def test_dt_flops_by_hand(run):
    rows = run[0]["rows"]
    d, t, layers = 16, 12, 2  # width, 3K tokens
    per_token = 3 * d * d + d * d + d * 4 * d + 4 * d * d  # q/k/v, attention out, MLP
    attention = 2 * t * t * d  # scores and the weighted sum of values, all heads
    expected = layers * 2 * (t * per_token + attention)  # 2 FLOPs per multiply-add
    assert expected == 165_888
    assert all(r["flops_per_action"] == expected for r in rows if r["model"] == "dt")


def test_dm_flops_below_dt_when_fewer_tokens(run):
    rows = run[0]["rows"]
    dt_flops = rows[0]["flops_per_action"]
    routed = [r for r in rows if r["model"] != "dt"]
    # Top-k at the initial capacity (about half the window) selects some, not all.
    assert all(0 < r["selected_fraction"] < 1 for r in routed if r["model"] == "dm_noaux")
    fewer = [r for r in routed if r["selected_fraction"] <= 0.5]
    assert fewer and all(r["flops_per_action"] < dt_flops for r in fewer)
    # Fewer tokens, fewer FLOPs.
    order = np.argsort([r["selected_fraction"] for r in routed], kind="stable")
    flops = [routed[i]["flops_per_action"] for i in order]
    assert flops == sorted(flops)


def test_table_and_json(run):
    result, path, out, _ = run
    assert "tiny size: layers 2, heads 1, width 16, K 4 (12 tokens)" in out
    assert "| model | selection | batch | ms / call | actions/s |" in out
    assert "| dt |  | 1 | 500.00 | 2.0 |" in out and "| dm | aux | 3 | 1200.00 | 2.5 |" in out
    assert "device: " in out
    written = json.loads(path.read_text())
    assert written["rows"] == result["rows"] and written["size"] == "tiny"
    assert written["sizes"]["context"] == 4


def test_unknown_model_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--models", "dt,dmx"])
    assert "--models: unknown ['dmx']" in capsys.readouterr().err
