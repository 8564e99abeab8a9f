"""Tasks and model factories that ``tests/train/test_tasks.py`` names by import path.

Not a test module (pytest does not collect it); the tests put this directory on
``sys.path`` and refer to ``_task_fixtures:<name>``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from lhc.train import causal_lm

# The parameter names of RunningMeanLM, which no lhc.lm.Transformer has.
RUNNING_MEAN_PARAMS = ("token_embed", "mix", "readout")


class PathOnlyTask(causal_lm.CausalLMTask):
    """A Task subclass that no ``register_task`` names: reachable only by its path."""


class NotATask:
    """A class that is not a ``lhc.train.Task``."""


NOT_CALLABLE = 3


class RunningMeanLM(nn.Module):
    """A causal LM without attention: each position sees the mean of its prefix.

    ``h_t = tanh([x_t, mean(x_1..x_t)] W)``, logits ``= h_t R``, where ``x`` are token
    embeddings and padded positions (-1) are left out of the mean. It follows the
    causal-LM protocol without being an ``lhc.lm.Transformer``.

    Attributes:
      vocab_size: V.
      embed_dim: D.
    """

    vocab_size: int
    embed_dim: int

    @nn.compact
    def __call__(self, tokens, positions, cache=None):
        """Logits of the next token.

        Args:
          tokens: int32[B, T].
          positions: int32[B, T]; -1 marks padding.
          cache: must be None (the model keeps no decoding state).

        Returns:
          ``(logits, None)`` with ``logits: float32[B, T, V]``.
        """
        if cache is not None:
            raise ValueError("RunningMeanLM keeps no cache; call it with cache=None")
        init = nn.initializers.normal(0.1)
        embed = self.param(
            "token_embed",
            nn.with_logical_partitioning(init, ("vocab", "embed")),
            (self.vocab_size, self.embed_dim),
        )
        mix = self.param(
            "mix",
            nn.with_logical_partitioning(init, (None, "embed", "mlp")),
            (2, self.embed_dim, self.embed_dim),
        )
        readout = self.param(
            "readout",
            nn.with_logical_partitioning(init, ("mlp", "vocab")),
            (self.embed_dim, self.vocab_size),
        )
        x = jnp.take(embed, tokens, axis=0)  # BTD
        valid = (positions >= 0)[..., None].astype(x.dtype)
        prefix_mean = jnp.cumsum(x * valid, axis=1) / jnp.maximum(jnp.cumsum(valid, axis=1), 1)
        hidden = jnp.tanh(
            jnp.einsum("BTD,DE->BTE", x, mix[0]) + jnp.einsum("BTD,DE->BTE", prefix_mean, mix[1])
        )
        logits = jnp.einsum("BTE,EV->BTV", hidden, readout)
        return logits.astype(jnp.float32), None


class LogitsOnlyLM(nn.Module):
    """Breaks the protocol: returns bare logits instead of ``(logits, cache)``."""

    vocab_size: int

    @nn.compact
    def __call__(self, tokens, positions, cache=None):
        return nn.Embed(self.vocab_size, self.vocab_size)(tokens)


def running_mean_lm(model_config) -> RunningMeanLM:
    """Model factory: ``RunningMeanLM`` from ``config.model`` (vocab_size, embed_dim)."""
    return RunningMeanLM(
        vocab_size=int(model_config.vocab_size), embed_dim=int(model_config.embed_dim)
    )


def logits_only_lm(model_config) -> LogitsOnlyLM:
    """Model factory of a module that does not follow the causal-LM protocol."""
    return LogitsOnlyLM(vocab_size=int(model_config.vocab_size))


def not_a_module(model_config) -> dict:
    """Model factory that wrongly returns the config instead of a linen module."""
    return dict(model_config)


def module_class(model_config) -> type[nn.Module]:
    """Model factory that wrongly returns a module class instead of an instance."""
    return RunningMeanLM


class CarryingTask(causal_lm.CausalLMTask):
    """Carries from step to step, per row, the sum of the tokens trained on so far (a
    batch-sharded carry) and the number of steps, and reports both as metrics."""

    def init_carry(self, batch_size):
        sums = nn.LogicallyPartitioned(jnp.zeros((batch_size,), jnp.float32), ("cache_batch",))
        return {"token_sums": sums, "steps": jnp.zeros((), jnp.int32)}

    def carried_loss(self, params, batch, rng, carry):
        loss, metrics = self.loss(params, batch, rng)
        sums = carry["token_sums"] + batch["tokens"].sum(axis=1)
        steps = carry["steps"] + 1
        metrics = dict(metrics, carried_total=sums.sum(), carried_steps=steps)
        return loss, (metrics, {"token_sums": sums, "steps": steps})
