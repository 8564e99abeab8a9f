"""Every benchmark that runs a language model takes ``--checkpoint`` through one loader
(``lhc.train.load_language_model``): here a tiny random GGUF file with a byte-level BPE
tokenizer and a chat template, in each bench's smallest setting. What each bench
measures is tested with its own package; this checks the checkpoint reaches it with
its tokenizer."""

import json

import jax
import numpy as np
import pytest

from lhc import lm
from lhc.bench import lm as lm_bench
from lhc.data.topics import TOPICS, TopicTask
from lhc.emloc import bench as emloc_bench
from lhc.icl import bench as icl_bench
from lhc.quantspec import bench as quantspec_bench
from lhc.rapid import bench as rapid_bench

from .lm import _gguf_files


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer Llama GGUF whose vocabulary has the topic sentences' words and the
    labels " A".." H" as single tokens."""
    rng = np.random.default_rng(0)
    task = TopicTask(tuple(TOPICS), labels="letters")
    corpus = [
        f"Text: {task.sentence(rng, i % 8)}\nTopic:{task.label_texts()[i % 8]}\n\n"
        for i in range(400)
    ] + list(_gguf_files.CORPUS)
    vocab = _gguf_files.byte_level_vocab(corpus, vocab_size=700)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return str(_gguf_files.write_gguf(path, "llama", vocab, context=4096))


def test_lm_decode(checkpoint):
    flags = "--prompt-len 8 --decode-steps 3 --repeats 1".split()
    result = lm_bench.main(["--checkpoint", checkpoint, "--real-config", "", *flags])
    (row,) = result["measured"]
    assert row["config"] == checkpoint and row["cached_matches_recompute"] == 1.0


def test_quantspec(checkpoint):
    # The measurement itself runs on a tiny model in tests/quantspec; here the checkpoint
    # and prompts of filler text in its own tokens.
    model, params, tokenizer = quantspec_bench.load_model(None, None, checkpoint)
    layers = lm.default_layers()  # one compiled block: switched on a CPU
    assert all(getattr(model.config, key) == value for key, value in layers.items())
    assert layers["switch_layers"] == (jax.default_backend() == "cpu")
    assert tokenizer.encode("Topic:") != list(b"Topic:")
    prompts = quantspec_bench.filler_prompts(2, 40, tokenizer=tokenizer)
    assert prompts.shape == (2, 40) and prompts.max() < model.config.vocab_size
    assert tokenizer.decode(prompts[0].tolist()).strip().startswith("The grass is green.")


def test_icl_vectors(checkpoint, tmp_path):
    results = tmp_path / "iv.jsonl"
    flags = (
        "--word-tasks topic-letters --shots 1 --episodes 2 --val-episodes 2 --test-episodes 4 "
        f"--ext-shots 1 --strengths 0.1 --ext-strengths 0.1 --results {results}"
    ).split()
    result = icl_bench.main(["vectors", "--checkpoint", checkpoint, *flags])
    (row,) = result["rows"]
    assert row["labels"] == ["A", "B", "C", "D"] and row["task"] == "topic-letters"
    assert 0 <= row["clean_f1"] <= 1 and 0 <= row["iv_f1"] <= 1
    # The raw record: every test episode's class and predictions, traced to the weights;
    # a rerun finds the case done.
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["model"] == checkpoint and len(record["source"]) == 64
    true = np.array(record["test_classes"])
    assert len(true) == 4 and set(record["predicted"]) == {"clean", "tv", "iv"}
    assert record["iv_acc"] == np.mean(np.array(record["predicted"]["iv"]) == true)
    again = icl_bench.main(["vectors", "--checkpoint", checkpoint, *flags])
    assert again["rows"][0]["iv_f1"] == row["iv_f1"] and len(results.read_text().splitlines()) == 1
    flags = "--clean-only --word-tasks case-letters --seeds 1,2 --val-episodes 3".split()
    chosen = icl_bench.main(["vectors", "--checkpoint", checkpoint, *flags])
    assert [(r["task"], r["seed"], r["chance"]) for r in chosen["rows"]] == [
        ("case-letters", 1, 1 / 3),
        ("case-letters", 2, 1 / 3),
    ]


def test_emloc(checkpoint, tmp_path):
    results = tmp_path / "emloc.jsonl"
    flags = (
        "--tasks sentiment-letters --shots 2 --episodes 1 --queries 1 --chunk-size 2 "
        f"--deltas 0.05 --ratios 0.5 --results {results}"
    ).split()
    result = emloc_bench.main(["--checkpoint", checkpoint, *flags])
    methods = {row["method"] for row in result["table"]}
    assert methods == {"full context", "EMLoC", "uniform", "SnapKV-style", "fewer shots"}
    # Each episode's rows in the results file, traced to the weights; a rerun with one
    # more episode runs only that one.
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 5 and {r["episode"] for r in records} == {0}
    assert records[0]["setting"]["shots"] == 2 and len(records[0]["source"]) == 64
    flags[flags.index("--episodes") + 1] = "2"
    again = emloc_bench.main(["--checkpoint", checkpoint, *flags])
    assert len(again["rows"]) == 10 and len(results.read_text().splitlines()) == 10
    assert again["rows"][:5] == records


def test_rapid(checkpoint):
    flags = (
        "--context-lengths 256 --samples 2 --new-tokens 4 --gamma 2 --etas 0 --chunk-size 32 "
        "--min-budget 64 --repeats 1"
    ).split()
    results = rapid_bench.main(["--checkpoint", checkpoint, *flags])
    methods = [row["method"] for row in results[256]]
    assert methods == ["target", "rag", "rapid eta=0"]


def test_a_missing_checkpoint_is_one_line(tmp_path):
    for main, front in ((emloc_bench.main, []), (icl_bench.main, ["vectors"])):
        with pytest.raises(SystemExit, match="--checkpoint: checkpoint '.*missing': no such"):
            main([*front, "--checkpoint", str(tmp_path / "missing")])


def test_rapid_fact_questions_resume_after_a_stop(checkpoint, tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("\n".join(["the quick brown fox jumps over the lazy dog today"] * 200))
    results = tmp_path / "results.jsonl"
    flags = (
        f"--haystack {book} --results {results} --context-lengths 160 --samples 2 "
        "--facts-per-context 2 --new-tokens 3 --gamma 2 --etas 0 --chunk-size 32 --min-budget 64"
    ).split()
    first = rapid_bench.main(["--checkpoint", checkpoint, *flags])
    # One prefill, 2 question sets x 3 methods (accuracy), 3 methods on set 0 (speed).
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 1 + 2 * 3 + 3 == len(first["records"])
    rows = {row["method"]: row for row in first["summary"]}
    assert list(rows) == ["target", "rag", "rapid eta=0"]
    assert all(row["questions"] == 4 and row["tokens_per_s"] > 0 for row in rows.values())
    assert 0 <= rows["rapid eta=0"]["acceptance"] <= 1
    # A stop: the last two records lost, the one before cut mid-line.
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join(lines[:-3]) + lines[-3][:20])
    again = rapid_bench.main(["--checkpoint", checkpoint, *flags])
    redone = [json.loads(line) for line in results.read_text().splitlines()]
    key = lambda r: (r["pass"], r["method"], r.get("set"))  # noqa: E731
    assert [key(r) for r in redone] == [key(r) for r in records]
    assert [r["correct"] for r in redone[1:]] == [r["correct"] for r in records[1:]]
    assert len(again["records"]) == len(records)


def test_rapid_fact_questions_bad_input_is_one_line(checkpoint, tmp_path):
    flags = ["--checkpoint", checkpoint, "--context-lengths", "160"]
    with pytest.raises(SystemExit, match="--haystack .*: haystack paths: .* is not a file"):
        rapid_bench.main([*flags, "--haystack", str(tmp_path / "missing.txt")])
    book = tmp_path / "book.txt"
    book.write_text("a line of the book, long enough to be kept\n" * 50)
    with pytest.raises(SystemExit, match=r"count must lie in \[1, 120\] .*got 123"):
        rapid_bench.main([*flags, "--haystack", str(book), "--samples", "41"])
