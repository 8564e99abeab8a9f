"""Decoder-only LMs and the causal-LM protocol that every lhc language model follows.

**The model.** ``lhc.lm.Transformer`` (Llama / Qwen2 / Mistral layout; Hugging Face
checkpoints through ``lhc.lm.hf``) and every other causal LM in lhc (GCA, the recurrent
LMs) are linen modules called as::

    logits, cache = model.apply({"params": params}, tokens, positions, cache)

``tokens, positions``: int32 ``[B, T]`` (position -1 marks padding, never attended to and
leaving a recurrent state unchanged); ``logits``: float32 ``[B, T, V]``; ``cache=None``
for a plain forward pass. ``model.init_cache(batch, max_len)`` makes an empty cache and
``model.config`` has ``vocab_size`` and ``max_len``. Keyword arguments: ``last_only``
(logits of the last column only: the last prompt token of left-padded prompts) and, for
the Transformer, ``embeddings`` / ``embedding_mask`` (input embeddings instead of, or
interleaved with, token ids) and ``intervention`` (an ``lhc.nn.Intervention`` that adds
to or replaces the residual stream or the attention output of chosen layers and tokens).
Appending tokens one chunk at a time gives the logits of one full forward pass.

**The cache.** Any pytree with the protocol of ``lhc.lm.cache``: per-sequence
``lengths``, a ``capacity`` (or none), ``truncate`` to lengths and
``truncate_at_position`` to positions, ``next_positions``, ``can_append`` /
``validate_append`` (an overflow gives NaN logits under jit and an error otherwise), and
``logical_axes`` for sharding. Caches of attention layers add a per-layer interface: a
writer shared by the layers of one call stores a layer's keys and values and returns
what that layer attends to, keys and values with *their own* positions, so a cache may
keep different tokens in different layers. ``KVCache`` keeps every token,
``SlidingWindowKVCache`` a ring of the last ones; a quantized store or a pruned memory
is another implementation of the same interface.

**Decoding** (``lhc.lm.decoding``): ``prefill`` in chunks, the jitted ``decode_step``,
``decode_loop`` with explicit positions and a ``step_hook(state) -> state``, and
``generate`` (which may continue from a cache). Sampling parameters, stop tokens and
lengths are traced and prompt widths bucketed, so nearby calls share one program.

**Speculative decoding** (``lhc.lm.speculative``): a drafter (``ModelDrafter`` with its
own prompt and cache, ``SelfDrafter`` in the target's cache) proposes, a verifier
(``SpeculativeSampling`` and its variants) accepts, and every cache is cut back to what
was kept.

Everything above works on any model that follows the protocol; the tests pin it with a
small recurrent model that is not the Transformer.
"""

from lhc.lm import gguf, hf
from lhc.lm.cache import (
    Cache,
    KVCache,
    SlidingWindowKVCache,
    init_cache,
    init_sliding_window_cache,
    repeat_rows,
)
from lhc.lm.checkpoints import (
    Checkpoint,
    default_dtype,
    default_layers,
    load_checkpoint,
    load_tokenizer,
    resolve_checkpoint,
)
from lhc.lm.config import PRESETS, LMConfig, get_preset
from lhc.lm.decoding import (
    DecodeState,
    GenerateOutput,
    decode_loop,
    decode_step,
    generate,
    prefill,
)
from lhc.lm.drafters import DraftProposal, ModelDrafter, SelfDrafter
from lhc.lm.hybrid_cache import HybridKVCache, init_hybrid_cache
from lhc.lm.model import Block, Transformer
from lhc.lm.params import (
    abstract_params,
    convert_kernel_layout,
    count_params,
    init_params,
    param_shardings,
    random_params,
    stack_layer_params,
    unstack_layer_params,
)
from lhc.lm.pretrained_models import pretrained
from lhc.lm.prompts import bucket_length, left_pad, left_padded_positions
from lhc.lm.sampling import (
    SamplingParams,
    logits_to_probs,
    process_logits,
    sample_tokens,
    top_k_mask,
    top_p_mask,
)
from lhc.lm.speculative import (
    SpeculativeOutput,
    SpeculativeSampling,
    speculative_generate,
    verify_drafts,
)
from lhc.lm.text import chat_prompt, generate_text
from lhc.lm.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    chat_template_from,
    render_chat_template,
)

__all__ = [
    # Config.
    "LMConfig",
    "PRESETS",
    "get_preset",
    # Model and parameters.
    "Block",
    "Transformer",
    "abstract_params",
    "convert_kernel_layout",
    "count_params",
    "init_params",
    "param_shardings",
    "random_params",
    "stack_layer_params",
    "unstack_layer_params",
    # Caches.
    "Cache",
    "HybridKVCache",
    "KVCache",
    "SlidingWindowKVCache",
    "init_cache",
    "init_hybrid_cache",
    "init_sliding_window_cache",
    "repeat_rows",
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
    "Checkpoint",
    "chat_prompt",
    "default_dtype",
    "generate_text",
    "default_layers",
    "load_checkpoint",
    "pretrained",
    "resolve_checkpoint",
    "chat_template_from",
    "render_chat_template",
    # Hugging Face checkpoints: lhc.lm.hf.load / lhc.lm.hf.save.
    "hf",
    # llama.cpp GGUF files: lhc.lm.gguf.load / load_tokenizer / stop_tokens.
    "gguf",
]
