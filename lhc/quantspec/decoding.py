"""QuantSpec decoding on an ``lhc.lm.Transformer``: plain decoding on the target path
(8-bit KV cache, full weights) and self-speculative decoding whose draft reads the same
cache at 4 bits with 4-bit weights.

    from lhc import quantspec
    out = quantspec.speculative_generate(model, params, prompts, gamma=4, max_new_tokens=64)
    same = quantspec.generate(model, params, prompts, max_new_tokens=64)  # greedy: equal

A round drafts ``gamma`` tokens one at a time in the target's own cache (the draft's
keys land in the full-precision buffer), rewinds it, and verifies the pending token and
the drafts in one pass of the target, which overwrites the draft's keys; acceptance is
``lhc.lm``'s speculative sampling (greedy: the longest prefix that agrees with the
target's argmax, plus its next token). Because the cache decides per query slot which
tokens are read quantized, the verification pass computes what one-token decoding on
the same cache computes, and the greedy output equals ``generate``'s token for token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from lhc import lm
from lhc.quantspec.cache import QuantSpecCache, init_cache
from lhc.quantspec.weights import dequantize_params, quantize_params

# The dense decoder that ``configs/quantspec_passkey.py`` trains and ``lhc bench quantspec
# --random`` measures: byte tokens, 4 layers of width 128, 4 heads of 32 channels (so that
# the cache's KV groups of 32 channels cover a head).
PASSKEY_MODEL = lm.LMConfig(
    vocab_size=259,
    num_layers=4,
    embed_dim=128,
    num_heads=4,
    num_kv_heads=4,
    head_dim=32,
    mlp_dim=256,
    max_len=16_384,
    tie_embeddings=True,
)


class QuantSpecLM(lm.Transformer):
    """An ``lhc.lm.Transformer`` whose ``init_cache`` makes a ``QuantSpecCache``.

    Attributes:
        group_size: G of the cache.
        max_call: the most tokens per call (prefill chunks, gamma + 1), at most G.
    """

    group_size: int = 128
    max_call: int = 128

    @nn.nowrap
    def init_cache(self, batch_size: int, max_len: int) -> QuantSpecCache:
        return init_cache(
            self.config, batch_size, max_len, group_size=self.group_size, max_call=self.max_call
        )


def _draft_view(cache: QuantSpecCache) -> QuantSpecCache:
    return cache.draft()


def _target_view(cache: QuantSpecCache) -> QuantSpecCache:
    return cache.target()


def _draft_weights(params):
    # Dequantized once per round into each kernel's own dtype (bfloat16 for a bfloat16
    # model: the layers cast to their compute dtype anyway).
    return dequantize_params(params)


def quantspec_model(model: lm.Transformer, *, group_size: int = 128) -> QuantSpecLM:
    """``model``'s architecture with the QuantSpec cache (same parameters)."""
    config = model.config
    if config.sliding_window is not None:
        raise ValueError("QuantSpec's cache serves full attention; this model has a sliding window")
    return QuantSpecLM(config, group_size=group_size, max_call=group_size)


def _checked(gamma: int, group_size: int) -> None:
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be a positive int, got {gamma!r}")
    if gamma + 1 > group_size:
        raise ValueError(
            f"gamma + 1 = {gamma + 1} tokens are verified in one call, more than the cache's "
            f"headroom of group_size = {group_size} tokens per call; lower gamma or raise "
            f"group_size"
        )


def generate(
    model: lm.Transformer,
    params: Any,
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray | None = None,
    *,
    max_new_tokens: int,
    group_size: int | None = None,
    **kwargs,
) -> lm.GenerateOutput:
    """Plain decoding on the target path: ``lhc.lm.generate`` with the 8-bit QuantSpec
    cache (prefill in chunks of ``group_size``, by default ``default_group_size``).
    ``kwargs`` go to ``lhc.lm.generate``."""
    if group_size is None:
        group_size = default_group_size(model.config)
    target = quantspec_model(model, group_size=group_size)
    kwargs.setdefault("prefill_chunk", group_size)
    return lm.generate(
        target, params, prompts, prompt_lengths, max_new_tokens=max_new_tokens, **kwargs
    )


def default_group_size(config) -> int:
    """The KV cache's G for a model: 128 (the paper's) or the head dim when smaller (the
    values are quantized in groups of G channels, so G divides the head dim)."""
    return min(128, config.head_dim)


