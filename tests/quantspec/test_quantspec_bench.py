"""``lhc bench quantspec``: the traffic rows and the measured rows on a tiny model (the
timings themselves are not tested)."""

import json
import pathlib

import jax
import numpy as np
import pytest

from lhc import lm, quantspec
from lhc.quantspec import bench, decoding
from lhc.train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def test_traffic_rows_through_the_command_line(tmp_path, capsys):
    flags = "--configs llama-2-7b --contexts 131072 --gamma 6 --acceptance 0.943"
    result = bench.main([*flags.split(), "--json", str(tmp_path / "out.json")])
    (row,) = result["traffic"]
    # Llama-2-7B: 32 layers, 32 heads (and K/V heads) of 128, 4096 wide, 11008 MLP, 32000
    # vocabulary; linear weights P (the head included), K and V elements E per token.
    p = 32 * (4096 * 128 * (2 * 32 + 2 * 32) + 3 * 4096 * 11008) + 4096 * 32000
    e = 2 * 32 * 32 * 128
    assert (p, e) == (6_607_077_376, 262_144)
    # A plain step reads 16-bit weights and KV; the verify pass 16-bit weights, 8-bit KV
    # with a 16-bit scale and minimum per group of 128.
    assert row["ar_gb"] == pytest.approx((2 * p + 2 * e * 131072) / 1e9, rel=1e-12)
    assert row["verify_gb"] == pytest.approx((2 * p + (1 + 4 / 128) * e * 131072) / 1e9, rel=1e-12)
    assert round(row["speedup_mlp"], 2) == 2.74 and round(row["speedup_all"], 2) == 3.05
    assert "| llama-2-7b | 131072 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["traffic"] == [row]
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--configs", "gpt-5"])
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "4096,x"])


def test_model_sources():
    small = ["--configs", "llama-2-7b", "--contexts", "4096"]
    with pytest.raises(SystemExit, match="at most one"):
        bench.main([*small, "--random", "--workdir", "/nonexistent"])
    with pytest.raises(SystemExit, match="--workdir: "):
        bench.main([*small, "--workdir", "/nonexistent/run"])
    # --random is the shape that configs/quantspec_passkey.py trains.
    config = load_config(str(CONFIGS / "quantspec_passkey.py") + ":tiny")
    assert lm.LMConfig(**dict(config.model)) == quantspec.PASSKEY_MODEL


def _tiny(**overrides):
    """A one-layer byte-level model and its random parameters."""
    config = lm.LMConfig(
        vocab_size=259,
        num_layers=1,
        embed_dim=32,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_len=256,
        **overrides,
    )
    return lm.Transformer(config), lm.init_params(config, jax.random.key(0))


def test_measured_rows_on_a_tiny_model():
    model, params = _tiny()
    (row,) = bench.measure(
        model, params, [40], new_tokens=6, gamma=2, group_size=8, batch=2, weights="mlp"
    )
    assert row["same_tokens"] and 0 <= row["acceptance"] <= 1
    assert 1 <= row["tokens_per_round"] <= 3
    steps = ("fp_step_s", "int8_step_s", "draft_step_s", "verify_s")
    assert all(row[k] > 0 for k in steps) and row["bandwidth_gbps"] > 0
    # f32 weights and cache: 4 bytes per linear weight and per cached key/value element.
    config = model.config
    linear = (
        config.num_layers
        * (
            config.embed_dim * config.head_dim * 2 * (config.num_heads + config.num_kv_heads)
            + 3 * config.embed_dim * config.mlp_dim
        )
        + config.embed_dim * config.vocab_size
    )
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 40
    assert row["fp_step_bytes"] == 4 * (linear + kv)
    table = bench.measured_table([row])
    assert "| 40 |" in table and "one step of each path alone" in table


def test_kernel_rows_on_this_cpu_time_the_xla_reference():
    rows = bench.kernel_rows([128], verify_tokens=3, repeats=1)
    assert [(r["context"], r["queries"], r["impl"]) for r in rows] == [
        (128, 1, "xla"),
        (128, 3, "xla"),
    ]
    assert all(r[k] > 0 for r in rows for k in ("bf16_ms", "int4_ms", "int8_ms"))
    assert "| 128 | 3 | xla |" in bench.kernel_table(rows)


