"""llama.cpp GGUF files of the Llama, Qwen2, Mistral and Gemma 3 families, without torch.

``load(path)`` reads a ``.gguf`` file and returns an ``LMConfig`` and parameters for
``lhc.lm.Transformer``; ``load_tokenizer(path)`` builds its tokenizer and chat template
and ``stop_tokens(path)`` its end-of-generation ids, all from the same file.

A GGUF file is llama.cpp's single-file checkpoint: a header of typed key/value metadata
(the model's hyperparameters under ``{arch}.*``, the vocabulary under ``tokenizer.*``),
a table of tensors, then the tensor data, each tensor in its own ggml type: F32, F16,
BF16, or a block quantization (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K-Q6_K:
blocks of 32 or 256 values sharing scales). The file is memory-mapped and read by
``lhc.lm.gguf_file``, and each tensor is dequantized to float32 with llama.cpp's own
``gguf.quants.dequantize`` when it is converted, one at a time.

The metadata becomes a Hugging Face ``config.json`` dict and the tensors get Hugging Face
names, so ``lhc.lm.hf.config_from_hf`` and ``lhc.lm.hf.params_from_hf`` build (and
check) the config and parameters::

    general.architecture "llama" | "qwen2" | "gemma3"
                                             -> LlamaForCausalLM | Qwen2ForCausalLM |
                                                Gemma3ForCausalLM
    {arch}.block_count                       -> num_hidden_layers
    {arch}.embedding_length                  -> hidden_size
    {arch}.feed_forward_length               -> intermediate_size
    {arch}.attention.head_count(_kv)         -> num_attention_heads (num_key_value_heads)
    {arch}.attention.key_length              -> head_dim (else rope.dimension_count,
                                                else hidden_size / head_count)
    {arch}.attention.layer_norm_rms_epsilon  -> rms_norm_eps
    {arch}.context_length                    -> max_position_embeddings
    {arch}.rope.freq_base                    -> rope_theta
    {arch}.rope.scaling.type/.factor         -> rope_scaling ("linear", "yarn": also
                                                .original_context_length, .yarn_beta_*)
    rope_freqs.weight (tensor)               -> rope_scaling ("llama3", see below)
    rows of token_embd.weight                -> vocab_size
    no output.weight tensor                  -> tie_word_embeddings

    token_embd.weight               -> model.embed_tokens.weight
    blk.i.attn_norm.weight          -> model.layers.i.input_layernorm.weight
    blk.i.attn_{q,k,v}.weight/.bias -> model.layers.i.self_attn.{q,k,v}_proj.weight/.bias
    blk.i.attn_output.weight        -> model.layers.i.self_attn.o_proj.weight
    blk.i.ffn_norm.weight           -> model.layers.i.post_attention_layernorm.weight
    blk.i.ffn_{gate,up,down}.weight -> model.layers.i.mlp.{gate,up,down}_proj.weight
    output_norm.weight              -> model.norm.weight
    output.weight                   -> lm_head.weight

Gemma 3 (``gemma3``): ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` and
``post_ffw_norm`` are the input, post-attention, pre-feed-forward and post-feed-forward
norms, ``attn_q_norm`` / ``attn_k_norm`` the per-head ones; llama.cpp stores every norm
weight plus one (Gemma's ``1 + w``), which ``load`` subtracts, and hard-codes what the
file leaves out (``llama-model.cpp``): every sixth layer global, the local RoPE base
10,000, and the query scale ``head_dim ** -0.5`` but for the 27B model (62 blocks):
``(hidden / heads) ** -0.5``. (transformers' GGUF loader takes Gemma3TextConfig's
``query_pre_attn_scalar`` 256 instead: the same for every released size but 27B.)

GGUF lists a tensor's dimensions fastest-varying first (``ne``); ``GGUFReader`` gives the
data in numpy order, so a linear layer arrives as Hugging Face's ``[out, in]``.

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` of ``"llama"`` files
(Mistral files are ``"llama"`` files too; Qwen2 files are not permuted): within each head
of ``H`` rows, Hugging Face's rotate-half row ``j * H/2 + i`` (half ``j``, pair ``i``) is
stored at row ``2 i + j``, the interleaved pairs of ggml's RoPE. ``load`` undoes it.

Llama 3's RoPE scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency
divisors (1 for short wavelengths, ``factor`` for long ones, a blend between) rather than
as metadata; ``load`` recovers the ``llama3`` parameters from it and checks that they
reproduce every divisor.

The tokenizer, chat template and stop tokens come from ``lhc.lm.gguf_tokenizer``
(``load_tokenizer``, ``stop_tokens``; also importable from here).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc.lm import hf
from lhc.lm.config import LMConfig
from lhc.lm.gguf_file import GGUFFile, GGUFTensor, read_gguf
from lhc.lm.gguf_tokenizer import load_tokenizer, stop_tokens  # noqa: F401 (lhc.lm.gguf's API)
from lhc.nn.rope import rope_frequencies

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_REQUIRED = object()

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's blocks have four norms and per-head q/k norms; ffn_norm is the MLP's input
# norm in both layouts, called pre_feedforward_layernorm there.
_GEMMA3_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if not k.endswith(".bias")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"

# Reading -----------------------------------------------------------------------------


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's rotate-half row order of a q/k weight ``[N*H, ...]`` (or bias
    ``[N*H]``) from llama.cpp's interleaved one (row ``2 i + j`` of a head holds
    Hugging Face's row ``j * H/2 + i``)."""
    rest = weight.shape[1:]
    pairs = weight.reshape(num_heads, -1, 2, *rest)  # [N, H/2 (i), 2 (j), ...]
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(weight.shape)


