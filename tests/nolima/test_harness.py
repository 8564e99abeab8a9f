"""lhc.nolima: needle sets, haystacks and placement, prompts, scoring, resumable runs."""

import json
import os

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from lhc import lm, nolima

WORDS = "the river ran past old stone houses while a quiet wind moved over green hills".split()


def lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(5, 14))).capitalize() + "." for _ in range(n)]


def bpe_tokenizer(text_lines):
    """A small BPE tokenizer trained here: token counts differ from bytes."""
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["[UNK]", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text_lines, trainer)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return lm.tokenizers.HFTokenizer(tokenizer, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_needle_starts_at_the_first_line_at_or_after_the_requested_token_depth(kind):
    text = lines(300)
    tokenizer = lm.ByteTokenizer() if kind == "bytes" else bpe_tokenizer(text)
    haystack = nolima.Haystack(text, tokenizer)
    needle = "Actually, Yuki once stood right beneath the Atomium."
    needle_ids = tokenizer.encode(needle + "\n")
    # The haystack's tokens and line starts, computed here line by line.
    flat, starts = [], []
    for line in text:
        starts.append(len(flat))
        flat += tokenizer.encode(line + "\n")
    for length in (250, 1000):
        budget = length - len(needle_ids)
        for depth in (0.0, 0.1, 0.37, 0.5, 0.9, 1.0):
            p = haystack.place(needle, length=length, depth=depth)
            assert len(p.tokens) == length
            inside = [s for s in starts if s < budget]
            end = budget if budget in starts else inside[-1]  # never after a cut line
            want = next((s for s in inside if s >= round(depth * budget)), end)
            assert p.needle_start == want
            assert abs(p.needle_start - depth * budget) < max(len(t) for t in haystack.line_tokens)
            assert p.tokens[want : want + len(needle_ids)] == needle_ids
            rest = p.tokens[:want] + p.tokens[want + len(needle_ids) :]
            assert rest == flat[:budget]
    with pytest.raises(ValueError, match="holds .* tokens, fewer than"):
        haystack.place(needle, length=haystack.num_tokens + 100, depth=0.5)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\], got 1.5"):
        haystack.place(needle, length=250, depth=1.5)


def test_distractor_and_multiple_choice_variants():
    tokenizer = lm.ByteTokenizer()
    haystack = nolima.Haystack(lines(300), tokenizer)
    case = nolima.needle_cases(nolima.lhc_needle_set(), ("onehop",))[0]
    fmt = nolima.PromptFormat(task_template="{haystack}\nQ: {question}\nA:", add_bos=False)
    for depth in (0.0, 0.5, 1.0):
        test = nolima.Test(case, 0, 1000, depth, "distractor")
        built = nolima.build(test, haystack, tokenizer, fmt)
        d = built["distractor_depth"]
        assert 0.2 <= d <= 0.8 and abs(d - depth) >= 0.2
        text = tokenizer.decode(built["tokens"])
        assert (
            text.count(case.distractor) == 1
            and case.needle.replace("{CHAR}", built["name"]) in text
        )
    built = nolima.build(nolima.Test(case, 0, 250, 0.5, "mc"), haystack, tokenizer, fmt)
    options = tokenizer.decode(built["tokens"]).split("Options: ")[1].split(".")[0].split(", ")
    assert len(set(options)) == 4 and built["name"] in options
    assert set(options) <= set(case.character_set)


def test_shuffled_haystack_filters_and_names(tmp_path):
    book = tmp_path / "book.txt"
    body = [f"Line {i} of the book, long enough to be kept as text here." for i in range(50)]
    book.write_text(
        "CHAPTER I\n"
        + "\n".join(body[:25])
        + "\n\nshort\nCHAPTER II\n"
        + "\n".join(body[25:])
        + "\nYuki walked to Brussels in the rain, said Olga.\n"
    )
    out = nolima.shuffled_haystack([book], num_lines=120, snippet_chars=200, seed=1)
    assert len(out) == 120 and not any(
        line.startswith("CHAPTER") or line == "short" for line in out
    )
    assert set(out) <= set(body) | {"Yuki walked to Brussels in the rain, said Olga."}
    kept, dropped = nolima.filter_lines(out, ["brussels", "Atomium"])
    assert dropped == sum("Brussels" in line for line in out) and all(
        "Brussels" not in k for k in kept
    )
    assert (
        nolima.names_absent(["Yuki", "Olga", "Katie", "Yu"], out) == ("Katie", "Yu") or not dropped
    )
    with pytest.raises(ValueError, match="is not a file"):
        nolima.shuffled_haystack([tmp_path / "missing.txt"])


