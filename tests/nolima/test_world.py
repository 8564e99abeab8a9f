"""The generated world of latent associations, its training task and the bench."""

import hashlib
import json
import re

import jax
import numpy as np
import pytest

from lhc import lm, nolima
from lhc.nolima import bench, world
from lhc.train.config import load_config
from lhc.train.tasks import get_task

W = world.World.generate(seed=3)


def test_the_world_is_consistent_and_its_names_distinct():
    assert len(W.landmarks) == 36 and len(W.cities) == 12 and len(W.regions) == 4
    names = [*W.landmarks, *W.cities, *W.regions]
    assert len(set(names)) == len(names)
    for landmark in range(36):
        landmark_name, city, region = W.args(landmark)
        assert W.cities.index(city) == W.city_of[landmark]
        assert W.regions.index(region) == W.region_of[W.city_of[landmark]]


@pytest.mark.parametrize("question_type", ["onehop", "twohop", "direct"])
def test_a_training_sequence_needs_the_learned_association(question_type):
    tokenizer = lm.ByteTokenizer()
    rng = np.random.default_rng(7)
    for _ in range(5):
        ex = world.world_example(
            rng, W, length=400, decoy_rate=0.3, question_types=(question_type,)
        )
        tokens, targets, weights = ex["tokens"][0], ex["targets"][0], ex["weights"][0]
        assert tokens.shape == targets.shape == weights.shape == (399,)
        np.testing.assert_array_equal(tokens[1:], targets[:-1])
        text = tokenizer.decode(tokens)
        context, question = text.split("\nQuestion: ")
        answer = tokenizer.decode(targets[weights > 0], skip_special_tokens=False)
        name = answer.strip().removesuffix("<eos>")
        assert answer == f" {name}<eos>" and question.endswith(f"\nAnswer: {name}")
        asked = re.match(r"Which character (?:has visited|lives next to) (.+)\?", question).group(1)
        lines = [line for line in context.split("\n") if "lives" in line]
        needle = [line for line in lines if re.search(rf"\b{name}\b", line)]
        assert len(needle) == 1  # one needle; every other such line is a decoy
        landmark = next(i for i, lm_name in enumerate(W.landmarks) if lm_name in needle[0])
        slot = {"direct": 0, "onehop": 1, "twohop": 2}[question_type]
        assert W.args(landmark)[slot] == asked
        decoys = 0
        for line in lines:
            other = [i for i, lm_name in enumerate(W.landmarks) if lm_name in line]
            if line is not needle[0] and other:  # (a cut last line may lack its landmark)
                decoys += 1
                assert W.region_of_landmark(other[0]) != W.region_of_landmark(landmark)
        assert decoys >= 1
        if question_type != "direct":  # the keyword asked about is nowhere in the context
            assert asked not in context


def test_the_world_as_a_needle_set_and_haystack():
    experiments = W.needle_set(regions=(0, 1))
    assert nolima.parse_needle_set(nolima.to_json(experiments)) == experiments
    cases = nolima.needle_cases(experiments)
    assert len(cases) == 2 * 18 * 3
    literal = [
        nolima.rouge1_precision(c.question, c.needle.replace("{CHAR}", "Yuki"))
        for c in cases
        if c.question_type != "direct"
    ]
    assert np.mean(literal) < 0.1
    lines = W.haystack_lines(400, decoy_regions=(2, 3), decoy_rate=0.2, seed=1)
    decoys = [line for line in lines if "lives" in line]
    assert 40 < len(decoys) < 120
    for line in decoys:
        landmark = next(i for i, name in enumerate(W.landmarks) if name in line)
        assert W.region_of_landmark(landmark) in (2, 3)
    # Decoy names never collide with the answers' names.
    assert nolima.names_absent(experiments[0].character_set, lines) == experiments[0].character_set


def test_world_task_batches_from_its_config():
    config = load_config("configs/nolima_world.py:model=decoder,runlocal=True")
    config.data.length, config.data.min_length = 160, 96
    task = get_task(config.task)(config, None, None)
    batch = next(task.train_iterator(0, 1))
    assert batch["tokens"].shape == (8, 160)
    real = batch["lm_weights"].sum(axis=1)
    assert (real >= 96).all() and (real <= 160).all() and len(set(real.tolist())) > 1
    assert ((batch["weights"] > 0) <= (batch["lm_weights"] > 0)).all()
    config.data.question_types = ("threehop",)
    with pytest.raises(ValueError, match="config.data.question_types: unknown"):
        get_task(config.task)(config, None, None).train_iterator(0, 1).__next__()


