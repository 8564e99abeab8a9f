"""Drafters for ``lhc.lm.speculative``: what proposes the tokens a verifier checks.

* ``ModelDrafter(model)``: a second causal LM with its own cache.
* ``SelfDrafter(model)``: the target's architecture drafting in the target's own cache.

A drafter has ``prefill`` (its state after the prompts), ``propose`` (a ``DraftProposal``
each round) and ``commit`` (the state after the verifier kept a prefix);
``speculative_generate`` calls them. A drafter whose class sets ``in_target_cache =
True`` drafts in the target's cache and is fed at the target's positions; any other
reads its own prompts from position 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from lhc.lm.decoding import prefill_chunks
from lhc.lm.rules import empty_cache
from lhc.lm.sampling import logits_to_probs


@struct.dataclass
class DraftProposal:
    """What a drafter proposes in one round.

    Attributes:
        tokens: int32 ``[B, G]`` drafts.
        probs: float32 ``[B, G, V]`` the distributions they were drawn from.
        state: the drafter's state after proposing.
        target_cache: the target's cache, as the verification pass must find it (a
            self-drafter returns it rewound to where the round began).
    """

    tokens: jax.Array
    probs: jax.Array
    state: Any
    target_cache: Any


def _draft_steps(apply, cache, pending, position, keys, sampling):
    """Samples ``len(keys)`` tokens one at a time after ``pending`` at ``position``
    (``-1``: a finished sequence feeds padding). Feeds pending, d_1, .., d_{G-1}."""

    def step(carry, key):
        token, position, cache = carry
        logits, cache = apply(token[:, None], position[:, None], cache)
        probs = logits_to_probs(logits[:, -1], sampling)
        proposal = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
        next_position = jnp.where(position < 0, -1, position + 1)
        return (proposal, next_position, cache), (proposal, probs)

    (last, last_position, cache), (proposals, probs) = jax.lax.scan(
        step, (pending, position, cache), keys
    )
    return proposals.T, jnp.swapaxes(probs, 0, 1), cache, last, last_position


@struct.dataclass
class ModelDraftState:
    """A ``ModelDrafter``'s state: its cache and, while a round is open, where it began
    (``start_lengths``, truncating drafters) or the cache it began from (the cache itself,
    re-feeding drafters)."""

    cache: Any
    start_lengths: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A separate causal LM with its own cache.

    Attributes:
        model: the draft model (same vocabulary as the target).
        refeed: roll back by feeding the accepted tokens, as one block, to the cache the
            round started from, instead of truncating: for caches without slots
            (``capacity`` None, e.g. a recurrent state) that truncate only within their
            last append.
    """

    model: nn.Module
    refeed: bool = False

    @property
    def config(self):
        return self.model.config

    def prefill(self, params, tokens, positions, target_cache, *, cache_len, prefill_chunk):
        """The draft cache after the prompt ``tokens [B, P]`` (all but the pending token)."""
        del target_cache
        cache = empty_cache(self.model, tokens.shape[0], cache_len)
        if self.refeed and cache.capacity is not None:
            raise ValueError(
                "ModelDrafter(refeed=True) feeds every round's block, rejected tokens as "
                f"padding, which would fill a cache of {cache.capacity} slots; use it with "
                "caches without slots (capacity None)"
            )
        if tokens.shape[1]:
            _, cache = prefill_chunks(
                self.model, params, tokens, positions, cache, chunk_size=prefill_chunk
            )
        return ModelDraftState(cache=cache)

    def propose(self, params, state, target_cache, pending, position, keys, sampling):
        apply = functools.partial(self.model.apply, {"params": params})
        drafts, probs, cache, last, last_position = _draft_steps(
            apply, state.cache, pending, position, keys, sampling
        )
        if self.refeed:
            state = ModelDraftState(cache=state.cache)  # drafted states are dropped
        else:
            # d_G too, so that the cache holds it when every draft is accepted.
            _, cache = apply(last[:, None], last_position[:, None], cache)
            state = ModelDraftState(cache=cache, start_lengths=state.cache.lengths)
        return DraftProposal(drafts, probs, state, target_cache)

    def commit(self, params, state, block, block_positions, kept):
        """Keeps the first ``kept[b]`` tokens of ``block [B, G + 1]`` (pending and drafts)."""
        if not self.refeed:
            return ModelDraftState(cache=state.cache.truncate(state.start_lengths + kept))
        columns = jnp.arange(block.shape[1])[None, :]
        positions = jnp.where(columns < kept[:, None], block_positions, -1)
        _, cache = self.model.apply({"params": params}, block, positions, state.cache)
        return ModelDraftState(cache=cache)


@dataclasses.dataclass(frozen=True)
class SelfDrafter:
    """Drafts in the target's own cache with the target's architecture.

    The drafts' keys and values are written into the target's cache, which is then
    rewound; the verification pass overwrites them. The draft parameters may be the
    target's or others for the same architecture (e.g. quantized weights).

    Attributes:
        model: a module of the target's architecture.
        draft_view: ``cache -> cache``, the view of the target's cache the drafts read
            and write (a lower-precision reading of the same store, for QuantSpec), and
            ``target_view`` its inverse; None for the cache itself.
        target_view: see ``draft_view``.
        prepare_params: ``draft_params -> params`` applied inside the jitted round (for
            example weights unpacked from 4-bit codes on the fly); None to use them as
            they are.

    The callables are part of the compiled loop's static arguments: pass functions
    defined once (module-level), not new lambdas per call, or every call recompiles.
    """

    model: nn.Module
    draft_view: Any = None
    target_view: Any = None
    prepare_params: Any = None

    in_target_cache = True  # fed at the target's positions (a class attribute)

    @property
    def config(self):
        return self.model.config

    def prefill(self, params, tokens, positions, target_cache, *, cache_len, prefill_chunk):
        del params, tokens, positions, target_cache, cache_len, prefill_chunk
        return None

    def propose(self, params, state, target_cache, pending, position, keys, sampling):
        if self.prepare_params is not None:
            params = self.prepare_params(params)
        apply = functools.partial(self.model.apply, {"params": params})
        start = target_cache.lengths
        cache = target_cache if self.draft_view is None else self.draft_view(target_cache)
        drafts, probs, cache, _, _ = _draft_steps(apply, cache, pending, position, keys, sampling)
        cache = cache.truncate(start)
        if self.target_view is not None:
            cache = self.target_view(cache)
        return DraftProposal(drafts, probs, state, cache)

    def commit(self, params, state, block, block_positions, kept):
        del params, block, block_positions, kept
        return state


# The loop -------------------------------------------------------------------------------
