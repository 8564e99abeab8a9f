"""The memory estimate against hand-computed sizes of LLaMA-3.1-8B, and the paper-setup
path of ``lhc bench rapid`` on a small Hugging Face checkpoint written here."""

import json

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from lhc import lm
from lhc.rapid import memory_estimate
from lhc.rapid.bench import main


def test_memory_estimate_of_llama_3_1_8b():
    config = lm.get_preset("llama3.1-8b")
    got = memory_estimate(
        config, context_len=131_072, rag_len=5462, new_tokens=256, gamma=10, prefill_chunk=2048
    )
    # bfloat16: 8,030,261,248 parameters; a cached token is K and V of 32 layers x 8 heads
    # x 128 channels x 2 bytes = 128 KiB.
    slot = 2 * 32 * 8 * 128 * 2
    want = dict(
        target_weights=8_030_261_248 * 2,
        draft_weights=0,
        target_cache=(131_072 + 267) * slot,
        draft_cache=(5462 + 267) * slot,
        round_buffers=4 * 128_256 * (3 * 11 + 10),
        prefill_scores=4 * 32 * 2048 * (131_072 + 267),
    )
    for name, value in want.items():
        assert got[name] == value, name
    assert got["total"] == sum(want.values())
    flash = memory_estimate(
        config, context_len=131_072, rag_len=5462, new_tokens=256, attention_impl="flash"
    )
    assert flash["prefill_scores"] == 0 and flash["target_cache"] == want["target_cache"]
    assert round(got["target_cache"] / 2**30, 2) == 16.03
    # Upward speculation adds the drafter's weights and its own, deeper cache slots.
    small = lm.get_preset("llama3.2-1b")
    upward = memory_estimate(
        small, config, context_len=1000, rag_len=100, new_tokens=10, gamma=4, batch_size=2
    )
    assert upward["draft_weights"] == 8_030_261_248 * 2
    assert upward["draft_cache"] == 2 * (100 + 15) * slot


@pytest.fixture
def setup_files(tmp_path):
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the grass is green and the sky is blue"] * 50 + ["the pass key is 12345"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    config = lm.LMConfig.tiny(vocab_size=300, max_len=512)
    lm.hf.save(config, lm.init_params(config, jax.random.key(0)), tmp_path / "model")
    filler = "the grass is green and the sky is blue. " * 8
    with open(tmp_path / "data.jsonl", "w") as handle:
        for key in ("12345", "67890"):
            example = dict(
                context=filler + f"the pass key is {key}. " + filler,
                question="what is the pass key?",
                answers=["no such answer"],
            )
            handle.write(json.dumps(example) + "\n")
    return tmp_path


def test_setup_runs_on_a_checkpoint(setup_files):
    flags = [
        "--setup",
        "rapid_llama.py:llama3.1-8b",
        "--repeats",
        "1",
        "--config.target=tiny",
        "--config.dtype=float32",
        "--config.contexts=(256,)",
        "--config.attention_impl=xla",
        f"--config.target_checkpoint={setup_files / 'model'}",
        f"--config.tokenizer={setup_files / 'tokenizer.json'}",
        f"--config.data={setup_files / 'data.jsonl'}",
        "--config.retrieval.chunk_size=16",
        "--config.retrieval.min_budget=48",
        "--config.decoding.new_tokens=4",
        "--config.decoding.gamma=2",
    ]
    result = main(flags)
    assert [row["context"] for row in result["memory"]] == [256]
    rows = {row["method"]: row for row in result["measured"]}
    assert set(rows) == {"target", "rag", "rapid eta=10"}
    assert all(row["accuracy"] == 0.0 for row in rows.values())  # no generation holds it
    assert 0.0 <= rows["rapid eta=10"]["acceptance"] <= 1.0
    assert np.isfinite(rows["rapid eta=10"]["tokens_per_s"])
    with pytest.raises(SystemExit, match="is not a llama3.2-1b"):
        main([f if f != "--config.target=tiny" else "--config.target=llama3.2-1b" for f in flags])


