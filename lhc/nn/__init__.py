"""Shared Flax linen layers: norms, RoPE, projections, MLPs and attention."""

from lhc.nn.attention import (
    Attention,
    AttentionImpl,
    KVView,
    LayerCache,
    LayerWriter,
    after,
    alibi_slopes,
    attention_impls,
    attention_mask,
    attention_segments,
    banded_self_attention,
    dot_product_attention,
    register_attention_impl,
    write_slots,
)
from lhc.nn.intervention import Edit, Intervention
from lhc.nn.linear import Einsum, Embed
from lhc.nn.mlp import GeluMLP, SwiGLU
from lhc.nn.norms import LayerNorm, RMSNorm
from lhc.nn.remat import REMAT_POLICIES, remat_policy
from lhc.nn.rope import ROPE_TYPES, apply_rope, rope_frequencies, validate_rope_scaling

__all__ = [
    # Layers.
    "Attention",
    "Einsum",
    "Embed",
    "GeluMLP",
    "LayerNorm",
    "RMSNorm",
    "SwiGLU",
    # Caches as attention reads them.
    "KVView",
    "LayerCache",
    "LayerWriter",
    # Interventions on activations.
    "Edit",
    "Intervention",
    # Attention functions and kernel dispatch.
    "AttentionImpl",
    "after",
    "alibi_slopes",
    "attention_segments",
    "banded_self_attention",
    "attention_impls",
    "attention_mask",
    "dot_product_attention",
    "register_attention_impl",
    "write_slots",
    # Rotary embeddings.
    "ROPE_TYPES",
    "apply_rope",
    "rope_frequencies",
    "validate_rope_scaling",
    # Rematerialisation.
    "REMAT_POLICIES",
    "remat_policy",
]