def test_contains_scoring_is_case_sensitive():
    assert nolima.contains("The answer is Yuki.", ["Yuki"])
    assert not nolima.contains("the answer is yuki", ["Yuki"])
    assert nolima.contains("Katie", ["Yuki", "Katie"])


def _records(scores):
    """Records whose pair accuracies are ``scores`` (quarters: 4 tests per pair and length)."""
    out = []
    for pair, by_length in scores.items():
        for length, value in by_length.items():
            for i in range(4):
                out.append(
                    {
                        "pair": pair,
                        "length": length,
                        "question_type": pair[-6:],
                        "depth": i / 3,
                        "correct": i < round(4 * value),
                    }
                )
    return out


def test_base_score_effective_length_and_normalized_scores_from_a_known_table():
    scores = {
        "0101/T01/onehop": {250: 1.0, 500: 1.0, 1000: 0.75, 2000: 1.0, 4000: 0.5, 8000: 1.0},
        "0101/T02/twohop": {250: 0.75, 500: 1.0, 1000: 1.0, 2000: 0.75, 4000: 0.5, 8000: 1.0},
        "0201/T01/onehop": {250: 0.75, 500: 0.75, 1000: 0.25, 2000: 0.5, 4000: 0.0, 8000: 0.5},
    }
    result = nolima.summary(_records(scores))
    # By hand: base = mean(1, 1, 0.75); scores = means over the three pairs.
    base = (1 + 1 + 0.75) / 3
    assert result["base"] == pytest.approx(base)
    want = {250: 2.5 / 3, 500: 2.75 / 3, 1000: 2 / 3, 2000: 0.75, 4000: 1 / 3, 8000: 2.5 / 3}
    assert result["by_length"] == pytest.approx(want)
    # 0.85 * base = 0.779: 500 passes, 1000 fails first; 8000 recovering is not credited.
    assert result["effective_length"] == 500
    assert result["normalized"][4000] == pytest.approx((1 / 3) / base)
    twohop = result["by_question_type"]["twohop"]
    assert twohop["base"] == 1.0 and twohop["effective_length"] is None  # 0.75 < 0.85 at 250
    assert nolima.effective_length({250: 0.1, 500: 0.9}, base=0.5) is None
    assert nolima.effective_length({250: 0.0}, base=0.0) is None
    assert "| all | 0.92 |" in nolima.table(result)


def test_rouge1_precision_and_the_lhc_needle_set():
    # Vanilla NIAH: 9 of the question's 10 words are in the needle.
    assert nolima.rouge1_precision(
        "What is the best thing to do in San Francisco?",
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park.",
    ) == pytest.approx(0.9)
    assert nolima.rouge1_precision("a a b", "a c") == pytest.approx(1 / 3)  # clipped counts
    cases = nolima.needle_cases(nolima.lhc_needle_set())
    by_type = {}
    for case in cases:
        needle = case.needle.replace("{CHAR}", case.character_set[0])
        by_type.setdefault(case.question_type, []).append(
            nolima.rouge1_precision(case.question, needle)
        )
    assert set(by_type) == {"onehop", "twohop", "direct"}
    assert np.mean(by_type["onehop"] + by_type["twohop"]) < 0.1
    assert np.mean(by_type["direct"]) > 0.3  # the literal-match control does overlap
    inverted = {c.experiment_id for c in cases if c.experiment_id.endswith("Inv")}
    assert len(inverted) >= 5 and len(by_type["onehop"]) + len(by_type["twohop"]) >= 50


def _entry(**change):
    entry = {
        "id": "0102",
        "system_prompt": "S",
        "needle": "{CHAR} saw {1}.",
        "questions": {"onehop": "Who went to {2}?"},
        "character_set": ["Ann", "Bo"],
        "tests": {"T1": {"input_args": ["the Atomium", "Brussels"]}},
    }
    entry.update(change)
    return {k: v for k, v in entry.items() if v is not None}


