"""lhc bench gca at toy sizes: its rows, its memory accounting and its table (timings
are printed, never checked)."""

import numpy as np
import pytest

from lhc.gca import GCAConfig
from lhc.gca.bench import main, measure, table
from lhc.lm.config import LMConfig


@pytest.mark.slow
def test_bench_rows_account_memory_by_where_it_lives():
    gca = GCAConfig.tiny(max_len=1024)
    dense = LMConfig(
        vocab_size=gca.vocab_size,
        num_layers=2,
        embed_dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_len=1024,
    )
    contexts, steps, repeats = (100,), 2, 1
    rows = measure(contexts, steps, repeats, configs=(gca, dense))
    assert [row["context"] for row in rows] == list(contexts)
    extra = steps * (repeats + 1) + 1
    for row in rows:
        cache_len = row["context"] + extra
        chunks = -(-cache_len // gca.text_per_chunk)
        memory = 2 * chunks * gca.chunk_size * gca.num_kv_heads * gca.head_dim * 4  # f32 K, V
        assert row["gca_cache_bytes"]["host"] == 0
        assert row["gca_offload_cache_bytes"]["host"] == memory
        assert row["gca_offload_cache_bytes"]["device"] + memory == row["gca_cache_bytes"]["device"]
        assert row["gca_s_per_token"] > 0 and row["gca_offload_s_per_token"] > 0
    # Dense keys and values for every slot of every layer.
    kv = 2 * dense.num_layers * dense.num_kv_heads * dense.head_dim * 4
    assert rows[0]["dense_cache_bytes"]["device"] >= kv * (100 + extra)
    assert np.isfinite(rows[0]["dense_s_per_token"])
    text = table(rows)
    assert text.count("\n| ") == len(contexts)


def test_table_in_milliseconds_mib_and_ratios():
    mib = 2**20
    rows = [
        dict(
            context=1024,
            gca_s_per_token=0.002,
            gca_offload_s_per_token=0.003,
            dense_s_per_token=0.02,
            gca_cache_bytes=dict(device=4 * mib, host=0),
            gca_offload_cache_bytes=dict(device=mib, host=3 * mib),
            dense_cache_bytes=dict(device=6 * mib, host=0),
        ),
        dict(
            context=4096,
            gca_s_per_token=0.003,
            gca_offload_s_per_token=0.0045,
            gca_cache_bytes=dict(device=8 * mib, host=0),
            gca_offload_cache_bytes=dict(device=2 * mib, host=6 * mib),
        ),
    ]
    lines = table(rows).splitlines()
    assert lines[2] == "| 1024 | 2.00 | 1.00x | 3.00 | 20.00 | 10.0x | 4.0 | 1.0 | 3.0 | 6.0 |"
    assert lines[3] == "| 4096 | 3.00 | 1.50x | 4.50 |  |  | 8.0 | 2.0 | 6.0 |  |"
    assert lines[-1] == "Memory columns: the cache's arrays."


def test_flags_are_checked():
    for flags in (["--contexts", "0"], ["--contexts", "1024,x"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            main(flags)