class _Dequantized:
    """One GGUF tensor, dequantized (and un-permuted) only when made an array, so that
    ``params_from_hf`` holds one float32 tensor at a time beside the parameters."""

    def __init__(self, tensor: GGUFTensor, permuted_heads: int | None = None, offset: float = 0):
        self._tensor = tensor
        self._permuted_heads = permuted_heads
        self._offset = offset
        self.shape = tensor.shape

    def __array__(self, dtype=None, copy=None):
        values = self._tensor.dequantize()
        if self._permuted_heads is not None:
            values = _unpermute_rows(values, self._permuted_heads)
        if self._offset:
            values = values + np.float32(self._offset)
        return values if dtype is None else values.astype(dtype)


# Config ------------------------------------------------------------------------------


def _llama3_rope_scaling(
    divisors: np.ndarray, rope_theta: float, head_dim: int, source: str
) -> dict[str, Any] | None:
    """The ``llama3`` RoPE scaling whose frequencies are llama.cpp's ``rope_freqs``.

    llama.cpp divides frequency ``k`` by ``divisors[k]``: 1 for wavelengths below
    ``original / high``, ``factor`` above ``original / low``, and
    ``1 / ((1 - s) / factor + s)`` between, with ``s = (original / wavelength - low) /
    (high - low)``, linear in 1/wavelength. Only the ratios ``low / original`` and
    ``high / original`` matter, so ``low`` is taken as 1 (Llama 3's value); they are
    fitted from the blended frequencies, or Llama 3's published values (1, 4, 8192) are
    used when fewer than two frequencies are blended.

    Raises:
        ValueError: the divisors follow no ``llama3`` scaling.
    """
    base = rope_frequencies(head_dim, rope_theta).astype(np.float64)
    divisors = np.asarray(divisors, np.float64)
    if divisors.shape != base.shape:
        raise ValueError(
            f"{source}: {_ROPE_FREQS} has shape {divisors.shape}, expected {base.shape} "
            f"(head_dim {head_dim} / 2)"
        )
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0):
        return None
    inverse_wavelengths = base / (2 * math.pi)
    blend = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # s: 0 long, 1 short
    blended = (blend > 1e-4) & (blend < 1 - 1e-4)
    low, high, original = 1.0, 4.0, 8192
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(inverse_wavelengths[blended], blend[blended], 1)
        if slope > 0 and intercept < 0:
            high = round(float(1 - 1 / intercept), 4)
            original = int(round(float(-slope / intercept)))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    implied = base / rope_frequencies(head_dim, rope_theta, scaling)
    if not np.allclose(implied, divisors, rtol=1e-3, atol=0):
        raise ValueError(
            f"{source}: the RoPE divisors in {_ROPE_FREQS} follow no llama3 scaling "
            f"(closest: {scaling}); only linear and llama3 RoPE scaling are supported"
        )
    return scaling


