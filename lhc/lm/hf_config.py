"""Hugging Face ``config.json`` files and ``LMConfig``: reading the Llama, Qwen2, Mistral
and Gemma 3 layouts (``config_from_hf``), and writing one (``config_to_hf``).

Gemma 3 (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``; the text part of
``Gemma3ForConditionalGeneration``, under ``text_config``), as transformers'
``modeling_gemma3.py`` computes it: the layers of ``layer_types`` (else every
``sliding_window_pattern``-th, 6 by default, global: ``(i + 1) % 6 == 0``) attend
fully, the others within ``sliding_window`` keys (the current one and ``W - 1``
before); RoPE base ``rope_local_base_freq`` (10,000) on local layers and ``rope_theta``
(1e6) with any ``rope_scaling`` on global ones (transformers 5 writes both under
``rope_parameters``, keyed by layer type); RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 +
w)`` in float32 (``norm_scale_offset`` 1) before and after attention and the MLP and on
each head's queries and keys; token embeddings times ``sqrt(hidden_size)``; GeGLU with
the tanh GELU; scores scaled by ``query_pre_attn_scalar ** -0.5``; tied embeddings. Soft
capping of scores or logits (Gemma 2) and bidirectional attention are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lhc.lm.config import LMConfig
from lhc.nn.rope import ntk_rope_theta

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
}
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma3TextConfig's defaults, for keys a config.json leaves out.
_GEMMA3_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}


def _architecture(hf_config: Mapping[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    by_type = {v: k for k, v in _MODEL_TYPES.items()}
    if not architectures and hf_config.get("model_type") in by_type:
        return by_type[hf_config["model_type"]]
    raise ValueError(
        f"unsupported architecture: expected one of {SUPPORTED_ARCHITECTURES}, got "
        f"architectures={architectures!r} model_type={hf_config.get('model_type')!r}"
    )


def _rope(hf_config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either config layout.

    As transformers' ``standardize_rope_params``: a ``yarn`` or ``llama3`` scaling
    without ``original_max_position_embeddings`` takes ``max_position_embeddings``, and a
    top-level ``original_max_position_embeddings`` (Phi-3's place) replaces the one in
    ``rope_scaling``; a ``yarn`` ``factor`` of null is ``max_position_embeddings /
    original_max_position_embeddings``. ``"dynamic"`` is passed on, for
    ``validate_rope_scaling`` to refuse (an override of ``rope_scaling`` replaces it).
    """
    parameters = hf_config.get("rope_parameters")
    if parameters is not None:
        # transformers >= 5: {"rope_type": ..., "rope_theta": ..., scaling keys}.
        if "rope_theta" not in parameters:
            raise ValueError(
                f"config.json rope_parameters must hold rope_theta (one set of RoPE parameters "
                f"for all layers), got {parameters!r}"
            )
        theta = parameters["rope_theta"]
        scaling = dict(parameters)
    else:
        theta = hf_config.get("rope_theta", 10_000.0)
        scaling = hf_config.get("rope_scaling")
        scaling = None if scaling is None else dict(scaling)
    if scaling is not None:
        scaling.pop("rope_theta", None)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type in ("yarn", "llama3"):
            max_len = hf_config.get("max_position_embeddings")
            if hf_config.get("original_max_position_embeddings") is not None:
                scaling["original_max_position_embeddings"] = hf_config[
                    "original_max_position_embeddings"
                ]
            elif max_len is not None:
                scaling.setdefault("original_max_position_embeddings", max_len)
            original = scaling.get("original_max_position_embeddings")
            if rope_type == "yarn" and scaling.get("factor") is None and max_len and original:
                scaling["factor"] = max_len / original
    return float(theta), scaling


