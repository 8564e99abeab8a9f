"""Shared Flax linen layers: norms, RoPE, projections, MLPs and attention."""

from lhc.nn.attention import (
    Attention,
    KVView,
    LayerCache,
    LayerWriter,
    ordered_after,
    write_slots,
)
from lhc.nn.attention_ops import (
    AttentionImpl,
    alibi_slopes,
    attention_impls,
    attention_mask,
    attention_segments,
    banded_self_attention,
    dot_product_attention,
    register_attention_impl,
)
from lhc.nn.intervention import Edit, Intervention
from lhc.nn.linear import Einsum, Embed, dense, output_logits
from lhc.nn.mlp import GeGLU, GeluMLP, SwiGLU
from lhc.nn.norms import LayerNorm, RMSNorm
from lhc.nn.remat import REMAT_POLICIES, remat_policy
from lhc.nn.rope import ROPE_TYPES, apply_rope, rope_frequencies, validate_rope_scaling
from lhc.nn.switch import apply_switched

__all__ = [
    "apply_switched",
    # Layers.
    "Attention",
    "Einsum",
    "Embed",
    "GeGLU",
    "GeluMLP",
    "LayerNorm",
    "RMSNorm",
    "SwiGLU",
    "dense",
    "output_logits",
    # Caches as attention reads them.
    "KVView",
    "LayerCache",
    "LayerWriter",
    "ordered_after",
    "write_slots",
    # Interventions on activations.
    "Edit",
    "Intervention",
    # Attention functions and kernel dispatch.
    "AttentionImpl",
    "alibi_slopes",
    "attention_segments",
    "banded_self_attention",
    "attention_impls",
    "attention_mask",
    "dot_product_attention",
    "register_attention_impl",
    # Rotary embeddings.
    "ROPE_TYPES",
    "apply_rope",
    "rope_frequencies",
    "validate_rope_scaling",
    # Rematerialisation.
    "REMAT_POLICIES",
    "remat_policy",
]
