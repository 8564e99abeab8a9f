"""``lhc bench lm --prompt-lens``: long prompts on a checkpoint, against transformers on
the same file (a tiny random Gemma 3 GGUF whose window the prompts pass)."""

import pytest

from lhc.bench import lm as lm_bench

from ..lm import _gguf_files


@pytest.mark.parity
def test_prompts_prefill_and_decode_as_transformers_does(tmp_path):
    pytest.importorskip("transformers")
    vocab = _gguf_files.sentencepiece_vocab()
    path = _gguf_files.write_gguf(tmp_path / "gemma.gguf", "gemma3", vocab, context=256)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(_gguf_files.random_texts(200, seed=0)))
    flags = "--prompt-lens 20,150 --new-tokens 6 --repeats 1 --prefill-chunk 16".split()
    argv = ["--checkpoint", str(path), "--text", str(text), "--against", "transformers"]
    result = lm_bench.main([*argv, *flags, "--json", str(tmp_path / "out.json")])
    short, long = result["long_prompts"]["rows"]
    assert (short["prompt_len"], long["prompt_len"]) == (20, 150)
    for row in (short, long):
        assert row["same_tokens"] and len(row["lhc_tokens"]) == 6
        assert row["lhc_prefill_s"] > 0 and row["transformers_prefill_s"] > 0
        assert row["decode_ratio"] == pytest.approx(
            row["lhc_decode_tokens_per_s"] / row["transformers_decode_tokens_per_s"]
        )
    # 150 + 6 tokens pass the window of 8 and its 128 spare slots: the local layers keep
    # rings of 136 slots, the global one (layer 5 of 7) every token.
    assert (short["cache"], long["cache"]) == ("KVCache", "HybridKVCache")
    slot_bytes = 2 * _gguf_files.DIMS["kv_heads"] * _gguf_files.GEMMA3_HEAD_DIM * 4
    assert short["cache_bytes"] == short["full_cache_bytes"] == 7 * 26 * slot_bytes
    assert long["full_cache_bytes"] == 7 * 156 * slot_bytes
    assert long["cache_bytes"] == (156 + 6 * 136) * slot_bytes
    for row in (short, long):
        # Peak memory where Linux reports it (a tiny prefill may fit in pages the
        # process already holds: zero is possible).
        for who in ("lhc", "transformers"):
            held = row[f"{who}_prefill_peak_bytes"]
            assert held is None or held >= 0
        assert row["fraction_of_matmul"] == pytest.approx(
            row["prefill_flops"] / row["lhc_prefill_s"] / (row["matmul_gflops"] * 1e9)
        )


@pytest.mark.parametrize("window,full_layers", [(None, ()), (5, ()), (5, (1,)), (40, (0,))])
def test_prefill_flops_count_every_matrix_and_visible_pair(window, full_layers):
    """Against the parameter tree (every kernel of the layers, once per token; the output
    head once) and pairs counted by brute force, layer by layer with its own window."""
    import jax
    import numpy as np

    from lhc import lm
    from lhc.lm.costs import prefill_flops

    config = lm.LMConfig.tiny(
        vocab_size=50, sliding_window=window, full_attention_layers=full_layers, max_len=64
    )
    length = 23
    params = lm.random_params(config)
    kernels = [
        leaf.size
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if "kernel" in jax.tree_util.keystr(path) and "layers" in jax.tree_util.keystr(path)
    ]
    weights = 2 * length * sum(kernels)
    positions = np.arange(length)
    attention = 0
    for layer in range(config.num_layers):
        seen = positions[None, :] <= positions[:, None]
        layer_window = None if layer in full_layers else window
        if layer_window is not None:
            seen &= positions[:, None] - positions[None, :] < layer_window
        attention += 4 * config.num_heads * config.head_dim * int(seen.sum())
    head = 2 * config.embed_dim * config.vocab_size
    got = prefill_flops(config, length)
    assert (got["weights"], got["attention"], got["head"]) == (weights, attention, head)
    assert got["total"] == weights + attention + head


def test_peak_memory_sees_what_a_block_holds_and_no_more():
    import numpy as np

    from lhc import bench

    with bench.peak_memory() as held:
        block = np.ones(2**25)  # 256 MiB, touched
        del block
    with bench.peak_memory() as idle:
        pass
    if held["bytes"] is None:  # no /proc: nothing to check
        assert idle["bytes"] is None
        return
    assert 0.9 * 2**28 <= held["bytes"] < 2**28 + 2**26  # pages already held may serve a few
    assert idle["bytes"] < 2**24