def _rope_scaling(
    file: GGUFFile, arch: str, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    tensors = file.tensors
    if _ROPE_FREQS in tensors:
        divisors = np.asarray(_Dequantized(tensors[_ROPE_FREQS]))
        return _llama3_rope_scaling(divisors, rope_theta, head_dim, file.path)
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(file.get(f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        return _yarn_rope_scaling(file, arch)
    raise ValueError(
        f"{file.path}: {arch}.rope.scaling.type {kind!r} is not supported (expected 'none', "
        "'linear', 'yarn', or Llama 3 scaling as rope_freqs.weight)"
    )


# llama.cpp's YaRN keys that change its temperature or blend away from transformers'
# defaults, with the values that leave them unchanged (-1: "the default" for ext_factor).
_YARN_NEUTRAL = {
    "rope.scaling.attn_factor": (1.0,),
    "rope.scaling.yarn_attn_factor": (1.0,),
    "rope.scaling.yarn_log_multiplier": (0.0,),
    "rope.scaling.yarn_ext_factor": (-1.0, 1.0),
}


def _yarn_rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any]:
    """transformers' ``yarn`` parameters from llama.cpp's: ``rope.scaling.factor``,
    ``rope.scaling.original_context_length`` (else ``context_length``, as llama.cpp, filled
    in by ``config_from_hf``) and ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` if
    present. llama.cpp then rounds the blend band outwards (``truncate``) and scales by
    ``0.1 ln(factor) + 1``, transformers' defaults; files that change that temperature
    (``attn_factor``, ``yarn_log_multiplier``...) are refused."""
    for key, neutral in _YARN_NEUTRAL.items():
        value = file.get(f"{arch}.{key}", None)
        if value is not None and float(value) not in neutral:
            raise ValueError(
                f"{file.path}: {arch}.{key} = {value} is not supported with YaRN (only "
                f"{neutral}: the factor, context and beta keys are read)"
            )
    scaling = {"rope_type": "yarn", "factor": float(file.get(f"{arch}.rope.scaling.factor"))}
    optional = {
        "original_max_position_embeddings": ("rope.scaling.original_context_length", int),
        "beta_fast": ("rope.scaling.yarn_beta_fast", float),
        "beta_slow": ("rope.scaling.yarn_beta_slow", float),
    }
    for name, (key, cast) in optional.items():
        value = file.get(f"{arch}.{key}", None)
        if value is not None:
            scaling[name] = cast(value)
    return scaling


def _hf_config(file: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict that the file's metadata describes.

    Raises:
        ValueError: unsupported architecture or feature, missing metadata.
    """
    arch = file.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{file.path}: unsupported architecture {arch!r}; expected one of "
            f"{SUPPORTED_ARCHITECTURES} (Mistral files are 'llama')"
        )

    def get(name, default=_REQUIRED):
        return file.get(f"{arch}.{name}", default)

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(
            f"{file.path}: {arch}.attention.head_count_kv differs between layers "
            f"({num_kv_heads}), which lhc does not support"
        )
    rotary_dims = get("rope.dimension_count", None)
    head_dim = int(get("attention.key_length", None) or rotary_dims or hidden_size // num_heads)
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        raise ValueError(
            f"{file.path}: {arch}.rope.dimension_count is {rotary_dims} but heads have "
            f"{head_dim} features; partial rotary embeddings are not supported"
        )
    tensors = file.tensors
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{file.path}: missing tensors ['token_embd.weight']")
    rope_theta = float(get("rope.freq_base", 10_000.0))

    def has_bias(*names):
        return any(name.endswith(f".{n}.bias") for name in tensors for n in names)

    if arch == "gemma3":
        return _gemma3_hf_config(file, hidden_size, num_heads, int(num_kv_heads), head_dim)
    return {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "num_hidden_layers": int(get("block_count")),
        "hidden_size": hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(file, arch, rope_theta, head_dim),
        # llama.cpp writes output.weight only when it is not the embedding table.
        "tie_word_embeddings": "output.weight" not in tensors,
        # Qwen2 always has q/k/v biases; config_from_hf rejects Llama's (and MLP biases).
        "attention_bias": arch != "qwen2" and has_bias("attn_q", "attn_k", "attn_v", "attn_output"),
        "mlp_bias": has_bias("ffn_gate", "ffn_up", "ffn_down"),
    }


def _gemma3_hf_config(
    file: GGUFFile, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, Any]:
    """A ``Gemma3ForCausalLM`` config.json from a ``gemma3`` file, with what llama.cpp
    hard-codes rather than stores (as its ``llama-model.cpp`` does): every sixth layer
    global, the local layers' RoPE base 10,000, and the query scale ``head_dim ** -0.5``
    except for the 27B model (62 blocks): ``(hidden_size / heads) ** -0.5``."""
    num_layers = int(file.get("gemma3.block_count"))
    rope_theta = float(file.get("gemma3.rope.freq_base", 1_000_000.0))
    query_scalar = hidden_size // num_heads if num_layers == 62 else head_dim
    return {
        "architectures": [_HF_ARCHITECTURES["gemma3"]],
        "model_type": "gemma3_text",
        "vocab_size": file.tensors["token_embd.weight"].shape[0],
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(file.get("gemma3.feed_forward_length")),
        "max_position_embeddings": int(file.get("gemma3.context_length")),
        "rms_norm_eps": float(file.get("gemma3.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": _rope_scaling(file, "gemma3", rope_theta, head_dim),
        "sliding_window": int(file.get("gemma3.attention.sliding_window")),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": query_scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }


# Tensors -----------------------------------------------------------------------------


def _layer_tensors(arch: str) -> dict[str, str]:
    return _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS


def _required_tensors(arch: str, num_layers: int) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    per_layer = [name for name in _layer_tensors(arch) if name.endswith(".weight")]
    if arch == "qwen2":
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    names += [f"blk.{layer}.{name}" for layer in range(num_layers) for name in per_layer]
    return names


def _hf_name(name: str, arch: str) -> str:
    """The Hugging Face name of a GGUF tensor (unknown names are kept, so that
    ``params_from_hf`` reports them as unexpected)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_TENSOR.fullmatch(name)
    layer_tensors = _layer_tensors(arch)
    if match and match.group(2) in layer_tensors:
        return f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}"
    return name


def _hf_tensors(file: GGUFFile, hf_config: dict[str, Any]) -> dict[str, _Dequantized]:
    """Lazily dequantized tensors under Hugging Face names, q/k rows un-permuted.

    Raises:
        ValueError: a tensor of an unsupported ggml type, or required tensors missing.
    """
    tensors = file.tensors
    for name, tensor in tensors.items():
        if tensor.ggml_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{file.path}: tensor {name!r} has ggml type {tensor.ggml_type}, "
                f"which lhc cannot dequantize; supported: {SUPPORTED_TENSOR_TYPES}"
            )
    arch = file.get("general.architecture")
    missing = sorted(set(_required_tensors(arch, hf_config["num_hidden_layers"])) - set(tensors))
    if missing:
        raise ValueError(
            f"{file.path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"(a {arch} file with {hf_config['num_hidden_layers']} blocks)"
        )
    permuted = {}
    if arch == "llama":
        permuted = {
            "attn_q": hf_config["num_attention_heads"],
            "attn_k": hf_config["num_key_value_heads"],
        }
    # llama.cpp stores Gemma's norm weights plus one; Hugging Face's, as lhc's, without.
    norm_offset = -1.0 if arch == "gemma3" else 0.0
    out = {}
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue  # read into the config
        kind = name.split(".")[-2] if name.startswith("blk.") else None
        offset = norm_offset if name.endswith("norm.weight") else 0.0
        out[_hf_name(name, arch)] = _Dequantized(tensor, permuted.get(kind), offset)
    return out


def hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` dict that the GGUF file at ``path`` describes (read from its
    header; no tensor is read)."""
    return _hf_config(read_gguf(path))


def load(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    **overrides: Any,
) -> tuple[LMConfig, dict[str, Any]]:
    """Loads a Llama, Qwen2 or Mistral GGUF file (quantized tensors are dequantized).

    The arguments and the result are ``lhc.lm.hf.load``'s, with ``path`` the ``.gguf``
    file: ``(config, params)`` in ``dtype`` (``overrides`` are further ``LMConfig``
    fields, e.g. ``kernel_layout="out_in"``), placed on ``mesh`` one at a time if given.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file, truncated, an unsupported architecture, feature or
            ggml type, tensors missing, unexpected or of the wrong shape.
    """
    file = read_gguf(path)
    hf_config = _hf_config(file)
    tensors = _hf_tensors(file, hf_config)
    try:
        return hf.from_hf(hf_config, tensors, dtype, mesh=mesh, rules=rules, **overrides)
    except ValueError as error:
        raise ValueError(f"{file.path}: {error}") from error