@pytest.mark.parametrize(
    "entry, match",
    [
        (_entry(needle=None), r"entry 1 \(id '0102'\): missing field 'needle'"),
        (
            _entry(needle="Someone saw {1}."),
            r"entry 1 \(id '0102'\): field 'needle' must be a string holding \{CHAR\}",
        ),
        (_entry(id="x1"), r"entry 1: field 'id' must be a string starting with 4 digits"),
        (
            _entry(character_set=[]),
            r"\(id '0102'\): field 'character_set' must be a non-empty list",
        ),
        (
            _entry(tests={"T1": {"input_args": ["the Atomium"]}}),
            r"\(id '0102'\), test 'T1': field 'questions.onehop' uses slot \{2\} but 'input_args' has 1",
        ),
        (
            _entry(tests={"T1": {"input_args": "Brussels"}}),
            r"test 'T1': field 'input_args' must be",
        ),
        (
            _entry(distractors={"twohop": "x {2}"}),
            r"field 'distractors' has question types \['twohop'\]",
        ),
        (_entry(id="0101"), r"entry 1 \(id '0101'\): field 'id' repeats"),
    ],
)
def test_a_malformed_needle_set_names_the_entry_and_field(tmp_path, entry, match):
    path = tmp_path / "needles.json"
    path.write_text(json.dumps([_entry(id="0101"), entry]))
    with pytest.raises(ValueError, match=match):
        nolima.load_needle_set(path)


def test_needle_set_round_trip_and_slot_filling(tmp_path):
    data = [
        _entry(
            tests={"T1": {"input_args": ["the Atomium", "Brussels"], "gold_answers": ["{CHAR}"]}}
        )
    ]
    experiments = nolima.parse_needle_set(data)
    assert nolima.to_json(experiments) == data
    (case,) = nolima.needle_cases(experiments)
    assert (case.needle, case.question, case.seed) == (
        "{CHAR} saw the Atomium.",
        "Who went to Brussels?",
        144,
    )
    official_like = nolima.lhc_needle_set()
    path = tmp_path / "set.json"
    path.write_text(json.dumps(nolima.to_json(official_like)))
    assert nolima.load_needle_set(path) == official_like


def test_chat_template_prompt_holds_the_context_tokens_exactly(tmp_path):
    tokenizer = lm.ByteTokenizer()
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
        )
    )
    chat, specials = lm.chat_template_from(tmp_path)
    assert chat == template and specials == {"bos_token": "<s>", "eos_token": "</s>"}
    case = nolima.needle_cases(nolima.lhc_needle_set())[0]
    fmt = nolima.PromptFormat(
        task_template="Read: {haystack} Q: {question}", chat_template=chat, special_tokens=specials
    )
    context = tokenizer.encode("a b c\n")
    got = nolima.prompt_tokens(tokenizer, fmt, case, context, case.question)
    want = (
        f"<s><|system|>{case.system_prompt}<|end|><|user|>Read: a b c\n Q: {case.question}"
        "<|end|><|assistant|>"
    )
    assert got == tokenizer.encode(want)
    plain = nolima.prompt_tokens(
        tokenizer, nolima.PromptFormat(task_template="{haystack}|{question}"), case, context, "Q?"
    )
    assert plain == [tokenizer.bos_id, *tokenizer.encode("a b c\n|Q?")]


