"""What the recurrent LMs share: the config fields every one has (``RecurrentLMConfig``)
and the module around their layers (``RecurrentLM``: the cache, embedding, the layers
with their states in ``RecurrentCache``, final norm, output head).

A layer is called as ``layer(x, real, states, tail)`` with ``states`` a tuple of its
current states in ``state_names`` order (None without a cache) and returns ``(x,
head_end, tail_states)``: the states after all but the call's last ``tail`` tokens and
the states after each of those (``[B, tail, ...]`` each, oldest first; None when
``tail`` is 0), as tuples in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from lhc.nn import Embed, RMSNorm, output_logits
from lhc.nn.ring_attention import refuse_sequence_axis
from lhc.recurrent.cache import RecurrentCache, layer_history
from lhc.recurrent.config import RecurrentLMConfig


class RecurrentLM(nn.Module):
    """``logits, cache = model.apply(variables, tokens, positions, cache)`` (the causal-LM
    protocol); ``cache=None`` for a plain forward pass.

    A subclass names its layer (``layer``, called as ``layer(config, name=...)``) and the
    shapes and dtypes of each layer's states (``state_specs``).
    """

    config: RecurrentLMConfig
    layer: ClassVar[type[nn.Module]]

    @nn.nowrap
    def state_specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """``{name: (per-sequence shape, dtype)}`` of one layer's states, in the order the
        layer takes them (``@nn.nowrap`` in a subclass too)."""
        raise NotImplementedError

    @nn.nowrap
    def init_cache(
        self, batch_size: int, max_len: int | None = None, *, rollback: int | None = None
    ) -> RecurrentCache:
        """Zero states. ``rollback`` (default ``config.rollback``) sets how many of a
        call's last tokens truncation can undo; 0 keeps only the current states (a
        training-time cache carrying states between batches)."""
        del max_len  # the state does not grow
        specs = self.state_specs()
        return RecurrentCache.create(
            {name: shape for name, (shape, _) in specs.items()},
            num_layers=self.config.num_layers,
            batch_size=batch_size,
            rollback=self.config.rollback if rollback is None else rollback,
            dtypes={name: dtype for name, (_, dtype) in specs.items()},
        )

    @nn.compact
    def __call__(self, tokens, positions, cache: RecurrentCache | None = None, *, last_only=False):
        # The state runs along the tokens (a ring passing chunk states is not built).
        refuse_sequence_axis(type(self).__name__)
        return recurrent_lm_forward(
            self.config,
            tokens,
            positions,
            cache,
            last_only=last_only,
            state_names=tuple(self.state_specs()),
            make_layer=lambda i: self.layer(self.config, name=f"layer_{i}"),
        )


def recurrent_lm_forward(
    config,
    tokens,
    positions,
    cache: RecurrentCache | None,
    *,
    last_only: bool,
    state_names: Sequence[str],
    make_layer: Callable[[int], Callable],
):
    """The causal-LM protocol's ``logits, cache`` for a stack of recurrent layers.

    Called from a linen module's compact ``__call__`` (the submodules it makes belong to
    that module). ``config`` is a ``RecurrentLMConfig``; ``make_layer(i)`` makes layer
    ``i``.
    Padding (position -1) is passed to the layers as ``real`` false; a broken cache
    (truncated past its rollback) gives NaN logits for that sequence.
    """
    c = config
    if jnp.ndim(tokens) != 2 or jnp.shape(positions) != jnp.shape(tokens):
        raise ValueError(
            f"tokens and positions must both be [B, T], got {jnp.shape(tokens)} and "
            f"{jnp.shape(positions)}"
        )
    batch, t = tokens.shape
    if cache is not None:
        cache.validate_append(batch, t)
    embed = Embed(c.vocab_size, c.embed_dim, dtype=c.dtype, param_dtype=c.param_dtype, name="embed")
    x = embed.encode(tokens)
    real = positions >= 0
    tail = 0 if cache is None else min(cache.rollback, t)
    history = {name: [] for name in state_names}
    for layer in range(c.num_layers):
        states = None
        if cache is not None:
            states = tuple(cache.now(name, layer) for name in state_names)
        x, head_end, tail_states = make_layer(layer)(x, real, states, tail)
        if cache is not None:
            for i, name in enumerate(state_names):
                tail_i = None if tail_states is None else tail_states[i]
                old = cache.states[name][layer]
                history[name].append(layer_history(old, head_end[i], tail_i, cache.rollback))
    x = RMSNorm(epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name="final_norm")(x)
    if last_only:
        x = x[:, -1:]
    logits = output_logits(embed, x, tie=c.tie_embeddings)
    if cache is None:
        return logits, None
    new_cache = cache.appended({name: jnp.stack(h) for name, h in history.items()}, positions, tail)
    logits = jnp.where(cache.intact[:, None, None], logits, jnp.nan)
    return logits, new_cache