def test_draft_acceptance_rows_on_a_tiny_model(capsys, monkeypatch):
    # The draft that reads the cache at 8 bits with the target's weights is the target:
    # acceptance 1. Every greedy output equals plain decoding on the 8-bit path, whatever
    # the draft; GPTQ calibrates a scanned model through its unstacked layers.
    model, params = _tiny(scan_layers=True)
    prompts = {40: bench.filler_prompts(2, 40)}
    rows = bench.acceptance_rows(
        model,
        params,
        prompts,
        ["kv8", "kv4+gptq-asym-16-all"],
        gammas=[3],
        temperatures=[0.0],
        new_tokens=12,
        group_size=16,
        calibration=bench.filler_prompts(2, 24, seed=1),
        log=lambda m: None,
    )
    assert [(r["draft"], r["gamma"]) for r in rows] == [
        (d, 3) for d in ("kv8", "kv4+gptq-asym-16-all")
    ]
    assert all(r["same_as_8bit"] for r in rows)
    assert rows[0]["acceptance"] == 1.0
    for row in rows:  # each prompt's counts, summing to the batch's rate
        counts = row["per_prompt"]
        assert len(counts["accepted"]) == 2 and counts["same_as_8bit"] == [True, True]
        assert row["acceptance"] == pytest.approx(sum(counts["accepted"]) / sum(counts["drafted"]))
    assert rows[0]["per_prompt"]["accepted"] == rows[0]["per_prompt"]["drafted"]
    assert all(1 <= r["tokens_per_round"] <= r["gamma"] + 1 for r in rows)
    # Both caches hold at least the keys and values of 2 prompts x (40 + 12 new + 2 x 3
    # + 2) slots: float32 in the full cache, 8 bits (two 4-bit halves) in the other,
    # whose scales, minima and full-precision ring come on top.
    config = model.config
    values = 2 * config.num_layers * 2 * config.num_kv_heads * 60 * config.head_dim
    assert rows[0]["full_cache_bytes"] >= 4 * values and rows[0]["cache_bytes"] > values
    assert rows[0]["tokens_per_round"] == 4.0  # every round: 3 drafts and the next token
    assert "| kv4+gptq-asym-16-all | 40 | 3 |" in bench.acceptance_table(rows)
    with pytest.raises(ValueError, match=r"draft 'kv4\+gptq-64': expected kv4 or kv8"):
        bench.parse_draft("kv4+gptq-64")
    assert bench.parse_draft("kv4+gptq-asym-32-all") == dict(
        name="kv4+gptq-asym-32-all",
        kv_bits=4,
        method="gptq",
        symmetric=False,
        group=32,
        layers="all",
    )
    # A weight grid the layers cannot take fails before any decoding.
    logged = []
    monkeypatch.setattr(bench.decoding, "generate", lambda *a, **k: logged.append("generate"))
    with pytest.raises(ValueError, match=r"draft 'kv4\+rtn-asym-7': .*group_size must .*divid"):
        bench.acceptance_rows(
            model,
            params,
            prompts,
            ["kv8", "kv4+rtn-asym-7"],
            gammas=[3],
            temperatures=[0.0],
            new_tokens=12,
            group_size=16,
            log=logged.append,
        )
    assert logged == []
    with pytest.raises(SystemExit, match="--drafts: draft 'kv2'"):
        bench.main(["--configs", "llama-2-7b", "--contexts", "4096", "--drafts", "kv2"])


def test_sampled_rows_follow_the_target_distribution():
    """The sampled check: 2,000 speculative samples of the first two tokens against the
    target's exact distribution (pairs enumerated from its 16 likeliest first tokens)
    pass Pearson's test, while the same samples against the distribution at another
    temperature fail it: the check can tell."""
    model, params = _tiny()
    prompts = {40: bench.filler_prompts(1, 40)}
    draft = "kv4+rtn-asym-16-all"  # far enough from the target to be rejected often
    (row,) = bench.acceptance_rows(
        model, params, prompts, [draft], gammas=[3], temperatures=[0.3], new_tokens=4,
        group_size=16, log=lambda m: None, sampled=2000, sampled_batch=2000, sampled_top=16,
    )  # fmt: skip
    check = row["sampled"]
    assert check["samples"] == 2000 and check["prefix"] == 40 and check["cells"] > 20
    assert check["p_value"] > 1e-3 and check["acceptance"] < 0.9
    target = decoding.quantspec_model(model, group_size=16)
    prefix = np.asarray(prompts[40])[0]
    cache = lm.decoding.prefilled_cache(
        target, params, prefix[None, :-1], extra=11, prefill_chunk=16
    )
    wrong = bench.acceptance.exact_two_tokens(target, params, cache, int(prefix[-1]), 0.4, 16)
    other = bench.acceptance.sampled_check(
        model, params, cache, int(prefix[-1]), wrong, samples=2000, batch=2000, seed=3,
        gamma=3, group_size=16, sampling=lm.SamplingParams(temperature=0.3),
        draft_params=bench.draft_weights(model, params, bench.parse_draft(draft), None),
    )  # fmt: skip
    assert other["p_value"] < 1e-6


def test_acceptance_results_resume(tmp_path, capsys):
    results = tmp_path / "acceptance.jsonl"
    args = (
        "--configs llama-2-7b --contexts 4096 --random --drafts kv8 --gammas 2 "
        f"--prompt-lengths 24 --new-tokens 4 --batch 2 --results {results}"
    ).split()
    first = bench.main(args)["acceptance"]
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["draft"] == "kv8" and record["setting"]["batch"] == 2
    assert record["per_prompt"]["accepted"] == first[0]["per_prompt"]["accepted"]
    again = bench.main(args)["acceptance"]  # nothing left to run: the record is the row
    assert again[0]["acceptance"] == first[0]["acceptance"]
    assert len(results.read_text().splitlines()) == 1
