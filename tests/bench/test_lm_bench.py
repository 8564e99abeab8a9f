"""The decode benchmark's output structure and its bytes-per-token arithmetic."""

import json

import pytest

from lhc.bench import lm as bench


def test_bench_main_tiny_structure_and_bandwidth_floor(tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    result = bench.main(
        [
            "--configs",
            "tiny",
            "--prompt-len",
            "8",
            "--decode-steps",
            "3",
            "--repeats",
            "1",
            "--batch-size",
            "2",
            "--real-config",
            "llama3.1-8b",
            "--context-len",
            "32768",
            "--hbm-gbps",
            "819",
            "--json",
            str(out_path),
        ]
    )
    written = json.loads(out_path.read_text())
    assert written.pop("footer").startswith("device: ") and isinstance(written.pop("argv"), list)
    assert written == json.loads(json.dumps(result))
    out = capsys.readouterr().out
    assert "| config | params | prefill tok/s |" in out and "cache speedup" in out
    assert "| tiny | 26,784 |" in out  # LMConfig.tiny's parameters, as the README counts them
    (row,) = result["measured"]
    assert row["config"] == "tiny" and row["batch_size"] == 2 and row["decode_steps"] == 3
    # Throughputs count the tokens: 2 prompts of 8 prefilled, 2 x 3 decoded each way.
    assert row["prefill_tokens_per_s"] * row["prefill_s"] == pytest.approx(16)
    assert row["decode_tokens_per_s"] * row["decode_s"] == pytest.approx(6)
    assert row["recompute_decode_tokens_per_s"] * row["recompute_decode_s"] == pytest.approx(6)
    assert row["decode_speedup_vs_recompute"] > 0
    assert row["cached_matches_recompute"] == 1.0

    # Llama-3.1-8B in bf16: 32 layers, 8 KV heads of 128, 4096 wide, 14336 MLP, 128256 vocab.
    layers, d, f, v, n, k, h = 32, 4096, 14336, 128256, 32, 8, 128
    params = 2 * v * d + layers * (d * h * (2 * n + 2 * k) + 3 * d * f + 2 * d) + d
    assert params == 8_030_261_248
    weight_bytes = 2 * params
    kv_bytes = 2 * layers * k * h * 32768 * 2  # keys and values, bf16
    a = result["analytic"]
    assert a["weight_bytes"] == weight_bytes
    assert a["kv_cache_bytes_per_sequence"] == kv_bytes == 4 * 2**30
    bytes_per_token = (weight_bytes + 2 * kv_bytes) / 2  # a batch of 2 shares the weights
    assert a["bytes_per_token"] == bytes_per_token == 12_325_228_544
    # At 819 GB/s: 12,325,228,544 / 819e9 = 15.05 ms per token, 66.45 tokens/s.
    assert a["time_floor_s_per_token"] == pytest.approx(bytes_per_token / 819e9, rel=1e-12)
    assert a["max_tokens_per_s"] == pytest.approx(819e9 / bytes_per_token, rel=1e-12)


def test_bench_against_transformers_structure_and_agreement(capsys):
    """The comparison on the tiny config: both decode the same checkpoint to the same
    tokens, and each rate counts the tokens it decoded."""
    flags = (
        "--against transformers --against-config tiny --batch-sizes 1,2 --new-tokens 6 "
        "--prompt-len 8 --repeats 1 --bandwidth-mib 64 --kernel-layouts out_in"
    ).split()
    result = bench.main(["--configs", "", "--real-config", "", *flags])
    comparison = result["against_transformers"]
    out = capsys.readouterr().out
    assert "| batch | lhc kernels, layers | lhc | transformers | ratio |" in out
    assert [row["batch_size"] for row in comparison["rows"]] == [1, 2]
    assert {row["kernel_layout"] for row in comparison["rows"]} == {"out_in"}
    for row in comparison["rows"]:
        assert row["all_equal"] and row["tokens_equal"] == 1.0 and row["equal_prefix"] == 6
        # Each rate counts its tokens: batch x 6 end to end, batch per decode step.
        for who in ("lhc", "transformers"):
            assert row[f"{who}_tokens_per_s"] * row[f"{who}_s"] == pytest.approx(
                6 * row["batch_size"]
            )
            assert row[f"{who}_decode_tokens_per_s"] * row[f"{who}_decode_step_s"] == pytest.approx(
                row["batch_size"]
            )
        assert row["speedup"] > 0
    assert "bandwidth_fraction" in comparison["rows"][0]
    assert "bandwidth_fraction" not in comparison["rows"][1]
    assert comparison["measured_bandwidth_gbps"] > 0


def test_bench_list_flags_are_checked():
    for flags in (["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--scan-layers", "2"]):
        with pytest.raises(SystemExit):
            bench.main(["--configs", "", "--real-config", "", *flags])


def test_agreement_counts_the_equal_prefix():
    import numpy as np

    ours = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    theirs = np.array([[1, 2, 3, 4], [1, 9, 3, 4]])
    assert bench._agreement(ours, theirs) == dict(
        tokens_equal=7 / 8, equal_prefix=2.5, all_equal=False
    )
