"""What RAPID holds in accelerator memory: both models' weights, the target's cache of
the long context, the drafter's cache of the RAG prompt, and the largest transients.

An analytic count (no compilation): weights are ``count_params`` times the parameter
width; a cache slot holds keys and values of every layer (``2 L H_kv d_head`` numbers);
a verification round keeps ``[B, gamma + 1, V]`` float32 target logits and probabilities
(p and p_hat) and ``[B, gamma, V]`` draft probabilities. Prefill with the ``"xla"``
attention implementation materialises one layer's ``[B, heads, chunk, cache slots]``
float32 scores at a time; ``"chunked"`` and ``"flash"`` keep only blocks of them, which
are not counted.
"""

from __future__ import annotations

from lhc.lm.config import LMConfig
from lhc.lm.costs import decode_bytes_per_token


def _sizes(config: LMConfig) -> tuple[float, float]:
    """``(weight bytes, cache bytes per token)`` of one sequence."""
    sizes = decode_bytes_per_token(config, 1)
    return sizes["weight_bytes"], sizes["kv_cache_bytes_per_sequence"]


def memory_estimate(
    target: LMConfig,
    draft: LMConfig | None = None,
    *,
    context_len: int,
    rag_len: int,
    new_tokens: int,
    gamma: int = 10,
    batch_size: int = 1,
    prefill_chunk: int = 2048,
    attention_impl: str = "xla",
) -> dict[str, float]:
    """Bytes of each part of a RAPID run (``draft=None``: self-speculation, the drafter
    shares the target's weights but keeps its own cache).

    Returns:
        ``target_weights``, ``draft_weights``, ``target_cache``, ``draft_cache``,
        ``round_buffers``, ``prefill_scores`` (``"xla"`` attention only; see the module
        docstring)
        and ``total`` (their sum).
    """
    draft_config = target if draft is None else draft
    extra = new_tokens + gamma + 1
    target_slots = context_len + extra
    draft_slots = rag_len + extra
    vocab = target.vocab_size
    target_weights, target_slot = _sizes(target)
    draft_weights, draft_slot = _sizes(draft_config)
    parts = dict(
        target_weights=target_weights,
        draft_weights=0 if draft is None else draft_weights,
        target_cache=batch_size * target_slots * target_slot,
        draft_cache=batch_size * draft_slots * draft_slot,
        round_buffers=4 * batch_size * vocab * (3 * (gamma + 1) + gamma),
        prefill_scores=4
        * batch_size
        * target.num_heads
        * min(prefill_chunk, context_len)
        * target_slots
        if attention_impl == "xla"
        else 0,
    )
    parts = {name: float(value) for name, value in parts.items()}
    parts["total"] = sum(parts.values())
    return parts
