import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from lhc import cli

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "lm_assoc_recall.py")
FAST = [
    "--config.num_steps=2",
    "--config.batch_size=4",
    "--config.eval_batches=1",
    "--config.progress_bar=False",
    "--config.data.num_pairs=4",
    "--config.data.num_queries=2",
    "--config.model.max_len",  # the space-separated form
    "11",
]


def test_train_then_eval(tmp_path, capsys):
    assert cli.main(["train", "--config", CONFIG + ":tiny", "--workdir", str(tmp_path), *FAST]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["step"] == 2
    assert os.path.exists(tmp_path / "metrics.jsonl")
    assert list((tmp_path / "tensorboard").iterdir())  # an event file
    assert cli.main(["eval", "--config", CONFIG + ":tiny", "--workdir", str(tmp_path), *FAST]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["step"] == 2
    assert evaluated["eval/loss"] == pytest.approx(trained["eval/loss"], rel=1e-6)
    # Associative recall reads key and value ids, not text: no tokenizer to generate with.
    with pytest.raises(SystemExit, match="has no tokenizer and its model reads \\d+ token ids"):
        cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "ab"])


def test_generate_on_a_run_of_byte_tokens(tmp_path, capsys):
    """A run whose task reads bytes (QuantSpec's passkey model): its checkpoint, bytes
    in and out, and the reply of ``lhc.lm.generate`` on the restored parameters."""
    from lhc import lm
    from lhc.train import load_language_model

    config = str(pathlib.Path(CONFIG).with_name("quantspec_passkey.py")) + ":tiny,runlocal"
    fast = [
        "--config.num_steps=2",
        "--config.progress_bar=False",
        "--config.data.length=128",
        "--config.eval_batches=1",
        "--config.batch_size=2",
    ]
    assert cli.main(["train", "--config", config, "--workdir", str(tmp_path), *fast]) == 0
    capsys.readouterr()
    argv = ["generate", "--workdir", str(tmp_path), "--prompt", "The pass key is"]
    assert cli.main([*argv, "--max-new-tokens", "6"]) == 0
    ckpt = load_language_model(workdir=tmp_path)
    assert isinstance(ckpt.tokenizer, lm.ByteTokenizer)
    out = lm.generate(
        ckpt.model,
        ckpt.params,
        [ckpt.tokenizer.encode("The pass key is")],
        max_new_tokens=6,
        stop_tokens=ckpt.stop_tokens,
    )
    n = int(out.lengths[0])
    reply = [t for t in out.tokens[0, :n].tolist() if t not in ckpt.stop_tokens]
    assert capsys.readouterr().out == ckpt.tokenizer.decode(reply) + "\n"
    # An inference command reads the run without the trainer, optimizers or metrics.
    code = (
        "import json, sys\n"
        "from lhc import cli\n"
        f"cli.main({[*argv, '--max-new-tokens', '2']!r})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('lhc', 'optax')))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "lhc.train.runs" in loaded
    trainer = {"lhc.train.trainer", "lhc.train.metrics", "lhc.train.optim", "optax"}
    assert loaded & trainer == set()


def test_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown key 'num_stepz'.*did you mean num_steps"):
        cli.main(["train", "--config", CONFIG, "--workdir", str(tmp_path), "--config.num_stepz=1"])
    with pytest.raises(SystemExit, match="no config file at 'nope.py'"):
        cli.main(["train", "--config", "nope.py:tiny", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        cli.main(["eval", "--config", CONFIG, "--workdir", str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match="overrides are not accepted"):
        cli.main(["demo", "--config.num_steps=1"])


def test_console_script_reports_bad_key_and_exits_nonzero(tmp_path):
    lhc = pathlib.Path(sys.executable).parent / "lhc"
    proc = subprocess.run(
        [
            str(lhc),
            "train",
            "--config",
            CONFIG + ":tiny",
            "--workdir",
            str(tmp_path),
            "--config.optimizer.learning_rat=1",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lhc train: config override") and "unknown key 'learning_rat'" in last
    assert "Traceback" not in proc.stderr


def test_version(capsys):
    import tomllib

    declared = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lhc {declared['project']['version']}"


def test_sigterm_saves_and_the_same_command_resumes(tmp_path):
    # What a scheduler or a preempted VM sends: the run saves the step it is on, says
    # how to resume, and exits 128 + 15 without a traceback; the same command resumes.
    lhc = pathlib.Path(sys.executable).parent / "lhc"
    command = [str(lhc), "train", "--config", CONFIG + ":tiny", "--workdir", str(tmp_path)]
    command += [*FAST[1:], "--config.num_steps=100000", "--config.log_every=1"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("train/loss") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    step = int(re.search(r"SIGTERM at step (\d+): checkpoint saved; run the same", stderr)[1])
    assert str(step) in os.listdir(tmp_path / "checkpoints")
    again = subprocess.run(
        [*command, f"--config.num_steps={step + 1}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 0 and f"lhc: resumed from step {step}" in again.stderr
    assert json.loads(again.stdout)["step"] == step + 1


def test_arguments_are_checked_before_anything_is_built(tmp_path):
    workdir = str(tmp_path / "run")
    (tmp_path / "file").write_text("")
    bench_setup = str(pathlib.Path(CONFIG).with_name("rapid_llama.py"))
    for args, message in (
        (
            [CONFIG, workdir, "--config.num_steps=-5"],
            r"^lhc train: config.num_steps: expected an integer >= 1, got -5$",
        ),
        (
            [CONFIG, str(tmp_path / "file")],
            r"--workdir '.*file': expected a directory, found a file",
        ),
        ([bench_setup, workdir], r"^lhc train: the config has no 'task', .*not a training config"),
    ):
        with pytest.raises(SystemExit, match=message):
            cli.main(["train", "--config", args[0], "--workdir", *args[1:]])
    assert not os.path.exists(workdir)
    with pytest.raises(SystemExit, match=r"^lhc eval: --step: expected a step >= 0, got -1$"):
        cli.main(["eval", "--config", CONFIG, "--workdir", workdir, "--step", "-1"])


def test_plot_draws_a_panel_per_metric(tmp_path, capsys):
    rows = [
        {"step": 1, "train/loss": 3.0, "train/accuracy": 0.1},
        {"step": 2, "train/loss": 2.5, "train/accuracy": 0.2},
        {"step": 2, "eval/loss": 2.7, "eval/chance_loss": 3.4},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["plot", "--workdir", str(tmp_path)]) == 0
    path = capsys.readouterr().out.strip()
    assert path == str(tmp_path / "metrics.png")
    png = pathlib.Path(path).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (720, 528)  # two panels (loss, accuracy) of 6 x 2.2 inches at 120 dpi
    with pytest.raises(SystemExit, match="^lhc plot: --workdir '.*empty': no metrics to plot"):
        cli.main(["plot", "--workdir", str(tmp_path / "empty")])


def test_train_help_shows_an_example_and_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert "--config.KEY=VALUE" in shown and "example:\n  lhc train --config configs/" in shown
