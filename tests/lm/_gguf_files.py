"""Tiny GGUF files written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them
(its metadata keys, its tensor names from ``gguf.get_tensor_name_map``, its q/k row
permutation for ``"llama"`` files, its ``rope_freqs`` divisors for Llama 3 RoPE), with
small trained vocabularies. Shared by ``test_lm_gguf.py``, ``tests/test_notebooks.py``
and ``tests/test_checkpoint_benches.py`` (``from .lm import _gguf_files``); not a test
module."""

import json
import math

import gguf
import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as Q
from gguf import TokenType
from tokenizers import models, pre_tokenizers, trainers

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<think>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a needle in a haystack, 2024 needles in 365 haystacks",
    "Théo's café serves naïve crème brûlée; it's 3.14 euros",
    "don't stop: we'll go, they've gone\nnew line\ttab",
] * 20
TEXT_PARTS = [
    "the", " the", "quick", " fox", "needle", " haystack", "café", " naïve", "2024", " 365",
    "3.14", "'s", "'ll", " don't", "!", "?", ",", ".", ":", " ", "  ", "\n", "\n\n", "\t",
    "日本語", "🙂", "ß", "Ω", "x", "Z", "0", "7", *CONTROL_TOKENS, USER_TOKEN, "<s>", "</s>",
]  # fmt: skip

DIMS = dict(embed=64, heads=4, kv_heads=2, head_dim=16, mlp=256, layers=2, context=64)
# ggml types by GGUF tensor kind; norms and biases stay F32 (as llama.cpp keeps them).
LLAMA_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q8_0,
    "attn_v": Q.F16,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_1,
    "ffn_down": Q.Q6_K,
}
QWEN2_TYPES = {
    "token_embd": Q.F16,
    "attn_q": Q.F16,
    "attn_k": Q.BF16,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.F32,
    "ffn_down": Q.Q4_K,
    "output": Q.Q8_0,
}


# Vocabularies ------------------------------------------------------------------------


def byte_level_vocab(corpus=CORPUS, vocab_size=400):
    """A byte-level BPE (tokens in the GPT-2 byte alphabet, merges) trained on ``corpus``,
    the control tokens first as in Qwen2 / SmolLM vocabularies, a user-defined one last."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + [USER_TOKEN]
    kinds = {**dict.fromkeys(CONTROL_TOKENS, TokenType.CONTROL), USER_TOKEN: TokenType.USER_DEFINED}
    types = [kinds.get(t, TokenType.NORMAL) for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return dict(model="gpt2", tokens=tokens, types=types, merges=merges)


def sentencepiece_vocab():
    """A SentencePiece-style vocabulary (Llama 2 / Mistral layout): <unk>, <s>, </s>, the
    256 byte tokens, pieces with "▁" for spaces scored by merge order, then the chat
    control tokens and a user-defined one."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = tokenizer.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
    for token, kind in [
        *((t, TokenType.CONTROL) for t in CONTROL_TOKENS[1:]),
        (USER_TOKEN, TokenType.USER_DEFINED),
    ]:
        tokens.append(token)
        scores.append(0.0)
        types.append(kind)
    return dict(model="llama", tokens=tokens, types=types, scores=scores)


# Writing GGUF files as llama.cpp's converter does ------------------------------------


