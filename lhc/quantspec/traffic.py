"""QuantSpec's memory-traffic model: decoding is bound by the bytes read per step.

With ``P`` the linear-layer parameters (the output head included), ``E = 2 L K d`` the
key and value elements of one token (L layers, K key/value heads of d channels), ``S``
the context and ``G`` the KV group size, the bytes read per step are

* plain decoding (16-bit weights and KV): ``2 P + 2 E S``;
* a draft step (4-bit weights at ``0.5 + 2/128`` bytes each, 4-bit KV with 16-bit scale
  and minimum per group for keys and for values): ``b_w P + (0.5 + 4/G) E S``, where
  only the MLP is 4-bit (``weights="mlp"``, the official code) or every linear layer
  (``"all"``);
* the verify pass (16-bit weights, 8-bit KV): ``2 P + (1 + 4/G) E S``.

A round drafts ``gamma`` tokens and verifies them in one pass, and yields ``gamma a +
1`` tokens at acceptance rate ``a``; the predicted speedup over plain decoding is
``(gamma a + 1) AR / (gamma draft + verify)``, an upper bound (compute, the buffer and
the kernels' overheads are not counted).
"""

from __future__ import annotations

import dataclasses

WEIGHT_BYTES_4BIT = 0.5 + 2 / 128  # a 16-bit scale per 128 weights


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What the traffic model needs of a decoder.

    Attributes:
        name: a label.
        linear_params: P, every linear layer's weights, the output head included.
        mlp_params: the MLP's share of P.
        kv_elements: E, key and value elements per token over all layers.
    """

    name: str
    linear_params: int
    mlp_params: int
    kv_elements: int


def decoder_size(
    name: str, *, layers, embed_dim, heads, kv_heads, head_dim, mlp_dim, vocab_size
) -> ModelSize:
    """``ModelSize`` of a Llama-style decoder (gated MLP of three matrices)."""
    attention = embed_dim * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * embed_dim * mlp_dim
    return ModelSize(
        name=name,
        linear_params=layers * (attention + mlp) + embed_dim * vocab_size,
        mlp_params=layers * mlp,
        kv_elements=2 * layers * kv_heads * head_dim,
    )


def size_of_config(config, name: str = "model") -> ModelSize:
    """``ModelSize`` of an ``lhc.lm.LMConfig`` (gated MLP assumed)."""
    return decoder_size(
        name,
        layers=config.num_layers,
        embed_dim=config.embed_dim,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        mlp_dim=config.mlp_dim,
        vocab_size=config.vocab_size,
    )


# name: layers, width, heads, kv heads, head dim, MLP width, vocabulary.
_ARCHITECTURES = {
    "llama-2-7b": (32, 4096, 32, 32, 128, 11008, 32000),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256),
    "mistral-7b-v0.3": (32, 4096, 32, 8, 128, 14336, 32768),
}
_FIELDS = ("layers", "embed_dim", "heads", "kv_heads", "head_dim", "mlp_dim", "vocab_size")
NAMED = {
    name: decoder_size(name, **dict(zip(_FIELDS, values)))
    for name, values in _ARCHITECTURES.items()
}


def step_bytes(size: ModelSize, context: int, *, group_size: int = 128, weights: str = "mlp"):
    """Bytes read by a plain decoding step, a draft step and a verify pass at ``context``.

    Returns:
        ``{"ar": ..., "draft": ..., "verify": ...}``.
    """
    if weights not in ("mlp", "all"):
        raise ValueError(f"weights must be 'mlp' or 'all', got {weights!r}")
    p, e, s = size.linear_params, size.kv_elements, context
    if weights == "all":
        draft_weights = WEIGHT_BYTES_4BIT * p
    else:
        draft_weights = 2 * (p - size.mlp_params) + WEIGHT_BYTES_4BIT * size.mlp_params
    return {
        "ar": 2 * p + 2 * e * s,
        "draft": draft_weights + (0.5 + 4 / group_size) * e * s,
        "verify": 2 * p + (1 + 4 / group_size) * e * s,
    }


def predicted_speedup(
    size: ModelSize,
    context: int,
    *,
    gamma: int,
    acceptance: float,
    group_size: int = 128,
    weights: str = "mlp",
) -> float:
    """``(gamma a + 1) AR / (gamma draft + verify)``; ``acceptance`` is accepted / gamma."""
    b = step_bytes(size, context, group_size=group_size, weights=weights)
    return (gamma * acceptance + 1) * b["ar"] / (gamma * b["draft"] + b["verify"])
