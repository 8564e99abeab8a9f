"""The icl package's training tasks, each a ``CausalLMTask`` on generated prompts:

* ``PretrainTask``: in-context classification for Iterative Vectors, every prompt a
  new task (``lhc.icl.classification``; ``configs/icl_classification.py``);
* ``SuperpositionTask``: task superposition from scratch, every prompt one task of a
  kind (``lhc.icl.superposition``; ``configs/icl_superposition.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lhc.data.iterators import row_rngs, stack_rows
from lhc.icl import classification, superposition
from lhc.parallel import batch_share, global_batch
from lhc.train.causal_lm import CausalLMTask


class PretrainTask(CausalLMTask):
    """Config keys: ``data`` (``max_classes``, ``max_shots``, ``width``, ``keywords``,
    ``input_length``, ``noise``, optional ``stages``), ``model``, with those of
    ``CausalLMTask``.

    ``stages`` is a curriculum: a list of dicts, each ``steps`` (how many training steps
    it lasts) and the data keys it changes (``separator``, ``max_classes``,
    ``max_shots``, ...); after the last stage, and for evaluation, the prompts are those
    of the data keys themselves. Batch ``i`` is drawn with the settings of step ``i``,
    so a resumed run continues the curriculum where it stopped.

    Evaluation adds ``eval/query_accuracy``, how often the query's first label token is
    the most likely next token (the in-context classification itself; the other label
    tokens mostly follow from the first), and ``eval/query_chance``, the mean over
    prompts of one over the number of classes shown.
    """

    def _data(self, step: int | None) -> dict:
        """``classification.training_row``'s keyword arguments at training step ``step``
        (None: after the curriculum)."""
        data = dict(self.config.data)
        data.pop("name", None)
        allowed = (set(data) | {"separator"}) - {"width", "stages"}
        end, found = 0, None
        for stage in data.pop("stages", None) or ():
            stage = dict(stage)
            steps = int(stage.pop("steps", 0))
            if steps <= 0 or set(stage) - allowed:
                raise ValueError(
                    f"config.data.stages: each stage needs steps > 0 and only keys among "
                    f"{sorted(allowed)}, got {dict(stage, steps=steps)}"
                )
            end += steps
            if found is None and step is not None and step < end:
                found = stage
        return {**data, **(found or {})}

    def _make_batch(self, seed, index, rows):
        data = self._data(index)
        return stack_rows(
            lambda rng: classification.training_row(rng, **data), row_rngs(seed, index, rows)
        )

    def _make_eval_batch(self, seed, index, rows):
        data = self._data(None)
        return stack_rows(
            lambda rng: classification.training_row(rng, **data), row_rngs(seed, index, rows)
        )

    def evaluate(self, params):
        metrics = super().evaluate(params)
        iterator = self._eval_iterator(*batch_share(self.mesh, self.rules))

        def counts(params, batch):
            rows = jnp.arange(batch["query"].shape[0])
            logits = self._logits(params, batch)[rows, batch["query"]]
            hit = jnp.argmax(logits, axis=-1) == batch["targets"][rows, batch["query"]]
            return hit.sum(), (1.0 / batch["classes"]).sum(), rows.size

        counts = jax.jit(counts)
        totals = np.zeros(3)
        for _ in range(int(self.config.eval_batches)):
            batch = next(iterator)
            batch["query"], batch["classes"] = classification.query_targets(
                batch["targets"], batch["weights"]
            )
            totals += np.array(
                jax.device_get(counts(params, global_batch(batch, self.mesh, self.rules))), float
            )
        metrics["eval/query_accuracy"] = totals[0] / totals[2]
        metrics["eval/query_chance"] = totals[1] / totals[2]
        return metrics


class SuperpositionTask(CausalLMTask):
    """Config keys: ``data`` (``kind``, ``demos``), ``model`` (``lhc.lm.LMConfig``
    fields), with those of ``CausalLMTask``."""

    def scratch_task(self) -> superposition.ScratchTask:
        return superposition.ScratchTask(
            kind=str(self.config.data.kind), demos=int(self.config.data.demos)
        )

    def _make_batch(self, seed, index, rows):
        task = self.scratch_task()
        return stack_rows(
            lambda rng: superposition.training_row(rng, task), row_rngs(seed, index, rows)
        )