# The draft weights' default grid: asymmetric groups of 32 input rows (a scale and a
# minimum per group, llama.cpp's Q4_1 grid). On SmolLM2-135M-Instruct (imported from a
# Q4_1 GGUF) it keeps the draft's greedy acceptance at 1.0 at 1K tokens where symmetric
# groups of 64 (the paper's grid, on other group boundaries) give 0.51 (GPTQ: 0.80):
# experiments/quantspec/README.md.
DEFAULT_WEIGHT_GROUP = 32
DEFAULT_WEIGHT_SYMMETRIC = False


def default_weight_group_size(config, weights: str = "mlp") -> int:
    """The draft weights' group: the largest power of two up to ``DEFAULT_WEIGHT_GROUP``
    that divides the input size of every quantized kernel."""
    sizes = [config.embed_dim, config.mlp_dim]
    if weights == "all":
        sizes.append(config.num_heads * config.head_dim)
    common = math.gcd(*sizes)
    return min(DEFAULT_WEIGHT_GROUP, common & -common)


def speculative_generate(
    model: lm.Transformer,
    params: Any,
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray | None = None,
    *,
    gamma: int = 4,
    max_new_tokens: int,
    group_size: int | None = None,
    weights: str = "mlp",
    weight_group_size: int | None = None,
    weight_symmetric: bool = DEFAULT_WEIGHT_SYMMETRIC,
    draft_params: Any = None,
    draft_kv_bits: int = 4,
    **kwargs,
) -> lm.SpeculativeOutput:
    """Self-speculative decoding: 4-bit KV and 4-bit weights draft, the 8-bit target
    verifies.

    Args:
        model: an ``lhc.lm.Transformer`` with full attention (layers looped or scanned).
        params: its parameters (the target's weights).
        prompts, prompt_lengths: as ``lhc.lm.generate``.
        gamma: drafts per round.
        max_new_tokens: N.
        group_size: the KV cache's G (divides ``head_dim``; ``gamma + 1 <= G``); default
            ``default_group_size(model.config)``.
        weights: the draft's 4-bit layers, ``"mlp"`` (the official code) or ``"all"``.
        weight_group_size: input rows per weight scale; default
            ``default_weight_group_size(model.config, weights)``.
        weight_symmetric: symmetric groups (the paper's GPTQ grid) instead of a scale
            and a minimum per group (the default, ``DEFAULT_WEIGHT_SYMMETRIC``).
        draft_params: the draft's weights as ``quantize_params`` or ``gptq_calibrate``
            make them (made from ``params`` when None; ``params`` itself for a draft
            with full weights).
        draft_kv_bits: the cache as the draft reads it: 4 (QuantSpec) or 8 (the
            target's reading: a draft that differs in its weights only).
        **kwargs: ``sampling``, ``rng``, ``stop_tokens``, ``pad_id``, ``verifier``,
            ``mesh``, ``rules`` of ``lhc.lm.speculative_generate``.

    Returns:
        An ``lhc.lm.SpeculativeOutput`` (tokens, lengths, rounds, accepted and drafted
        counts; ``acceptance_rate``).

    Raises:
        ValueError: ``gamma + 1 > group_size``, a group size that does not divide the
            head or the weights' input sizes, and ``lhc.lm.speculative_generate``'s errors.
    """
    if group_size is None:
        group_size = default_group_size(model.config)
    _checked(gamma, group_size)
    if draft_kv_bits not in (4, 8):
        raise ValueError(f"draft_kv_bits must be 4 or 8, got {draft_kv_bits!r}")
    target = quantspec_model(model, group_size=group_size)
    if draft_params is None:
        if weight_group_size is None:
            weight_group_size = default_weight_group_size(model.config, weights)
        try:
            draft_params = quantize_params(
                params, group_size=weight_group_size, layers=weights, symmetric=weight_symmetric
            )
        except ValueError as error:
            raise ValueError(f"weight_group_size={weight_group_size!r}: {error}") from None
    drafter = lm.SelfDrafter(
        target,
        draft_view=_draft_view if draft_kv_bits == 4 else None,
        target_view=_target_view if draft_kv_bits == 4 else None,
        prepare_params=_draft_weights,
    )
    kwargs.setdefault("prefill_chunk", group_size)
    return lm.speculative_generate(
        target,
        params,
        drafter,
        draft_params,
        prompts,
        prompt_lengths,
        max_new_tokens=max_new_tokens,
        num_draft=gamma,
        **kwargs,
    )
