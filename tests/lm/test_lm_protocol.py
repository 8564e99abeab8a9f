"""The causal-LM protocol pinned by a model that is not the Transformer.

``TinyRecurrentLM`` is a gated recurrence with a state cache written here, against the
protocol of ``lhc.lm.cache`` alone: position -1 leaves the state unchanged, truncation
keeps the per-token states of the last append. ``generate`` and the speculative decoder
run it, and their outputs equal step-by-step recomputation without a cache.
"""

from types import SimpleNamespace
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.sharding import PartitionSpec

from lhc import lm
from lhc.lm.cache import Cache, check_cache
from lhc.lm.speculative import ModelDrafter, speculative_generate

VOCAB, WIDTH, HISTORY = 48, 24, 8


@struct.dataclass
class StateCache:
    """The recurrent state, and the states of the last append for truncation.

    Attributes:
        history: float32 ``[B, A + 1, D]``: ``history[:, k]`` is the state ``last - k``
            tokens back (``k = 0``: now), for ``k <= last``.
        history_positions: int32 ``[B, A]``: positions of the last append's tokens, the
            most recent first.
        last: int32 ``[B]``, how many tokens back truncation may go (at most ``A``).
        lengths: int32 ``[B]``, tokens appended.
        top: int32 ``[B]``, the largest position held (-1 if none).
        top_before: int32 ``[B]``, the largest position before the last append.
        intact: bool ``[B]``, false after truncating further back than ``last``.
    """

    history: jax.Array
    history_positions: jax.Array
    last: jax.Array
    lengths: jax.Array
    top: jax.Array
    top_before: jax.Array
    intact: jax.Array

    @property
    def state(self) -> jax.Array:
        return self.history[:, 0]

    @property
    def capacity(self) -> None:
        return None

    def truncate(self, new_lengths):
        new_lengths = jnp.broadcast_to(jnp.asarray(new_lengths, jnp.int32), self.lengths.shape)
        back = self.lengths - new_lengths
        rows = jnp.arange(self.lengths.shape[0])
        state = self.history[rows, jnp.clip(back, 0, HISTORY)]
        # Positions of the tokens kept from the last append bound the new top.
        kept = jnp.arange(HISTORY)[None, :] >= back[:, None]
        kept_top = jnp.max(jnp.where(kept, self.history_positions, -1), axis=1)
        top = jnp.where(back > 0, jnp.maximum(self.top_before, kept_top), self.top)
        return StateCache(
            history=jnp.zeros_like(self.history).at[:, 0].set(state),
            history_positions=jnp.full_like(self.history_positions, -1),
            last=jnp.zeros_like(self.last),
            lengths=new_lengths,
            top=top,
            top_before=top,
            intact=self.intact & (back >= 0) & (back <= self.last),
        )

    def truncate_at_position(self, positions):
        positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), self.lengths.shape)
        in_last = jnp.arange(HISTORY)[None, :] < self.last[:, None]
        drop = jnp.sum(in_last & (self.history_positions >= positions[:, None]), axis=1)
        return self.truncate(self.lengths - drop)

    def next_positions(self):
        return self.top + 1

    def can_append(self, num_tokens):
        del num_tokens
        return self.intact

    def validate_append(self, batch_size, num_tokens):
        if self.lengths.shape != (batch_size,):
            raise ValueError(f"cache holds {self.lengths.shape[0]} sequences, call {batch_size}")

    def logical_axes(self):
        batch = PartitionSpec("cache_batch")
        return StateCache(
            history=PartitionSpec("cache_batch", None, None),
            history_positions=PartitionSpec("cache_batch", None),
            last=batch,
            lengths=batch,
            top=batch,
            top_before=batch,
            intact=batch,
        )


