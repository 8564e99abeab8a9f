"""The decode benchmark's output structure and its bytes-per-token arithmetic."""

import json

from lhc.lm import bench


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
    assert json.loads(out_path.read_text()) == json.loads(json.dumps(result))
    assert "cache speedup" in capsys.readouterr().out
    (row,) = result["measured"]
    assert row["config"] == "tiny" and row["batch_size"] == 2 and row["decode_steps"] == 3
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "recompute_decode_tokens_per_s"):
        assert row[key] > 0
    assert row["decode_speedup_vs_recompute"] == row["recompute_decode_s"] / row["decode_s"]
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
    assert a["bytes_per_token"] == (weight_bytes + 2 * kv_bytes) / 2
    assert abs(a["time_floor_s_per_token"] - a["bytes_per_token"] / 819e9) < 1e-12
    assert abs(a["max_tokens_per_s"] - 819e9 / a["bytes_per_token"]) < 1e-6
