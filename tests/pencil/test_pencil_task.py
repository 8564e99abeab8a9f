"""PENCIL's training rows and task: loss masks against the reduction replay, the
configs, and two training steps with evaluation by generation through the trainer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from lhc.pencil import evaluation
from lhc.pencil.evaluation import EvalResult, comparison_table
from lhc.pencil.problems import make_problem, tokenizer_for
from lhc.pencil.reduction import Subsequence, reduce
from lhc.pencil.task import example_row, pick_subsequence
from lhc.train import train_and_evaluate
from lhc.train.config import load_config

PROBLEM = make_problem("sat", num_vars=4)
TOKENIZER = tokenizer_for(PROBLEM)


def _instance(seed):
    return PROBLEM.sample(np.random.default_rng(seed))


@pytest.mark.parametrize("seed", range(8))
def test_rows_train_each_trace_token_in_its_context(seed):
    instance = _instance(seed)
    prompt = TOKENIZER.encode(instance.prompt)
    trace = TOKENIZER.encode(instance.trace)
    special = (TOKENIZER.call_id, TOKENIZER.sep_id, TOKENIZER.return_id)
    # Chain of thought: the whole trace after the prompt.
    tokens, trained, truncated = example_row(
        PROBLEM, TOKENIZER, np.random.default_rng(seed), trace_format="cot", context_limit=4096
    )
    assert not truncated
    assert tokens[: len(prompt) + len(trace)].tolist() == prompt + trace
    assert trained.tolist() == [False] * len(prompt) + [True] * len(trace) + [False] * (
        4097 - len(prompt) - len(trace)
    )
    # PENCIL: a context generation holds; what it trains continues the trace from where
    # the reduced context stands.
    tokens, trained, truncated = example_row(
        PROBLEM, TOKENIZER, np.random.default_rng(seed), trace_format="pencil", context_limit=4096
    )
    length = int((tokens != 0).sum())
    row = tokens[:length].tolist()
    start = int(np.argmax(trained))
    assert trained[start:length].all() and not trained[length:].any()
    # The untrained part is the reduction of the prompt and a prefix of the trace, and
    # the trained part is the trace's next tokens, up to a reducing [RETURN] or the end.
    for cut in range(len(trace) + 1):
        if reduce(prompt + trace[:cut], *special) == row[:start]:
            assert trace[cut : cut + length - start] == row[start:]
            assert row[-1] in (TOKENIZER.return_id, TOKENIZER.eos_id)
            break
    else:
        raise AssertionError("the row's context is no reduced prefix of the trace")
    # A row longer than the limit is cut and reported.
    tokens, trained, truncated = example_row(
        PROBLEM, TOKENIZER, np.random.default_rng(seed), trace_format="cot", context_limit=64
    )
    assert truncated and tokens.shape == (65,) and (tokens != 0).all()


def test_configs_train_and_evaluate_by_generation(tmp_path):
    overrides = [
        "data.context_limit=160",
        "model.max_len=160",
        "model.num_layers=1",
        "model.embed_dim=32",
        "model.num_heads=2",
        "model.num_kv_heads=2",
        "model.head_dim=16",
        "model.mlp_dim=128",
        "num_steps=2",
        "batch_size=4",
        "pencil_eval.num_instances=2",
        "pencil_eval.max_new_tokens=24",
        "pencil_eval.methods=('pencil','cot')",
        "progress_bar=False",
        "tensorboard=False",
        "async_checkpointing=False",
        f"pencil_eval.results={tmp_path / 'instances.jsonl'}",
    ]
    config = load_config("configs/pencil_sat.py:tiny,num_vars=3", overrides)
    metrics = train_and_evaluate(config, str(tmp_path))
    records = [json.loads(line) for line in open(tmp_path / "instances.jsonl")]
    assert [(r["method"], r["instance"]) for r in records] == [
        (m, i) for m in ("pencil", "cot") for i in (0, 1)
    ]
    for method in ("pencil", "cot"):
        assert 0 <= metrics[f"eval/{method}/accuracy"] <= 1
        assert metrics[f"eval/{method}/generated_tokens_mean"] <= 24
        assert metrics[f"eval/{method}/max_context_max"] <= 160 + 1
        # The per-instance records average to the logged metrics.
        mine = [r for r in records if r["method"] == method]
        assert metrics[f"eval/{method}/accuracy"] == np.mean([r["correct"] for r in mine])
        assert metrics[f"eval/{method}/max_context_max"] == max(r["max_context"] for r in mine)
        assert {(r["format"], r["seed"], r["steps"], r["context_limit"]) for r in mine} == {
            ("pencil", 0, 2, 160)
        }
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any("train/truncated" in row for row in rows)
    for name in ("pencil_qbf.py", "pencil_einstein.py", "pencil_sat.py"):
        for arg in ("tiny", "paper", "tiny,format=cot"):
            config = load_config(f"configs/{name}:{arg}")
            assert (
                config.model.vocab_size
                == tokenizer_for(
                    make_problem(config.data.problem, **config.data.problem_params)
                ).vocab_size
            )
    with pytest.raises(ValueError, match="format must be one of"):
        train_and_evaluate(
            load_config("configs/pencil_sat.py:tiny", ["data.format=tree"]), str(tmp_path / "x")
        )


def test_eval_result_metrics_and_table():
    result = EvalResult(
        method="pencil",
        correct=np.array([True, False, True, True]),
        trace_rates=np.array([1.0, 0.5, 1.0, 0.5]),
        exact_traces=np.array([True, False, True, False]),
        max_context=np.array([100, 120, 90, 310]),
        generated=np.array([400, 380, 420, 200]),
        finished=np.array([True, True, True, False]),
        over_limit=np.array([False, False, False, True]),
        context_limit=300,
    )
    metrics = result.metrics(prefix="eval/pencil/")
    assert metrics["eval/pencil/accuracy"] == 0.75 and metrics["eval/pencil/trace_rate"] == 0.75
    assert metrics["eval/pencil/exact_trace"] == 0.5
    assert (
        metrics["eval/pencil/max_context_max"] == 310 and metrics["eval/pencil/over_limit"] == 0.25
    )
    # 3 of 4: the 95% Wilson interval is (0.301, 0.954) (textbook value).
    assert abs(metrics["eval/pencil/accuracy_low"] - 0.3006) < 1e-3
    assert abs(metrics["eval/pencil/accuracy_high"] - 0.9544) < 1e-3
    table = comparison_table([result])
    assert (
        "limit 300" in table
        and "| pencil | 0.75 | 0.750 | 155 / 310 | 350 | 0.75 | 0.25 |" in table
    )


def test_an_oracle_scores_every_trace_exact_and_one_slip_breaks_it(monkeypatch):
    # The scoring of evaluate_generation against a generator that writes the solver's
    # trace (with one token changed in the second instance): closed-form metrics.
    instances = [_instance(seed) for seed in range(3)]
    traces = [TOKENIZER.encode(instance.trace) for instance in instances]
    slipped = list(traces[1])
    slipped[5] = TOKENIZER.call_id if slipped[5] != TOKENIZER.call_id else TOKENIZER.sep_id
    written = [traces[0], slipped, traces[2]]

    def oracle(model, params, prompts, tokenizer, **kwargs):
        width = max(map(len, written))
        tokens = np.full((len(prompts), width), TOKENIZER.pad_id)
        for b, trace in enumerate(written):
            tokens[b, : len(trace)] = trace
        return SimpleNamespace(
            tokens=tokens,
            lengths=np.array([len(t) for t in written]),
            max_context=np.array([10, 20, 30]),
            overflowed=np.zeros(3, bool),
        )

    monkeypatch.setattr(evaluation.generation, "generate", oracle)
    result = evaluation.evaluate_generation(
        None,
        None,
        instances,
        TOKENIZER,
        PROBLEM.labels(),
        method="pencil",
        context_limit=4096,
        max_new_tokens=4096,
    )
    assert result.exact_traces.tolist() == [True, False, True]
    assert result.correct.all() and result.finished.all()
    rates = result.trace_rates
    assert rates[0] == rates[2] == 1.0 and rates[1] == 1 - 1 / len(traces[1])


def test_pencil_rows_train_every_trace_token_equally_often():
    subs = [Subsequence(tuple(range(10)), 10 - n) for n in (1, 3, 6)]  # 1, 3, 6 trained
    rng = np.random.default_rng(0)
    counts = np.bincount([pick_subsequence(subs, rng) for _ in range(6000)], minlength=3)
    np.testing.assert_allclose(counts / 6000, [0.1, 0.3, 0.6], atol=0.02)


def test_a_mixture_of_sizes_draws_each_size_and_shares_the_largest_vocabulary():
    mixture = make_problem("qbf", num_vars=[5, 3, 4])
    assert [n for n, _ in mixture.parts] == [3, 4, 5]
    largest = tokenizer_for(make_problem("qbf", num_vars=5))
    tokenizer = tokenizer_for(mixture)
    assert tokenizer.vocab_size == largest.vocab_size
    rng = np.random.default_rng(0)
    seen = {3: 0, 4: 0, 5: 0}
    for _ in range(300):
        instance = mixture.sample(rng)
        # The prompt's quantifier prefix names each variable once: its size.
        variables = {t for t in instance.prompt[1 : instance.prompt.index(":")] if t.isdigit()}
        seen[len(variables)] += 1
        assert tokenizer.encode(instance.prompt + instance.trace) == largest.encode(
            instance.prompt + instance.trace
        )
    assert all(80 <= count <= 120 for count in seen.values()), seen
    with pytest.raises(ValueError, match="num_vars as a list must hold distinct sizes"):
        make_problem("qbf", num_vars=[3, 3])


def test_the_scaling_preset_is_the_recorded_command():
    # experiments/pencil/README.md records the QBF scaling runs as this command line.
    recorded = load_config(
        "configs/pencil_qbf.py:tiny,mix=3-6,format=cot",
        [
            "model.max_len=512",
            "data.context_limit=512",
            "num_steps=2400",
            "pencil_eval.num_instances=200",
            "pencil_eval.temperature=0.0",
            "pencil_eval.batch_size=100",
        ],
    )
    preset = load_config("configs/pencil_qbf.py:scaling,format=cot")
    assert preset.to_dict() == recorded.to_dict()
    single = load_config("configs/pencil_qbf.py:scaling,num_vars=4")
    assert single.data.problem_params.num_vars == 4


def test_a_mixture_trains_and_is_evaluated_size_by_size(tmp_path):
    config = load_config(
        "configs/pencil_qbf.py:tiny,mix=3-4",
        [
            "model.num_layers=1",
            "model.embed_dim=32",
            "model.num_heads=2",
            "model.num_kv_heads=2",
            "model.head_dim=16",
            "model.mlp_dim=64",
            "num_steps=1",
            "batch_size=2",
            "pencil_eval.num_instances=1",
            "pencil_eval.max_new_tokens=8",
            "progress_bar=False",
            "tensorboard=False",
            "async_checkpointing=False",
        ],
    )
    assert list(config.data.problem_params.num_vars) == [3, 4]
    metrics = train_and_evaluate(config, str(tmp_path))
    for size in (3, 4):
        assert 0 <= metrics[f"eval/pencil/n{size}/accuracy"] <= 1
    assert "eval/pencil/accuracy" not in metrics