class TinyRecurrentLM(nn.Module):
    """``h_t = a_t h_{t-1} + (1 - a_t) u_t`` with input-dependent gates; logits from h_t."""

    config: Any

    @nn.nowrap
    def init_cache(self, batch_size: int, max_len: int) -> StateCache:
        del max_len
        return StateCache(
            history=jnp.zeros((batch_size, HISTORY + 1, WIDTH), jnp.float32),
            history_positions=jnp.full((batch_size, HISTORY), -1, jnp.int32),
            last=jnp.zeros((batch_size,), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            top=jnp.full((batch_size,), -1, jnp.int32),
            top_before=jnp.full((batch_size,), -1, jnp.int32),
            intact=jnp.ones((batch_size,), bool),
        )

    @nn.compact
    def __call__(self, tokens, positions, cache=None, *, last_only=False):
        batch, length = tokens.shape
        x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
        gate = nn.sigmoid(nn.Dense(WIDTH, name="gate")(x))
        update = jnp.tanh(nn.Dense(WIDTH, name="update")(x))
        real = (positions >= 0)[..., None]
        start = jnp.zeros((batch, WIDTH)) if cache is None else cache.state

        def step(h, inputs):
            a, u, keep = inputs
            h = jnp.where(keep, a * h + (1 - a) * u, h)  # padding leaves the state as it is
            return h, h

        time_major = lambda v: jnp.swapaxes(v, 0, 1)
        _, states = jax.lax.scan(
            step, start, (time_major(gate), time_major(update), time_major(real))
        )
        states = time_major(states)  # [B, T, D]
        out = states[:, -1:] if last_only else states
        logits = nn.Dense(VOCAB, name="head")(jnp.tanh(out) * 3.0)
        if cache is None:
            return logits, None
        # History: the newest states first, then the older history, A + 1 of them.
        newest_first = jnp.concatenate([states[:, ::-1], cache.history], axis=1)[:, : HISTORY + 1]
        positions_first = jnp.concatenate(
            [positions[:, ::-1], jnp.full((batch, HISTORY), -1, jnp.int32)], axis=1
        )[:, :HISTORY]
        new_cache = StateCache(
            history=newest_first,
            history_positions=positions_first,
            last=jnp.full((batch,), min(length, HISTORY), jnp.int32),
            lengths=cache.lengths + length,
            top=jnp.maximum(cache.top, jnp.max(positions, axis=1)),
            top_before=cache.top,
            intact=cache.intact,
        )
        logits = jnp.where(cache.intact[:, None, None], logits, jnp.nan)
        return logits, new_cache


class _Config:
    vocab_size = VOCAB
    max_len = 256


MODEL = TinyRecurrentLM(_Config())
PROMPTS = [[3, 9, 27, 17, 5, 25], [5], [40, 1, 2, 7], [11, 13]]


def _params(seed, scale=1.0):
    tokens = jnp.zeros((1, 1), jnp.int32)
    params = MODEL.init(jax.random.key(seed), tokens, tokens)["params"]
    return jax.tree.map(lambda x: x * scale, params)


@jax.jit
def _full_logits(params, tokens, positions):
    return MODEL.apply({"params": params}, tokens, positions)[0]


def _greedy_by_recomputation(params, prompts, steps):
    sequences = [list(p) for p in prompts]
    for _ in range(steps):
        width = 32
        tokens = np.zeros((len(sequences), width), np.int32)
        positions = np.full((len(sequences), width), -1, np.int32)
        for b, seq in enumerate(sequences):  # left-padded
            tokens[b, width - len(seq) :] = seq
            positions[b, width - len(seq) :] = np.arange(len(seq))
        logits = np.asarray(_full_logits(params, tokens, positions))[:, -1]
        for b, token in enumerate(logits.argmax(-1)):
            sequences[b].append(int(token))
    return np.array([s[len(p) :] for s, p in zip(sequences, prompts)])


def test_generate_refuses_a_cache_without_the_protocol():
    cache = MODEL.init_cache(len(PROMPTS), 32)
    assert isinstance(cache, Cache) and not isinstance(cache, lm.KVCache)
    check_cache(cache)
    broken = SimpleNamespace(lengths=cache.lengths, next_positions=cache.next_positions)
    missing = "can_append, capacity, logical_axes, truncate, truncate_at_position, validate_append"
    with pytest.raises(ValueError, match=f"^cache: .* got a SimpleNamespace without {missing}$"):
        lm.generate(MODEL, _params(0), PROMPTS, max_new_tokens=2, cache=broken)


def test_generate_on_a_recurrent_model_equals_recomputation():
    params = _params(0)
    out = lm.generate(MODEL, params, PROMPTS, max_new_tokens=10, prefill_chunk=3)
    want = _greedy_by_recomputation(params, PROMPTS, 10)
    np.testing.assert_array_equal(out.tokens, want)
    assert len(np.unique(want)) > 5
    np.testing.assert_array_equal(out.next_positions, [len(p) + 9 for p in PROMPTS])


def test_truncation_within_the_last_append_equals_recomputation():
    params = _params(1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    apply = jax.jit(lambda t, p, c: MODEL.apply({"params": params}, t, p, c))
    _, cache = apply(tokens[:, :4], positions[:, :4], MODEL.init_cache(2, 9))
    _, cache = apply(tokens[:, 4:9], positions[:, 4:9], cache)
    # Back to 6 tokens (within the last append of 5), then two other tokens.
    other = jnp.array([[1, 2], [3, 4]], jnp.int32)
    logits, _ = apply(other, positions[:, 6:8], cache.truncate(6))
    sequence = jnp.concatenate([tokens[:, :6], other], axis=1)
    np.testing.assert_allclose(
        logits, _full_logits(params, sequence, positions[:, :8])[:, 6:], atol=1e-5
    )
    cut = cache.truncate_at_position(jnp.array([7, 5]))
    np.testing.assert_array_equal(cut.lengths, [7, 5])
    # Further back than the last append: the state is gone, and the logits say so.
    logits, _ = apply(other, positions[:, 2:4], cache.truncate(2))
    assert np.isnan(np.asarray(logits)).all()


def test_speculative_decoding_of_a_recurrent_target_equals_its_greedy_decoding():
    """The target truncates within its verification append; the recurrent drafter rolls
    back by re-feeding what was accepted."""
    params = _params(0)
    drafter = ModelDrafter(MODEL, refeed=True)
    noise = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(5), x.shape), params)
    out = speculative_generate(
        MODEL, params, drafter, noise, PROMPTS, max_new_tokens=10, num_draft=3
    )
    np.testing.assert_array_equal(out.tokens, _greedy_by_recomputation(params, PROMPTS, 10))
    assert 0.0 < float(out.acceptance_rate) < 1.0
