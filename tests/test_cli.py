import json
import os
import pathlib
import subprocess
import sys

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
    assert proc.returncode != 0
    assert "unknown key 'learning_rat' in optimizer" in proc.stderr


def test_version(capsys):
    import tomllib

    declared = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lhc {declared['project']['version']}"
