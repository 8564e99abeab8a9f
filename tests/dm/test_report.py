"""The comparison table of ``lhc.dm.report`` against statistics computed here."""

import json

import numpy as np
import pytest

from configs import dm_gym
from lhc.dm import report
from lhc.train.config import save_run_config


def _run(root, dataset, model, seed, returns_mean, normalized=None, selected=()):
    config = dm_gym.get_config(f"data=/data/{dataset}.hdf5,env=Hopper-v5,model={model},seed={seed}")
    workdir = root / dataset / f"{model}-seed{seed}"
    save_run_config(config, str(workdir), "lhc train")
    records = [
        {"step": 100, "train/loss": 1.0},
        {
            "step": 1000,
            "eval/action_mse": 9.0,
            "eval/return_mean": -1.0,
            "eval/flops_per_action": 1.0,
        },
        {
            "step": 2000,
            "eval/action_mse": 0.01 * (seed + 1),
            "eval/return_mean": returns_mean,
            "eval/flops_per_action": 2e6 if model == "dt" else 1.5e6,
        }
        | ({"eval/normalized_mean": normalized} if normalized is not None else {})
        | {f"eval/selected_tokens_{i}": c for i, c in enumerate(selected)},
    ]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(workdir)


def test_table_groups_seeds_and_takes_the_last_evaluation(tmp_path):
    workdirs = [
        _run(tmp_path, "hopper-medium", "dm", 0, 1200.0, 40.0, selected=(20.0,)),
        _run(tmp_path, "hopper-medium", "dm", 1, 1000.0, 30.0, selected=(30.0,)),
        _run(tmp_path, "hopper-medium", "dt", 0, 900.0, 25.0),
        _run(tmp_path, "hopper-medium", "dm_noaux", 0, 800.0, 20.0, selected=(10.0,)),
        _run(tmp_path, "hopper-medium", "dm_fixed", 0, 700.0, 10.0, selected=(30.0,)),
    ]
    runs = [report.read_run(w) for w in workdirs]
    assert [(r["model"], r["seed"], r["dataset"]) for r in runs[:3]] == [
        ("dm", 0, "hopper-medium"),
        ("dm", 1, "hopper-medium"),
        ("dt", 0, "hopper-medium"),
    ]
    text = report.table(runs)
    rows = {line.split()[0]: line for line in text.splitlines()[2:] if line.strip()}
    assert list(rows) == ["dt", "dm", "dm_noaux", "dm_fixed"]
    dm = rows["dm"].split()
    assert dm[1:3] == ["2", "2000"]
    assert dm[3:6] == [f"{np.mean([1200.0, 1000.0]):.1f}", "±", f"{np.std([1200.0, 1000.0]):.1f}"]
    assert dm[6:9] == [f"{np.mean([40.0, 30.0]):.1f}", "±", f"{np.std([40.0, 30.0]):.1f}"]
    assert dm[9:12] == [f"{np.mean([0.01, 0.02]):.4f}", "±", f"{np.std([0.01, 0.02]):.4f}"]
    assert dm[12:] == ["1.50", "25.0"]
    assert rows["dt"].split()[12:] == ["2.00", "-"]


def test_a_run_without_rollouts_is_named(tmp_path):
    workdir = tmp_path / "run"
    save_run_config(dm_gym.get_config("data=/d.hdf5,model=dt"), str(workdir), "lhc train")
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 10, "eval/action_mse": 1.0}))
    with pytest.raises(ValueError, match="no rollout evaluation"):
        report.read_run(str(workdir))
