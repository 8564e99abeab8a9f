"""Throughput columns of the train rows (step time, tokens/s, MFU), profiler traces and
the tokens/s panel of ``lhc plot``."""

import pathlib
import types

import flax.linen as nn
import jax
import pytest

from lhc import plots, train
from lhc.train import config as config_lib
from lhc.train import telemetry
from lhc.train.metrics import plot_metrics

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "lm_assoc_recall.py")
FAST = [
    "batch_size=8",
    "log_every=2",
    "checkpoint_every=100",
    "eval_batches=1",
    "progress_bar=False",
    "tensorboard=False",
    "data.num_pairs=4",
    "data.num_queries=2",
    "model.max_len=11",
    "model.num_layers=1",
]
PEAK = 1e12  # FLOP/s of the one CPU device, as a config would give it


def _config(*overrides):
    return config_lib.load_config(CONFIG + ":tiny", list(FAST) + list(overrides))


def _step_flops(config) -> float:
    """FLOPs of one train step of ``config`` on all devices, from XLA's cost analysis
    of the step compiled here on abstract arrays."""
    exp = train.build_experiment(config)
    state, batch = exp.abstract_state(), exp.abstract_batch()
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules):
        compiled = exp.jit_train_step().lower(state, batch, *exp.frozen_args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) * jax.device_count()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Six steps with a peak FLOP/s and a trace of the steps of index 3 and 4."""
    workdir = tmp_path_factory.mktemp("telemetry")
    config = _config("num_steps=6", f"peak_flops={PEAK}", "profile_steps=(3,5)")
    train.train_and_evaluate(config, str(workdir))
    rows = [row for row in train.read_metrics(str(workdir)) if "train/loss" in row]
    return workdir, config, rows


def test_rows_carry_step_time_tokens_per_s_and_mfu(run):
    _, config, rows = run
    assert [row["step"] for row in rows] == [2, 4, 6]
    tokens = config.batch_size * config.model.max_len  # batch_spec "tokens": 8 x 11
    flops = _step_flops(config)
    for row in rows:
        assert row["train/step_time_s"] > 0
        assert row["train/tokens_per_s"] == pytest.approx(tokens / row["train/step_time_s"])
        assert row["train/mfu"] == pytest.approx(flops / row["train/step_time_s"] / PEAK)
    # The first step, compiled, is timed apart and reported once.
    assert [row["step"] for row in rows if "train/compile_s" in row] == [2]
    assert rows[0]["train/compile_s"] > rows[0]["train/step_time_s"]


class _Step:
    """A jitted train step's stand-in: runs, and refuses to be compiled apart."""

    def __call__(self, state, batch):
        return state, {"loss": jax.numpy.zeros(())}

    def lower(self, *args):
        raise AssertionError("compiled for its FLOPs without a peak FLOP/s")


def test_no_mfu_column_on_a_cpu_without_peak_flops():
    config = _config()
    assert config.peak_flops is None and jax.devices()[0].platform == "cpu"
    exp = types.SimpleNamespace(config=config, mesh=jax.make_mesh((1,), ("data",)))
    clock = telemetry.step_clock(exp, {"tokens": jax.ShapeDtypeStruct((8, 11), "int32")})
    clock.first_step(_Step(), {}, {}, ())
    assert set(clock.row()) == {"train/compile_s"}  # no step in the window yet
    for _ in range(3):
        _Step()({}, {})
        clock.count()
    row = clock.row()
    assert set(row) == {"train/step_time_s", "train/tokens_per_s"}
    assert row["train/tokens_per_s"] == pytest.approx(88 / row["train/step_time_s"])


def test_profile_steps_writes_a_trace(run):
    workdir, _, _ = run
    traces = list((workdir / "profile").rglob("*.xplane.pb"))
    assert traces and all(path.stat().st_size > 0 for path in traces)


@pytest.mark.parametrize(
    "value", ["(3,3)", "(4,2)", "(-1,2)", "(1,2,3)", "(1,)", "(1.0,2)", "(True,2)", "('a',2)"]
)
def test_a_bad_profile_steps_is_refused_before_training(tmp_path, value):
    config = _config("num_steps=4", f"profile_steps={value}")
    with pytest.raises(ValueError) as caught:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    message = str(caught.value)
    assert message.startswith("config.profile_steps: expected () or two step indices")
    assert "\n" not in message
    assert not (tmp_path / "run").exists()


def test_peak_flops_table_by_device_kind():
    expected = {
        "TPU v4": 275e12,
        "TPU v4 lite": None,  # v4i, an inference chip
        "TPU v5 lite": 197e12,
        "TPU v5e": 197e12,
        "TPU v5": 459e12,
        "TPU v5p": 459e12,
        "TPU v6 lite": 918e12,
        "TPU v6e": 918e12,
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA A100-SXM4-80GB": None,
        "cpu": None,
    }
    for kind, peak in expected.items():
        found = telemetry.table_peak_flops(kind)
        assert (found[1] if found else None) == peak, kind
    config = _config()
    assert telemetry.peak_flops(config) == (None, "device kind 'cpu' has no known peak FLOP/s")
    with config.unlocked():
        config.peak_flops = 5e12
    assert telemetry.peak_flops(config)[0] == 5e12


def test_tokens_per_step_counts_tokens_else_examples():
    tokens = {"tokens": jax.ShapeDtypeStruct((8, 11), "int32")}
    assert telemetry.tokens_per_step(tokens, 8)[0] == 88
    assert telemetry.tokens_per_step({"x": jax.ShapeDtypeStruct((8, 3), "float32")}, 8)[0] == 8


def test_plot_has_a_tokens_per_s_panel(run, tmp_path, monkeypatch):
    workdir, _, _ = run
    drawn, panels = [], plots.panels
    monkeypatch.setattr(
        plots,
        "panels",
        lambda path, series, **kw: (drawn.append(list(series)), panels(path, series, **kw)),
    )
    path = plot_metrics(str(workdir), str(tmp_path / "metrics.png"))
    assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (names,) = drawn
    assert names[0] == "loss" and names[-1] == "tokens/s"
    assert not {"step_time_s", "compile_s", "mfu", "tokens_per_s"} & set(names)


@pytest.mark.parametrize("value", ["0", "-1e12", "'fast'"])
def test_a_bad_peak_flops_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=r"^config.peak_flops: expected FLOP/s of one device"):
        train.train_and_evaluate(_config(f"peak_flops={value}"), str(tmp_path / "run"))