def _permute(weight, num_heads):
    """llama.cpp's ``LlamaModel.permute``: rotate-half rows to interleaved pairs."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _random_k_quant(rows, cols, qtype, rng):
    """Random blocks of a K-quant (``gguf`` cannot quantize to them) with scales that give
    O(0.3) values."""
    blocks = rows * cols // 256
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    data = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ..., int8 scales [16], d f16 last
        data[:, -2:] = np.full((blocks, 1), 2e-4, np.float16).view(np.uint8)
    elif qtype == Q.Q4_K:  # d f16, dmin f16, 6-bit scales and mins, 4-bit values
        data[:, 0:2] = np.full((blocks, 1), 1e-3, np.float16).view(np.uint8)
        data[:, 2:4] = np.full((blocks, 1), 7.5e-3, np.float16).view(np.uint8)
    else:
        raise ValueError(qtype)
    return data.reshape(rows, cols // 256 * size)


GEMMA3_LAYERS, GEMMA3_WINDOW = 7, 8  # one period of six (five local, one global) and one
# Gemma 3's released sizes (but 27B) have heads of 256: llama.cpp and transformers then
# agree on the query scale the file leaves out (head_dim ** -0.5 and 256 ** -0.5).
GEMMA3_HEAD_DIM = 256


def _random_weights(arch, vocab_size, rng, tie, num_layers, head_dim):
    """Hugging Face-named float32 weights at O(1) scale (norms near 1; Gemma's, stored as
    the scale minus one, near 0)."""
    d, f = DIMS["embed"], DIMS["mlp"]
    q, kv = DIMS["heads"] * head_dim, DIMS["kv_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab_size, d), "model.norm.weight": (d,)}
    if not tie:
        shapes["lm_head.weight"] = (vocab_size, d)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        if arch == "gemma3":
            shapes.update(
                {
                    p + "pre_feedforward_layernorm.weight": (d,),
                    p + "post_feedforward_layernorm.weight": (d,),
                    p + "self_attn.q_norm.weight": (head_dim,),
                    p + "self_attn.k_norm.weight": (head_dim,),
                }
            )
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
        if arch == "qwen2":
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    norm_mean = 0.0 if arch == "gemma3" else 1.0
    return {
        name: (
            norm_mean + 0.2 * rng.standard_normal(shape)
            if name.endswith("norm.weight")
            else 0.35 * rng.standard_normal(shape)
        ).astype(np.float32)
        for name, shape in shapes.items()
    }


def write_gguf(
    path,
    arch,
    vocab,
    *,
    types=None,
    tie=True,
    pre=None,
    seed=0,
    rope=None,
    drop=(),
    extra_tensors=(),
    eot=None,
    context=None,
):
    """Writes a 2-layer model (``GEMMA3_LAYERS`` for ``"gemma3"``) with ``vocab``'s
    tokenizer as llama.cpp's converter would.

    Args:
        types: ggml type by tensor kind (``LLAMA_TYPES``); F32 for the rest.
        rope: ``("linear", factor)`` or ``("llama3", factor, low, high, original)``.
        drop: GGUF tensor names left out; extra_tensors: ``(name, array, ggml type)``.
        context: the context length (``DIMS["context"]`` by default).
    """
    rng = np.random.default_rng(seed)
    types = types or {}
    num_layers = GEMMA3_LAYERS if arch == "gemma3" else DIMS["layers"]
    head_dim = GEMMA3_HEAD_DIM if arch == "gemma3" else DIMS["head_dim"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(num_layers)
    writer.add_context_length(context or DIMS["context"])
    writer.add_embedding_length(DIMS["embed"])
    writer.add_feed_forward_length(DIMS["mlp"])
    writer.add_head_count(DIMS["heads"])
    writer.add_head_count_kv(DIMS["kv_heads"])
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(len(vocab["tokens"]))
        writer.add_rope_dimension_count(DIMS["head_dim"])
    else:  # head_dim given in the Hugging Face config
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters
        writer.add_sliding_window(GEMMA3_WINDOW)
    if rope is not None and rope[0] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope[1])

    tokens = vocab["tokens"]
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(vocab["types"])
    if vocab["model"] == "gpt2":
        writer.add_token_merges(vocab["merges"])
        writer.add_bos_token_id(tokens.index("<|im_start|>"))
        writer.add_eos_token_id(tokens.index("<|endoftext|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
    else:
        writer.add_token_scores(vocab["scores"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(arch != "gemma3")
    if eot is not None:
        writer.add_eot_token_id(eot)
    writer.add_chat_template(CHAT_TEMPLATE)

    weights = _random_weights(arch, len(tokens), rng, tie, num_layers, head_dim)
    model_arch = {"llama": "LLAMA", "qwen2": "QWEN2", "gemma3": "GEMMA3"}.get(arch, "LLAMA")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, model_arch), num_layers)
    for hf_name, weight in weights.items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight + 1  # Gemma3Model.modify_tensors
        if arch == "llama" and name.endswith("attn_q.weight"):
            weight = _permute(weight, DIMS["heads"])
        if arch == "llama" and name.endswith("attn_k.weight"):
            weight = _permute(weight, DIMS["kv_heads"])
        if name in drop:
            continue
        qtype = Q.F32 if weight.ndim == 1 else types.get(name.split(".")[-2], Q.F32)
        if qtype in (Q.Q6_K, Q.Q4_K):
            writer.add_tensor(name, _random_k_quant(*weight.shape, qtype, rng), raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(weight, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    if rope is not None and rope[0] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(*rope[1:]))
    for name, array, qtype in extra_tensors:
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_divisors(factor, low, high, original):
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling (one float32 divisor per pair)."""
    head_dim = DIMS["head_dim"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * 10_000.0 ** (i / head_dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def random_texts(count, seed):
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(TEXT_PARTS, size=rng.integers(1, 14))) for _ in range(count)]