def test_an_interrupted_sweep_resumes_where_it_stopped(tmp_path):
    tokenizer = lm.ByteTokenizer()
    haystacks = [nolima.Haystack(lines(200, seed), tokenizer, f"h{seed}") for seed in (0, 1)]
    cases = nolima.needle_cases(nolima.lhc_needle_set(), ("onehop", "twohop"))[:3]
    calls = []

    def answer(prompts, shared, fail_after=None):
        # The haystack up to the needle, then (several questions about one needle) the
        # context up to the question: prefixes of every prompt of the call.
        assert all(p[: shared[-1]] == prompts[0][: shared[-1]] for p in prompts)
        assert list(shared) == sorted(shared) and shared[-1] < min(map(len, prompts))
        if len(prompts) > 1:
            assert shared[-1] == nolima.common_prefix(prompts)
        if fail_after is not None and len(calls) >= fail_after:
            raise KeyboardInterrupt
        calls.append(len(prompts))
        # Answers with the name in the needle when it sits in the first half.
        out = []
        for p in prompts:
            text = tokenizer.decode(p)
            name = next(n for n in cases[0].character_set if f"{n} " in text or f" {n}." in text)
            out.append(tokenizer.encode(name if text.find(name) < len(text) / 2 else "nobody"))
        return out

    kwargs = dict(lengths=(250, 500), depths=(0.0, 0.5, 1.0), batch_size=4)
    path = tmp_path / "results.jsonl"
    with pytest.raises(KeyboardInterrupt):
        nolima.evaluate(
            None,
            None,
            tokenizer,
            cases,
            haystacks,
            results_path=path,
            generate_fn=lambda p, shared: answer(p, shared, fail_after=3),
            **kwargs,
        )
    # A call holds the questions about one needle: T01's one- and two-hop questions,
    # then T02's one-hop question, then T01's two again at the next depth.
    assert calls == [2, 1, 2] and len(nolima.read_results(path)) == 5
    with open(path, "a") as handle:
        handle.write('{"key": "plain/250/h0/0101/T0')  # a write cut short
    calls.clear()
    resumed = nolima.evaluate(
        None, None, tokenizer, cases, haystacks, results_path=path, generate_fn=answer, **kwargs
    )
    assert sum(calls) == 36 - 5
    fresh = nolima.evaluate(None, None, tokenizer, cases, haystacks, generate_fn=answer, **kwargs)
    assert _untimed(resumed) == _untimed(fresh) and len(nolima.read_results(path)) == 36
    assert {r["correct"] for r in fresh} == {True, False}
    assert all(r["correct"] == (r["depth"] < 1.0) for r in fresh if r["length"] == 500)
    # One name per needle placement: the questions about it share it, the cells do not.
    names = {}
    for r in fresh:
        names.setdefault(
            (r["experiment"], r["test"], r["haystack"], r["length"], r["depth"]), set()
        ).add(r["name"])
    assert all(len(v) == 1 for v in names.values())
    assert len({next(iter(v)) for v in names.values()}) > 3


def test_a_stop_mid_sweep_loses_no_written_test(tmp_path):
    # One test per call (the default): everything answered before the stop is on disk,
    # and the resumed sweep runs exactly the rest.
    tokenizer = lm.ByteTokenizer()
    haystack = nolima.Haystack(lines(200, 3), tokenizer)
    cases = nolima.needle_cases(nolima.lhc_needle_set(), ("direct",))[:3]
    asked = []

    def answer(prompts, shared, stop_at=None):
        if stop_at is not None and len(asked) == stop_at:
            raise KeyboardInterrupt
        asked.append(tokenizer.decode(prompts[0]))
        return [tokenizer.encode(f"answer {len(prompts[0])}")]

    kwargs = dict(lengths=(250, 300), depths=(0.0, 0.5))
    path = tmp_path / "results.jsonl"
    with pytest.raises(KeyboardInterrupt):
        nolima.evaluate(
            None,
            None,
            tokenizer,
            cases,
            [haystack],
            results_path=path,
            generate_fn=lambda p, s: answer(p, s, stop_at=5),
            **kwargs,
        )
    written = nolima.read_results(path)
    assert len(written) == 5
    assert written[0]["key"] == "plain/250/haystack/0101/T01/direct/0"
    before = list(asked)
    asked.clear()
    resumed = nolima.evaluate(
        None, None, tokenizer, cases, [haystack], results_path=path, generate_fn=answer, **kwargs
    )
    assert len(asked) == 12 - 5 and not set(asked) & set(before)
    fresh = nolima.evaluate(None, None, tokenizer, cases, [haystack], generate_fn=answer, **kwargs)
    assert _untimed(resumed) == _untimed(fresh)


def test_pairs_are_sampled_reproducibly_with_a_seed():
    cases = nolima.needle_cases(nolima.lhc_needle_set())
    drawn = nolima.sample_cases(cases, 12, seed=3)
    assert drawn == nolima.sample_cases(cases, 12, seed=3)
    assert drawn != nolima.sample_cases(cases, 12, seed=4)
    assert len({c.pair for c in drawn}) == 12
    order = [cases.index(c) for c in drawn]
    assert order == sorted(order) and order != list(range(12))
    assert nolima.sample_cases(cases, 0, seed=3) == cases == nolima.sample_cases(cases, 999, 3)
    with pytest.raises(ValueError, match="count must be >= 0"):
        nolima.sample_cases(cases, -1, seed=0)


