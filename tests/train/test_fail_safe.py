"""Runs that end badly lose nothing: SIGKILL at random moments, a diverging run, and
evaluation from the workdir alone. The runs are ``lhc train`` processes."""

import collections
import glob
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lhc import cli, train
from lhc.train import metrics as metrics_lib
from lhc.train import telemetry

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "lm_assoc_recall.py")
OVERRIDES = [
    "--config.batch_size=8",
    "--config.log_every=1",
    "--config.eval_every=5",
    "--config.eval_batches=1",
    "--config.progress_bar=False",
    "--config.data.num_pairs=4",
    "--config.data.num_queries=2",
    "--config.model.max_len=11",
    "--config.model.num_layers=1",
]


def _command(workdir, *extra):
    lhc = pathlib.Path(sys.executable).parent / "lhc"
    return [
        str(lhc),
        "train",
        "--config",
        CONFIG + ":tiny",
        "--workdir",
        str(workdir),
        *OVERRIDES,
        *extra,
    ]


def _env(cache_dir=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # a device count of the parent's dropped; its other flags (tests/conftest.py) kept
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    if cache_dir is not None:  # the runs compile once between them
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(cache_dir),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    return env


STEPS = ["--config.num_steps=16", "--config.checkpoint_every=3"]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, compile_cache):
    """One uninterrupted 16-step run."""
    workdir = tmp_path_factory.mktemp("straight")
    subprocess.run(
        _command(workdir, *STEPS), env=_env(compile_cache), check=True, capture_output=True
    )
    return workdir


def _last_step(workdir) -> int:
    rows = train.read_metrics(str(workdir))
    return max((row["step"] for row in rows), default=0)


def _saves(workdir) -> set:
    return set(glob.glob(os.path.join(workdir, "checkpoints", "*tmp*")))


def _inside_a_new_save(workdir):
    """True while a save folder exists that was not there when the run started."""
    stale = _saves(workdir)
    return lambda w: bool(_saves(w) - stale)


def _run_and_kill(workdir, env, kill_when, timeout=120.0) -> bool:
    """Starts a run and SIGKILLs it once ``kill_when(workdir)`` holds; returns whether it
    was killed (a run may finish first)."""
    proc = subprocess.Popen(
        _command(workdir, *STEPS), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_when(workdir):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.001)
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, proc.stderr.read()
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _measured_apart(rows) -> list[dict]:
    """The rows without their wall-clock columns (step time, tokens/s, ...)."""
    return [{k: v for k, v in row.items() if k not in telemetry.COLUMNS} for row in rows]


def _scalars(workdir) -> dict:
    """``{(tag, step): [values]}`` of every TensorBoard scalar event in the workdir."""
    found = collections.defaultdict(list)
    for path in glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")):
        for record in metrics_lib.read_event_records(path):
            event = metrics_lib.event_of(record)
            for value in event.summary.value:
                if value.tag in telemetry.COLUMNS:
                    continue
                found[(value.tag, event.step)].append(value.simple_value)
    return found


def _params(workdir):
    _, params, step = train.restore_params(None, str(workdir))
    return jax.device_get(params), step


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path, straight, compile_cache):
    killed, env = tmp_path / "killed", _env(compile_cache)
    # At a random step, inside a checkpoint save, at a random step beyond the rows the
    # killed runs left.
    rng = np.random.default_rng(0)
    moment = int(rng.integers(4, 11))
    assert _run_and_kill(killed, env, lambda w: _last_step(w) >= moment)
    assert _run_and_kill(killed, env, _inside_a_new_save(killed))
    moment = int(rng.integers(_last_step(killed) + 1, 16)) if _last_step(killed) < 14 else None
    if moment is not None:
        assert _run_and_kill(killed, env, lambda w: _last_step(w) >= moment)
    subprocess.run(_command(killed, *STEPS), env=env, check=True, capture_output=True)

    rows = train.read_metrics(str(killed))
    assert _measured_apart(rows) == _measured_apart(train.read_metrics(str(straight)))
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 17))
    assert [r["step"] for r in rows if "eval/loss" in r] == [5, 10, 15, 16]
    ours, theirs = _scalars(killed), _scalars(straight)
    assert ours.keys() == theirs.keys()
    assert all(len(values) == 1 for values in ours.values())
    assert ours == theirs
    (a, step_a), (b, step_b) = _params(killed), _params(straight)
    assert step_a == step_b == 16
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not glob.glob(str(killed / "checkpoints" / "*tmp*"))


def test_diverging_run_fails_cleanly(tmp_path):
    diverge = [
        "--config.num_steps=20",
        "--config.checkpoint_every=3",
        "--config.log_every=50",
        "--config.optimizer.learning_rate=1e6",
        "--config.optimizer.warmup_steps=60",  # rising through the run: NaN, not a collapse
        "--config.optimizer.grad_clip_norm=0",
    ]
    proc = subprocess.run(
        _command(tmp_path, *diverge), env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    # The loss, or before it the gradient, of one step is NaN; the message names it.
    named = re.search(r"lhc train: (training loss|gradient norm) is nan at step (\d+)", proc.stderr)
    assert named, proc.stderr
    assert "Traceback" not in proc.stderr  # nothing from the main or background threads
    assert "Exception" not in proc.stderr
    checkpointer = train.Checkpointer(str(tmp_path / "checkpoints"), read_only=True)
    saved = checkpointer.all_steps()
    checkpointer.close()
    assert not glob.glob(str(tmp_path / "checkpoints" / "*tmp*"))
    first_bad = int(named.group(2))
    assert all(step < first_bad for step in saved)
    for step in saved:
        _, params, _ = train.restore_params(None, str(tmp_path), step)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(params)))


def test_eval_from_the_workdir_alone_and_with_another_optimizer(straight, capsys):
    recorded = json.loads((straight / "config.json").read_text())
    assert (
        recorded["command"].startswith("lhc train")
        and "--config.num_steps=16" in recorded["command"]
    )
    assert recorded["config"]["num_steps"] == 16
    final = [row for row in train.read_metrics(str(straight)) if "eval/loss" in row][-1]

    assert cli.main(["eval", "--workdir", str(straight)]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["step"] == 16 and alone["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-6)

    # Another optimizer (without clipping: another optimizer-state tree) and step count.
    other = [*OVERRIDES, "--config.optimizer.name=sgd", "--config.optimizer.grad_clip_norm=0"]
    assert cli.main(["eval", "--config", CONFIG + ":tiny", "--workdir", str(straight), *other]) == 0
    captured = capsys.readouterr()  # the warning reaches the terminal through lhc's handler
    evaluated = json.loads(captured.out)
    assert evaluated["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-6)
    for key in (
        "lhc: the config differs from the one recorded",
        "optimizer.name: 'adamw' -> 'sgd'",
        "optimizer.grad_clip_norm",
        "num_steps: 16 -> 1200",
    ):
        assert key in captured.err
    with pytest.raises(SystemExit, match="holds no config.json"):
        cli.main(["eval", "--workdir", str(straight / "nothing")])