def _rope_to_hf(config: LMConfig) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of a config.json. transformers has no static
    NTK type: ``"ntk"`` is written as default RoPE with its scaled base (the same
    frequencies); a ``yarn`` ``truncate`` is written only when false (transformers
    versions before it always truncate)."""
    scaling = None if config.rope_scaling is None else dict(config.rope_scaling)
    theta = config.rope_theta
    if scaling is not None and scaling["rope_type"] == "ntk":
        theta = ntk_rope_theta(config.head_dim, theta, scaling["factor"])
        scaling = None
    elif scaling is not None and scaling.get("truncate") is True:
        del scaling["truncate"]
    return {"rope_theta": theta, "rope_scaling": scaling}


def _sliding_window(architecture: str, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``full_attention_layers`` of a config.json.

    Mistral slides in every layer when ``sliding_window`` is set. Qwen2 slides only with
    ``use_sliding_window``, in the layers that ``layer_types`` marks
    ``"sliding_attention"`` (written by recent transformers) or else from
    ``max_window_layers`` on.
    """
    num_layers = hf_config["num_hidden_layers"]
    window = hf_config.get("sliding_window")
    if architecture == "LlamaForCausalLM" or window is None:
        return {}
    if architecture == "Qwen2ForCausalLM" and not hf_config.get("use_sliding_window", False):
        return {}
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown or len(layer_types) != num_layers:
            raise ValueError(
                f"config.json layer_types must list {num_layers} of 'full_attention' / "
                f"'sliding_attention', got {layer_types!r}"
            )
        full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    elif architecture == "Qwen2ForCausalLM":
        full = list(range(min(hf_config.get("max_window_layers", 28), num_layers)))
    else:
        full = []
    return dict(sliding_window=int(window), full_attention_layers=tuple(full))


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> LMConfig:
    """``LMConfig`` from the dict of a Llama, Qwen2 or Mistral ``config.json``.

    Args:
        hf_config: the parsed ``config.json``.
        **overrides: ``LMConfig`` fields to set (``dtype``, ``scan_layers``, ``max_len``...).

    Raises:
        ValueError: unsupported architecture or feature (activation other than SiLU,
            Llama/Mistral attention or MLP biases, unknown RoPE scaling, malformed
            ``layer_types``).
    """
    architecture = _architecture(hf_config)
    if architecture in GEMMA3:
        return _gemma3_config(architecture, hf_config, overrides)
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hf_config.get('hidden_act')!r}")
    qkv_bias = architecture == "Qwen2ForCausalLM"
    if not qkv_bias:
        for key in ("attention_bias", "mlp_bias"):
            if hf_config.get(key, False):
                raise ValueError(f"{architecture} with {key}=true is not supported")
    num_heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    rope_theta, rope_scaling = _rope(hf_config)
    values = dict(
        vocab_size=hf_config["vocab_size"],
        num_layers=hf_config["num_hidden_layers"],
        embed_dim=hf_config["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        mlp_dim=hf_config["intermediate_size"],
        max_len=hf_config["max_position_embeddings"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        qkv_bias=qkv_bias,
        # LlamaConfig, Qwen2Config and MistralConfig default to untied embeddings.
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        **_sliding_window(architecture, hf_config),
    )
    values.update(overrides)
    return LMConfig.from_dict(values)


def _shapes(config: LMConfig) -> dict[str, Any]:
    """The config.json keys every architecture shares: sizes, context and RoPE."""
    return {
        "vocab_size": config.vocab_size,
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.embed_dim,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp_dim,
        "max_position_embeddings": config.max_len,
        **_rope_to_hf(config),
    }


def config_to_hf(config: LMConfig) -> dict[str, Any]:
    """A ``config.json`` dict for ``config``.

    Qwen2 when it has q/k/v biases; else Mistral when it has a sliding window (in every
    layer); else Llama. RoPE is written as ``rope_theta`` + ``rope_scaling``, the layout
    of released checkpoints, which every ``transformers`` version reads (static NTK as
    default RoPE with its scaled base, see ``_rope_to_hf``).

    Raises:
        ValueError: a sliding window in only some layers without q/k/v biases (no
            supported architecture expresses it), or a GPT-2-style block (LayerNorm, GELU
            MLP), which the Llama/Qwen2 layouts cannot hold.
    """
    if is_gemma3(config):
        return _gemma3_config_to_hf(config)
    gemma_parts = [
        name
        for name in (
            "qk_norm",
            "post_norms",
            "norm_scale_offset",
            "embed_scale",
            "local_rope_theta",
        )
        if getattr(config, name)
    ]
    if gemma_parts:
        raise ValueError(
            f"a config with {gemma_parts} but not all of Gemma 3's block (qk_norm, post_norms, "
            "norm_scale_offset 1, embed_scale, mlp_type 'geglu') has no Hugging Face "
            "architecture"
        )
    if config.norm_type != "rmsnorm" or config.mlp_type != "swiglu":
        raise ValueError(
            "Hugging Face export writes Llama/Qwen2 checkpoints (RMSNorm, SwiGLU); this "
            f"config has norm_type={config.norm_type!r}, mlp_type={config.mlp_type!r}"
        )
    if config.qkv_bias:
        architecture = "Qwen2ForCausalLM"
    elif config.sliding_window is not None:
        if config.full_attention_layers:
            raise ValueError(
                "a model without q/k/v biases and with full_attention_layers "
                f"{config.full_attention_layers} has no Hugging Face architecture (Mistral "
                "slides in every layer)"
            )
        architecture = "MistralForCausalLM"
    else:
        architecture = "LlamaForCausalLM"
    hf_config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        **_shapes(config),
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": config.param_dtype,
    }
    if architecture == "Qwen2ForCausalLM":
        sliding = config.sliding_window is not None
        hf_config.update(use_sliding_window=sliding, sliding_window=config.sliding_window)
        if sliding:
            hf_config["layer_types"] = [
                "full_attention" if config.layer_window(i) is None else "sliding_attention"
                for i in range(config.num_layers)
            ]
            # Older transformers read max_window_layers (the first layers attend fully).
            full = config.full_attention_layers
            prefix = full == tuple(range(len(full)))
            hf_config["max_window_layers"] = len(full) if prefix else 0
    else:
        hf_config.update(attention_bias=False, mlp_bias=False)
        if architecture == "MistralForCausalLM":
            hf_config["sliding_window"] = config.sliding_window
    return hf_config


def _gemma3_rope(text: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, rope_scaling, local_rope_theta)`` from either config layout."""
    parameters = text.get("rope_parameters")
    if parameters is not None and "full_attention" in parameters:
        full = dict(parameters["full_attention"])
        local = dict(parameters.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"config.json: RoPE scaling of the sliding-window layers is not supported, "
                f"got {local!r}"
            )
        theta, scaling = _rope(
            {"rope_parameters": full, "max_position_embeddings": text["max_position_embeddings"]}
        )
        return theta, scaling, float(local.get("rope_theta", 10_000.0))
    theta, scaling = _rope({"rope_theta": text.get("rope_theta", 1_000_000.0), **text})
    return theta, scaling, float(text.get("rope_local_base_freq", 10_000.0))


def _gemma3_config(
    architecture: str, hf_config: Mapping[str, Any], overrides: Mapping[str, Any]
) -> LMConfig:
    text = dict(hf_config.get("text_config") or {}) if architecture != GEMMA3[0] else {}
    text = {**_GEMMA3_DEFAULTS, **(text or hf_config)}
    activation = text.get("hidden_activation") or text.get("hidden_act")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json hidden_activation must be 'gelu_pytorch_tanh' (Gemma 3), got "
            f"{activation!r}"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if text.get(key):
            raise ValueError(f"config.json {key}={text[key]!r} is not supported (Gemma 3 has none)")
    if text.get("attention_bias"):
        raise ValueError("Gemma 3 with attention_bias=true is not supported")
    num_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        pattern = int(text.get("sliding_window_pattern", 6))
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"config.json layer_types must list {num_layers} of 'full_attention' / "
            f"'sliding_attention', got {layer_types!r}"
        )
    rope_theta, rope_scaling, local_rope_theta = _gemma3_rope(text)
    values = dict(
        vocab_size=text["vocab_size"],
        num_layers=num_layers,
        embed_dim=text["hidden_size"],
        num_heads=text["num_attention_heads"],
        num_kv_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        mlp_dim=text["intermediate_size"],
        max_len=text["max_position_embeddings"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        local_rope_theta=local_rope_theta,
        norm_eps=text["rms_norm_eps"],
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", text["tie_word_embeddings"])),
        sliding_window=int(text["sliding_window"]),
        full_attention_layers=tuple(
            i for i, kind in enumerate(layer_types) if kind == "full_attention"
        ),
        qk_norm=True,
        post_norms=True,
        norm_scale_offset=1.0,
        embed_scale=True,
        mlp_type="geglu",
        query_scale=float(text["query_pre_attn_scalar"]) ** -0.5,
        **overrides,
    )
    return LMConfig.from_dict(values)


def is_gemma3(config: LMConfig) -> bool:
    """Whether ``config`` has Gemma 3's block (its norms, GeGLU, scaled embeddings)."""
    return (
        config.qk_norm
        and config.post_norms
        and config.norm_scale_offset == 1.0
        and config.embed_scale
        and config.mlp_type == "geglu"
    )


def _gemma3_config_to_hf(config: LMConfig) -> dict[str, Any]:
    query_scalar = (config.query_scale or config.head_dim**-0.5) ** -2
    hf_config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_shapes(config),
        "rope_local_base_freq": config.local_rope_theta or config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_activation": "gelu_pytorch_tanh",
        # An int where it is one (transformers' config types it so).
        "query_pre_attn_scalar": round(query_scalar)
        if abs(query_scalar - round(query_scalar)) < 1e-6
        else query_scalar,
        "sliding_window": config.sliding_window or config.max_len,
        "layer_types": [
            "full_attention" if config.layer_window(i) is None else "sliding_attention"
            for i in range(config.num_layers)
        ],
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "torch_dtype": config.param_dtype,
    }
    return hf_config