def test_common_prefix_of_token_lists():
    assert nolima.common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert nolima.common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # one token left each
    assert nolima.common_prefix([[7, 1], [8, 1]]) == 0


def _untimed(records):
    """The records without how long their call took and how many tests it answered (a
    resumed sweep answers in other batches)."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "batch")} for r in records]


def test_evaluate_runs_a_protocol_model_batched():
    tokenizer = lm.ByteTokenizer()
    config = lm.LMConfig.tiny(vocab_size=tokenizer.vocab_size, max_len=512)
    model, params = lm.Transformer(config), lm.init_params(config, jax.random.key(0))
    haystack = nolima.Haystack(lines(100), tokenizer)
    # Three questions about one needle (nested prefixes), one about another.
    cases = nolima.needle_cases(nolima.lhc_needle_set())[:4]
    fmt = nolima.PromptFormat(task_template="{haystack}Q: {question}\nA:")
    records = nolima.evaluate(
        model,
        params,
        tokenizer,
        cases,
        [haystack],
        lengths=(250,),
        depths=(0.0, 1.0),
        fmt=fmt,
        batch_size=4,
        max_new_tokens=4,
    )
    one = nolima.model_generate(model, params, max_new_tokens=4, stop_tokens=(tokenizer.eos_id,))
    for record, test in zip(records, nolima.make_tests(cases, 1, (250,), (0.0, 1.0))):
        prompt = nolima.build(test, haystack, tokenizer, fmt)["tokens"]
        assert (
            record["prompt_tokens"]
            == len(prompt)
            == 250 + len(tokenizer.encode(f"Q: {test.case.question}\nA:")) + 1
        )
        # Batched, from the shared haystack and needle prefixes == alone from scratch.
        assert record["response"] == tokenizer.decode(one([prompt], 0)[0])
    # One call per placement and depth: the three questions about one needle, then the
    # other needle's; each record carries its call's seconds and batch size.
    assert sorted(r["batch"] for r in records) == [1, 1, 3, 3, 3, 3, 3, 3]
    calls = {}
    for r in records:
        calls.setdefault((r["depth"], r["needle_start"], r["name"]), set()).add(
            (r["seconds"], r["batch"])
        )
    assert all(len(c) == 1 for c in calls.values()) and len(calls) == 4
    assert all(r["seconds"] > 0 for r in records)
    with pytest.raises(ValueError, match="variant must be one of"):
        nolima.make_tests(cases, 1, (250,), (0.5,), variant="hard")


def test_wilson_intervals_match_scipy_and_split_literal_from_latent():
    from scipy.stats import binomtest

    for k, n in ((0, 5), (3, 10), (17, 20), (40, 40)):
        want = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        got = nolima.wilson_interval(k, n)
        np.testing.assert_allclose(got, (want.low, want.high), atol=2e-4)
    scores = {
        "0101/T01/direct": {250: 1.0, 1000: 0.75},
        "0101/T01/onehop": {250: 0.5, 1000: 0.25},
        "0101/T02/twohop": {250: 0.25, 1000: 0.0},
    }
    result = nolima.summary(_records(scores))
    literal, latent = result["literal_latent"]["literal"], result["literal_latent"]["latent"]
    assert (
        literal["intervals"][1000]["tests"] == 4 and literal["intervals"][1000]["accuracy"] == 0.75
    )
    assert latent["intervals"][250]["tests"] == 8 and latent["intervals"][250]["accuracy"] == 0.375
    low, high = nolima.wilson_interval(3, 8)
    assert latent["intervals"][250]["low"] == pytest.approx(low)
    assert latent["intervals"][250]["high"] == pytest.approx(high)
    assert "| latent | 0.38 [" in nolima.interval_table(result)


def test_plots_write_heat_maps_a_depth_curve_and_length_curves(tmp_path):
    scores = {"0101/T01/direct": {250: 1.0, 1000: 0.5}, "0101/T01/onehop": {250: 0.5, 1000: 0.0}}
    paths = nolima.plot(_records(scores), str(tmp_path))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["curves.png", "depths.png", "heatmap_direct.png", "heatmap_onehop.png"]
    for path in paths:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    lengths, depths, accuracy = nolima.scores.grid(_records(scores), "direct")
    assert lengths == [250, 1000] and accuracy.shape == (2, 4)
    np.testing.assert_array_equal(accuracy, [[1, 1, 1, 1], [1, 1, 0, 0]])
