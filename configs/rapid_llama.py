r"""RAPID's paper setup on imported checkpoints, for a TPU or GPU host.

    lhc bench rapid --setup configs/rapid_llama.py:llama3.1-8b
    lhc bench rapid --setup configs/rapid_llama.py:llama3.1-8b \
        --config.target_checkpoint=/ckpt/Llama-3.1-8B-Instruct \
        --config.tokenizer=/ckpt/Llama-3.1-8B-Instruct/tokenizer.json \
        --config.data=/data/infbench_qa.jsonl

The first prints the memory estimate of the setup (``lhc.rapid.footprint``) for each context
length in ``contexts``; the second also runs target-only, RAG-only and RAPID on the JSONL
file (one object per line: ``context``, ``question``, ``answers``, a list of strings; a
generation is right when it contains one of them) and prints accuracy, tokens/s and
acceptance. Checkpoints are local Hugging Face safetensors directories the user
supplies (``lhc.lm.hf.load``); nothing is downloaded.

Setups (the part after the colon), after the paper and its code:

* ``llama3.1-8b``: LLaMA-3.1-8B self-speculation, eta 10;
* ``qwen2.5-7b``: Qwen2.5-7B self-speculation, eta 20;
* ``llama3.2-1b-upward``: a LLaMA-3.2-1B target with the LLaMA-3.1-8B drafter (upward
  speculation, eta 40). The paper's upward pair is an 8B target with a 70B drafter;
  lhc has no 70B preset, so this is the same idea one size down.

Shared settings: chunks of 512 tokens, budget ``max(4096, |C| / 24)``, gamma 10,
tail protection alpha 0.1, temperature 0.1, top-p 1 (LongBench v2's; ∞Bench used
temperature 1), 128K-token contexts. Retrieval is BM25 over the tokenizer's words: the
paper embeds chunks with BGE-M3, which lhc does not ship; pass an embedding function to
``lhc.rapid.rag_prompt`` for dense retrieval.
"""

import ml_collections

SETUPS = {
    "llama3.1-8b": dict(target="llama3.1-8b", draft="", eta=10.0),
    "qwen2.5-7b": dict(target="qwen2.5-7b", draft="", eta=20.0),
    "llama3.2-1b-upward": dict(target="llama3.2-1b", draft="llama3.1-8b", eta=40.0),
}


def get_config(arg=None):
    name = arg or "llama3.1-8b"
    if name not in SETUPS:
        raise ValueError(f"config arg must be one of {sorted(SETUPS)}, got {name!r}")
    setup = SETUPS[name]
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.target = setup["target"]  # an lhc.lm preset: the checkpoint's architecture
    config.draft = setup["draft"]  # "" for self-speculation
    config.target_checkpoint = ""
    config.draft_checkpoint = ""
    config.tokenizer = ""
    config.data = ""
    config.dtype = "bfloat16"
    # "flash" (Pallas, TPU / GPU) keeps prefill attention in blocks; "xla" materialises
    # one layer's [B, heads, chunk, context] scores (see the memory estimate).
    config.attention_impl = "flash"
    config.contexts = (32_768, 65_536, 131_072)
    config.batch_size = 1
    config.retrieval = ml_collections.ConfigDict(
        dict(chunk_size=512, method="bm25", min_budget=4096, ratio=24.0)
    )
    config.decoding = ml_collections.ConfigDict(
        dict(
            gamma=10,
            eta=setup["eta"],
            alpha=0.1,
            temperature=0.1,
            top_p=1.0,
            new_tokens=256,
            prefill_chunk=2048,
        )
    )
    return config