def test_passkey_questions_and_scoring():
    from lhc.rapid.bench import passkey_questions, starts_with_answer
    from lhc.train.passkey import NEEDLE, QUESTION

    tokenizer = lm.ByteTokenizer()
    contexts, questions, answers = passkey_questions(1000, 3, seed=4)
    for depth, context, question, answer in zip((0.0, 0.5, 1.0), contexts, questions, answers):
        assert len(context) == 1000 and tokenizer.decode(question.tolist()) == QUESTION
        key = tokenizer.decode(answer)
        needle = tokenizer.encode(NEEDLE.format(key=key))
        text = context.tolist()
        at = next(i for i in range(len(text)) if text[i : i + len(needle)] == needle)
        assert abs(at - depth * (1000 - len(needle))) <= 1
        assert starts_with_answer(np.asarray(answer + [5, 6]), answer)
        assert not starts_with_answer(np.asarray([answer[1], *answer]), answer)


def test_bench_on_a_random_model(tmp_path, capsys):
    path = tmp_path / "out.json"
    flags = (
        "--context-lengths 256 --samples 2 --new-tokens 4 --gamma 2 --etas 0 --upward-etas 0 "
        "--chunk-size 32 --min-budget 64 --repeats 1"
    ).split()
    results = main([*flags, "--json", str(path)])
    rows = {row["method"]: row for row in results[256]}
    assert list(rows) == ["target", "rag", "rapid eta=0"]
    assert rows["target"]["speedup"] == 1.0  # the baseline against itself
    assert "acceptance" in rows["rapid eta=0"] and "acceptance" not in rows["rag"]
    assert "| 256 | rapid eta=0 |" in capsys.readouterr().out
    written = json.loads(path.read_text())
    assert [row["method"] for row in written["256"]] == list(rows) and "footer" in written


def test_model_flags():
    with pytest.raises(SystemExit):  # one source per model
        main(["--workdir", "a", "--checkpoint", "b"])
    with pytest.raises(SystemExit):
        main(["--etas", "0,x"])
    with pytest.raises(SystemExit, match="--workdir: "):
        main(["--workdir", "/nonexistent/run", "--context-lengths", "256"])


def test_fact_sweep_in_context_batches_resumes_and_matches_one_batch(setup_files, tmp_path):
    """--context-batch 1 prefills each context apart: the same answers as one batch of
    both, one prefill record per context, and a rerun adds nothing."""
    import shutil

    from lhc import stats

    model = setup_files / "model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(setup_files / name, model / name)
    rng = np.random.default_rng(0)
    words = "the grass is green and the sky is blue while rivers run to the sea".split()
    book = [" ".join(rng.choice(words, 12)) + "." for _ in range(400)]
    (tmp_path / "book.txt").write_text("\n".join(book))
    flags = (
        f"--checkpoint {model} --dtype float32 --haystack {tmp_path / 'book.txt'} "
        "--context-lengths 256 --samples 2 --facts-per-context 1 --paraphrased 0.5 "
        "--new-tokens 4 --gamma 2 --etas 0 --upward-etas 0 --chunk-size 32 --min-budget 160"
    ).split()
    apart, together = tmp_path / "apart.jsonl", tmp_path / "together.jsonl"
    main([*flags, "--context-batch", "1", "--results", str(apart)])
    main([*flags, "--results", str(together)])
    first, second = stats.read_records(apart), stats.read_records(together)
    assert [r["contexts"] for r in first if r["pass"] == "prefill"] == [[0], [1]]
    assert [r["contexts"] for r in second if r["pass"] == "prefill"] == [[0, 1]]

    def answers(records):
        out = {}
        for r in records:
            if r["pass"] == "accuracy":
                for c, text, right in zip(r["contexts"], r["answers"], r["correct"]):
                    out[r["method"], r["set"], c] = (text, right)
        return out

    assert answers(first) == answers(second) and len(answers(first)) == 3 * 2  # methods x contexts
    main([*flags, "--context-batch", "1", "--results", str(apart)])
    assert len(stats.read_records(apart)) == len(first)
