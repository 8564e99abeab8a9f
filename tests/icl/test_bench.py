"""The icl benches end to end on briefly trained models and a small HF checkpoint."""

import json
import pathlib

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lhc import lm, train
from lhc.icl import bench, families, mixtures
from lhc.train import config as config_lib

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
QUIET = ["progress_bar=False", "tensorboard=False", "async_checkpointing=False"]


def _trained(name, workdir):
    config = config_lib.load_config(str(CONFIGS / name) + ":runlocal", QUIET)
    train.train_and_evaluate(config, str(workdir))
    return str(workdir)


def test_superposition_curve_from_a_workdir(tmp_path, capsys):
    workdir = _trained("icl_superposition.py", tmp_path / "model")
    result = bench.main(
        ["superposition", "--workdir", workdir, "--prompts", "3", "--points", "3", "--task-vectors"]
    )
    out = capsys.readouterr().out
    assert (
        "\n| d | realised | P(bias_add(2)) | P(bias_add(6)) | other | KL | both >= 0.1 |\n" in out
    )
    assert "\n| w | P(bias_add(2)) | P(bias_add(6)) |\n|---:|---:|---:|\n| 0.0 | " in out
    rows = result["rows"]
    assert [r["d"] for r in rows] == [0.0, 0.5, 1.0]
    assert rows[0]["realised"] == 0.0 and rows[-1]["realised"] == 1.0
    for r in rows:
        assert 0 < r["first"] and 0 < r["second"] and r["first"] + r["second"] <= 1
        want = sum(
            d * np.log(d / p) for d, p in ((r["d"], r["first"]), (1 - r["d"], r["second"])) if d > 0
        )
        assert r["kl"] == pytest.approx(want, rel=1e-6)
    vectors = result["task_vectors"]
    assert [r["w"] for r in vectors["rows"]] == [0.0, 0.5, 1.0]
    assert 0 <= vectors["layer"] < 4 and np.shape(vectors["per_layer"]) == (2, 4)
    assert all(0 < r["first"] + r["second"] <= 1 for r in vectors["rows"])


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A small random Hugging Face checkpoint with a BPE tokenizer trained on sums."""
    rng = np.random.default_rng(0)
    family = families.get_family("addition")
    prompts = [
        families.superposition_prompt(rng, family, {"digits": 1.0}, 3).text for _ in range(30)
    ]
    numbers = [
        " ".join(families.number_words(n, lang) for n in range(100, 199, 7))
        for lang in families.LANGUAGES
    ]
    corpus = prompts + numbers
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<unk>", "<s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    model_dir = tmp_path_factory.mktemp("hf") / "model"
    config = lm.LMConfig.tiny(vocab_size=320, max_len=256)
    lm.hf.save(config, lm.init_params(config, jax.random.key(0)), model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def _checkpoint_args(model_dir, *extra):
    source = ["--checkpoint", str(model_dir), "--tokenizer", str(model_dir / "tokenizer.json")]
    return ["superposition", *source, *"--demos 4 --prompts 2 --dtype float32".split(), *extra]


def test_families_on_an_hf_checkpoint(hf_model, tmp_path, capsys):
    loaded = lm.load_tokenizer(str(hf_model / "tokenizer.json"))
    for text, answer in (("12+30->", "42"), ("50+51->", "cent un")):
        tokens = mixtures.answer_tokens(loaded, text, answer)
        assert loaded.decode(loaded.encode(text) + tokens) == text + answer
    family = families.get_family("addition")
    result = bench.main(_checkpoint_args(hf_model, "--family", "addition"))
    even = result["addition"]
    (row,) = even["rows"]
    assert even["tasks"] == list(family.tasks) and row["proportions"] == [0.25] * 4
    mean = np.array(even["mean"])
    assert mean.shape == (4,) and (mean > 0).all() and mean.sum() < 1
    assert even["top"] == row["top"] and even["top"] in (0.0, 0.5, 1.0)
    # A full answer is its first token and more: never more probable than the first token.
    assert (mean <= np.array(row["first"]["mean"])).all()
    for kind in ("first", "full"):
        assert row[kind]["other"] == pytest.approx(1 - sum(row[kind]["mean"]))
        assert 0 <= row[kind]["spread"] <= 1 and row[kind]["kl"] >= row[kind]["kl_within"] >= 0
    header = "| d | P(digits) | P(english) | P(french) | P(spanish) | other | KL | KL within |"
    assert header + " spread | top-K |\n" in capsys.readouterr().out


def test_a_proportion_sweep_and_single_tasks_on_a_checkpoint(hf_model, tmp_path, capsys):
    path = tmp_path / "sweep.json"
    args = [
        "--family",
        "addition",
        "--tasks",
        "english,digits",
        "--points",
        "3",
        "--baseline",
        "--repeats",
        "1",
    ]
    results = tmp_path / "sweeps.jsonl"
    result = bench.main(
        _checkpoint_args(hf_model, *args, "--json", str(path), "--results", str(results))
    )
    sweep = result["addition"]
    assert [r["proportions"] for r in sweep["rows"]] == [[0, 1], [0.5, 0.5], [1, 0]]
    # The raw record keeps every prompt's probabilities: their means are the table's.
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["tasks"] == ["english", "digits"] and len(record["source"]) == 64
    for row in record["rows"]:
        for kind in ("first", "full"):
            per_prompt = np.array(row["per_prompt"][kind])
            assert per_prompt.shape == (2, 2)  # --prompts 2 (the test's), 2 tasks
            np.testing.assert_allclose(per_prompt.mean(0), row[kind]["mean"], rtol=1e-4)
    again = bench.main(_checkpoint_args(hf_model, *args[:6], "--results", str(results)))
    assert again == {} and len(results.read_text().splitlines()) == 1
    for kind in ("first", "full"):
        calibration = sweep["calibration"][kind]
        assert len(calibration["grows"]) == 2 and -1 <= calibration["r"] <= 1
    assert json.loads(path.read_text())["addition"]["tasks"] == ["english", "digits"]
    out = capsys.readouterr().out
    assert "\n| 0.50 | " in out and "calibration: english " in out
    assert "addition: 3 mixtures, prompts padded to " in out and " s (compilation " in out
    assert sweep["compile_seconds"] > 0  # its shapes are new: the first call compiled
    # The first mixture's prompts, each prompt + answer also run alone: the same scores.
    assert sweep["baseline"]["largest_difference"] < 1e-4
    assert "baseline: 2 prompts of d = 0.00, best of 1: each prompt + answer run separately " in out
    single = bench.main(_checkpoint_args(hf_model, "--family", "copy", "--single-task"))
    assert set(single["copy"]) == {"copy_a", "copy_b", "sum"}
    for row in single["copy"].values():
        assert row["proportions"] == [1, 0, 0] and 0 <= row["greedy_accuracy"][0] <= 1
    out = capsys.readouterr().out
    assert "| family | task | P(first token) | first-token acc | P(answer) | greedy acc" in out
    assert "\n| copy | copy_a | " in out


def test_an_interrupted_sweep_measures_only_the_points_it_lacks(hf_model, tmp_path, monkeypatch):
    args = _checkpoint_args(
        hf_model, *"--family addition --tasks english,digits --points 3".split()
    )
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    bench.main([*args, "--results", str(whole)])
    measure, calls = mixtures.measure, []

    def stop_at_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measure(*a, **k)

    monkeypatch.setattr(mixtures, "measure", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        bench.main([*args, "--results", str(resumed)])
    points = tmp_path / "resumed.jsonl.points"
    assert [json.loads(line)["point"] for line in points.read_text().splitlines()] == [0, 1]
    assert not resumed.exists()
    bench.main([*args, "--results", str(resumed)])
    assert len(calls) == 4  # the third point alone
    assert not points.exists()
    timing = ("seconds", "compile_seconds", "lhc_commit")
    (a,), (b,) = (
        [json.loads(line) for line in path.read_text().splitlines()] for path in (whole, resumed)
    )
    for record in (a, b):
        for key in timing:
            record.pop(key, None)
        for row in record["rows"]:
            row.pop("seconds")
    assert a == b


@pytest.mark.parametrize(
    "args, message",
    [
        ("--checkpoint x --points 1", "--points: expected an integer >= 2, got 1"),
        ("--checkpoint x --prompts 0", "--prompts: expected an integer >= 1, got 0"),
        ("--checkpoint x --single-task --points 3", "--single-task: expected without --tasks"),
        ("--workdir x --baseline", "--baseline: expected with --checkpoint, got --workdir"),
    ],
)
def test_bad_superposition_flags(args, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["superposition", *args.split()])
    assert message in capsys.readouterr().err


def test_bad_superposition_choices(hf_model, capsys):
    with pytest.raises(SystemExit, match="--tasks: expected one --family, got 2"):
        bench.main(_checkpoint_args(hf_model, "--family", "copy,case", "--tasks", "copy"))
    with pytest.raises(SystemExit, match="--family: unknown task family 'nope'"):
        bench.main(_checkpoint_args(hf_model, "--family", "nope"))
    with pytest.raises(
        SystemExit,
        match=r"--tasks: expected two or more distinct tasks of "
        r"family 'copy' \(copy_a, copy_b, sum\), got copy_a,upper",
    ):
        bench.main(_checkpoint_args(hf_model, "--family", "copy", "--tasks", "copy_a,upper"))
    with pytest.raises(SystemExit):
        bench.main(["superposition", "--workdir", "x", "--tasks", "a"])
    assert "--tasks and --single-task: expected with --checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["superposition", "--prompts", "2"])
    assert "one of the arguments --checkpoint --workdir is required" in capsys.readouterr().err


def test_the_first_argument_picks_the_benchmark(capsys):
    for argv in ([], ["vector"], ["--workdir", "x"]):
        with pytest.raises(SystemExit, match="the first argument is superposition or vectors"):
            bench.main(argv)
    with pytest.raises(SystemExit):
        bench.main(["vectors", "--workdir", "x", "--ext-shots", "1,two"])
    assert "--ext-shots: expected comma-separated ints, got '1,two'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^0$"):
        bench.main(["--help"])
    assert "lhc bench icl superposition --workdir" in capsys.readouterr().out


def test_vectors_table_from_a_workdir(tmp_path, capsys):
    workdir = _trained("icl_classification.py", tmp_path / "model")
    with pytest.raises(SystemExit, match="^--workdir '.*missing': "):
        bench.main(["vectors", "--workdir", str(tmp_path / "missing")])
    flags = (
        "--tasks 1 --episodes 3 --val-episodes 4 --test-episodes 6 --ext-shots 1 "
        "--strengths 0.5,0.9 --ext-strengths 0.5"
    ).split()
    result = bench.main(
        ["vectors", "--workdir", workdir, *flags, "--json", str(tmp_path / "v.json")]
    )
    (row,) = result["rows"]
    out = capsys.readouterr().out
    assert (
        "| task | seed | labels | clean F1 (acc) | Task Vectors F1 (acc, layer) | Iterative "
        "Vectors F1 (acc; ext_shot, strength, ext_strength) |\n|---|---:|---|---|---|---|\n| 1 | 1 | "
    ) in out
    means = f"| {row['clean_f1']:.3f} | {row['tv_f1']:.3f} | {row['iv_f1']:.3f} |"
    assert f"| 1 | 1 {means}" in out and f"| all | 1 {means}" in out
    written = json.loads((tmp_path / "v.json").read_text())
    assert written["rows"][0]["task"] == "1" and written["shots"] == 1
    assert written["argv"] and written["footer"].startswith("device: ")
    for key in ("clean_f1", "tv_f1", "iv_f1", "clean_acc", "tv_acc", "iv_acc"):
        assert 0 <= row[key] <= 1
    assert len(row["grid"]) == 2 and row["strength"] in (0.5, 0.9)
    assert row["iv_val_f1"] == max(g["macro_f1"] for g in row["grid"])
    layers = config_lib.load_run_config(workdir).model.num_layers
    assert 0 <= row["tv_layer"] < layers and len(row["tv_val_f1"]) == layers
    # Runs recorded one by one, in one table.
    twice = f"{tmp_path / 'v.json'},{tmp_path / 'v.json'}"
    merged = bench.main(["vectors", "--merge", twice])
    assert merged["mean"]["runs"] == 2 and merged["mean"]["iv_f1"] == pytest.approx(row["iv_f1"])
    with pytest.raises(SystemExit, match="give --checkpoint, --workdir or --merge"):
        bench.main(["vectors"])
