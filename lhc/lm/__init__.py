"""Decoder-only LM family (Llama / Qwen2 layout): config, model, KV cache, generation,
speculative decoding.

The causal-LM protocol is described in ``lhc.lm.model``; the cache layout and the
padding convention in ``lhc.lm.cache``; Hugging Face checkpoints in ``lhc.lm.hf``.
"""

from lhc.lm import hf
from lhc.lm.cache import (
    Cache,
    KVCache,
    SlidingWindowKVCache,
    init_cache,
    init_sliding_window_cache,
)
from lhc.lm.config import PRESETS, LMConfig, get_preset
from lhc.lm.decoding import (
    DecodeState,
    GenerateOutput,
    bucket_length,
    decode_loop,
    decode_step,
    generate,
    left_pad,
    left_padded_positions,
    prefill,
)
from lhc.lm.model import (
    Block,
    Transformer,
    abstract_params,
    count_params,
    init_params,
    param_shardings,
    stack_layer_params,
    unstack_layer_params,
)
from lhc.lm.sampling import (
    SamplingParams,
    logits_to_probs,
    process_logits,
    sample_tokens,
    top_k_mask,
    top_p_mask,
)
from lhc.lm.speculative import (
    DraftProposal,
    ModelDrafter,
    SelfDrafter,
    SpeculativeOutput,
    SpeculativeSampling,
    speculative_generate,
    verify_drafts,
)
from lhc.lm.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    # Config.
    "LMConfig",
    "PRESETS",
    "get_preset",
    # Model and parameters.
    "Block",
    "Transformer",
    "abstract_params",
    "count_params",
    "init_params",
    "param_shardings",
    "stack_layer_params",
    "unstack_layer_params",
    # Caches.
    "Cache",
    "KVCache",
    "SlidingWindowKVCache",
    "init_cache",
    "init_sliding_window_cache",
    # Decoding and sampling.
    "DecodeState",
    "GenerateOutput",
    "SamplingParams",
    "bucket_length",
    "decode_loop",
    "decode_step",
    "generate",
    "prefill",
    "left_pad",
    "left_padded_positions",
    "logits_to_probs",
    "process_logits",
    "sample_tokens",
    "top_k_mask",
    "top_p_mask",
    # Speculative decoding: drafters, verifiers, the loop.
    "DraftProposal",
    "ModelDrafter",
    "SelfDrafter",
    "SpeculativeOutput",
    "SpeculativeSampling",
    "speculative_generate",
    "verify_drafts",
    # Tokenizers.
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    # Hugging Face checkpoints: lhc.lm.hf.load / lhc.lm.hf.save.
    "hf",
]
