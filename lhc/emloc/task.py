"""EMLoC's training task: a decoder (``PatchLM``: bytes and image patches) learns
many-shot classification on generated episodes (``lhc.emloc.manyshot``), so that its
demonstrations can then be compressed."""

from __future__ import annotations

import jax.numpy as jnp

from lhc.data.iterators import row_rngs, stack_rows
from lhc.emloc.manyshot import ManyShot, training_row
from lhc.train.causal_lm import CausalLMTask


class ManyShotTask(CausalLMTask):
    """Config keys: ``model`` (``lhc.lm.LMConfig`` fields; ``scan_layers=False`` so that
    EMLoC can compress with the trained model), ``data`` (``name``, ``shots``:
    demonstrations per training sequence, and the fields of ``ManyShot``), with those
    of ``CausalLMTask``."""

    def _model_factory_path(self) -> str:
        return "lhc.emloc.manyshot:PatchLM"

    def manyshot(self) -> ManyShot:
        fields = dict(self.config.data)
        for key in ("name", "shots", "min_shots"):
            fields.pop(key, None)
        return ManyShot(**fields)

    def _make_batch(self, seed, index, rows):
        task, shots = self.manyshot(), int(self.config.data.shots)
        min_shots = self.config.data.get("min_shots")
        make = lambda rng: training_row(rng, task, shots, min_shots)
        return stack_rows(make, row_rngs(seed, index, rows))

    def init_params(self, rng):
        spec = self.batch_spec(1)
        tokens = jnp.zeros(spec["tokens"].shape, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        features = jnp.zeros(spec["features"].shape, jnp.float32)
        return self.model.init(rng, tokens, positions, features=features)["params"]

    def _logits(self, params, batch, rng=None):
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, _ = self.model.apply(
            {"params": params}, tokens, positions, features=batch["features"]
        )
        return logits