def test_bench_sweep_writes_resumable_results(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    flags = "--world --lengths 250 --depths 2 --pairs 2 --max-new-tokens 2"
    argv = [*flags.split(), "--results", str(results), "--json", str(tmp_path / "s.json")]
    out = bench.main(argv)
    assert out["tests"] == 4 and len(nolima.read_results(results)) == 4
    again = bench.main(argv)
    assert "4 of 4 tests already in" in capsys.readouterr().out
    assert again["by_length"] == out["by_length"]
    assert json.loads((tmp_path / "s.json").read_text())["tests"] == 4
    assert bench._without_lengths(["--lengths", "8", "--tests", "2", "--lengths=9"]) == [
        "--tests",
        "2",
    ]


def test_bench_throughput_runs_each_length_in_a_child_process(tmp_path, capsys):
    flags = (
        "--world --throughput --lengths 300 --tests 2 --batch-size 2 --max-new-tokens 2 --pairs 2"
    )
    argv = [*flags.split(), "--json", str(tmp_path / "t.json")]
    out = bench.main(argv)
    (row,) = out["rows"]
    assert (row["length"], row["tests"], row["batch_size"]) == (300, 2, 2)
    assert row["tests_per_s"] > 0 and row["peak_rss_gb"] > 0 and row["prompt_tokens"] > 300
    assert "length     300: 2 tests in " in capsys.readouterr().out
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["rows"][0]["length"] == 300 and written["footer"].startswith("device: ")


def test_bench_lists_and_depths_on_the_command_line(capsys):
    args = bench._parser().parse_args(["--depths", "3", "--haystack", "a.txt,b.txt"])
    assert args.depths == [0.0, 0.5, 1.0] and args.haystack == ["a.txt", "b.txt"]
    assert args.lengths == [250, 500, 1000, 2000, 4000] and args.question_types is None
    args = bench._parser().parse_args(["--depths", "0.25,1", "--question-types", "onehop"])
    assert args.depths == [0.25, 1.0] and args.question_types == ["onehop"]
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["--lengths", "250,x"])
    assert "--lengths: expected comma-separated ints, got '250,x'" in capsys.readouterr().err


def test_bench_sweeps_a_needle_set_file_on_an_imported_checkpoint(tmp_path, capsys):
    """The official-set path: a Hugging Face checkpoint, its BPE tokenizer and chat
    template, a needle-set file and a haystack text file (filtered and shuffled)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    book = [
        f"The {w} walked along the shore and said nothing for {i} hours."
        for i, w in enumerate(["fisherman", "teacher", "sailor", "widow"] * 30)
    ]
    book.append("Nobody in Brussels had heard of the Atomium before.")
    (tmp_path / "book.txt").write_text("\n".join(book))
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(book * 3, trainer)
    tokenizer.decoder = decoders.ByteLevel()
    model_dir = tmp_path / "model"
    config = lm.LMConfig.tiny(vocab_size=300, max_len=512)
    lm.hf.save(config, lm.init_params(config, jax.random.key(0)), model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    chat = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": chat})
    )
    needles = nolima.to_json(nolima.lhc_needle_set()[:2])  # one template, both orders
    (tmp_path / "needles.json").write_text(json.dumps(needles))
    flags = (
        "--filter --shuffle 200 --haystacks 2 --orders alternate --probe --lengths 300 "
        "--depths 0.5 --question-types onehop,direct --max-new-tokens 2 --label tiny"
    ).split()
    out = bench.main(
        ["--checkpoint", str(model_dir), "--dtype", "float32"]
        + ["--needle-set", str(tmp_path / "needles.json"), "--haystack", str(tmp_path / "book.txt")]
        + [*flags, "--results", str(tmp_path / "r.jsonl")]
    )
    # 5 facts, one order each, 2 question types, 2 shuffles of the book; before them the
    # knowledge check: the 5 one-hop pairs at 3 depths of a third, held-out shuffle.
    assert out["tests"] == 20 and out["pairs"] == 10
    records = nolima.read_results(tmp_path / "r.jsonl")
    probe = [r for r in records if r["set"] == "probe"]
    sweep = [r for r in records if r["set"] == "sweep"]
    assert len(probe) == 15 and {r["haystack"] for r in probe} == {"book.txt#probe"}
    assert {r["length"] for r in probe} == {250} and {r["question_type"] for r in probe} == {
        "onehop"
    }
    assert {r["haystack"] for r in sweep} == {"book.txt", "book.txt#1"}
    orders = {r["test"]: r["experiment"] for r in sweep}
    assert orders == {
        "T01": "0101",
        "T02": "0101Inv",
        "T03": "0101",
        "T04": "0101Inv",
        "T05": "0101",
    }
    assert all(r["prompt_tokens"] > 300 for r in sweep)  # context plus the chat around it
    with open(model_dir / "model.safetensors", "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    assert {(r["model"], r["source"]) for r in records} == {("tiny", digest)}
    assert all(r["lhc_commit"] for r in records)
    # --known-only: the knowledge check's rows made to say that the model answered T01's
    # one-hop question at all 3 depths, T03's at 2 and T05's at 1: facts T01 and T03 are
    # known (2 of 3 at least), and the sweep keeps their one-hop and direct questions
    # (already in the file: nothing runs again).
    hits = {"T01": 3, "T03": 2, "T05": 1}
    seen = {}
    for r in probe:
        seen[r["test"]] = seen.get(r["test"], 0) + 1
        r["correct"] = seen[r["test"]] <= hits.get(r["test"], 0)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in probe + sweep))
    argv = ["--checkpoint", str(model_dir), "--dtype", "float32", "--results"]
    argv += [str(tmp_path / "r.jsonl"), "--needle-set", str(tmp_path / "needles.json")]
    argv += ["--haystack", str(tmp_path / "book.txt"), *flags]
    known = bench.main([*argv, "--known-only"])
    assert known["tests"] == 2 * 2 * 2 and known["pairs"] == 4  # facts x types x haystacks
    assert len(nolima.read_results(tmp_path / "r.jsonl")) == len(records)
    argv.remove("--probe")
    with pytest.raises(SystemExit, match="--known-only needs --probe"):
        bench.main([*argv, "--known-only"])
    with pytest.raises(SystemExit):
        bench.main(["--checkpoint", str(model_dir), "--workdir", str(tmp_path)])
    assert "argument --workdir: not allowed with argument --checkpoint" in capsys.readouterr().err
