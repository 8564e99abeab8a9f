"""Passkey retrieval as a training task for any causal LM, with a length x depth evaluation.

``config.task = "passkey"``; the model comes from ``config.model_factory`` as in the
causal-LM task (a GCA, recurrent or dense ``lhc.lm`` model). Training sequences are
``lhc.data.passkey`` examples of ``config.data.length`` byte tokens
(``lhc.lm.ByteTokenizer``, ids 0-258) with the needle at a uniform depth; the loss
counts the answer digits, plus ``config.data.lm_loss_weight`` (default 0) times the
next-token loss over the whole sequence (filler, needle and question too: a language
modelling signal on every token, from which copying is learnt long before the sparse
answer loss alone teaches it). ``evaluate`` reports the loss and digit accuracy on held-out
batches of the training length and, when ``config.passkey_eval.lengths`` is not empty,
the passkey accuracy over ``lengths`` x ``depths`` (``lhc.lm.passkey_eval``), with a markdown
table and a heat map written to ``config.passkey_eval.output_dir`` when that is set.

With ``config.data.min_length`` each sequence has its own length, uniform in
[``min_length``, ``length``], and is right-padded to ``length`` (padding weighs nothing in
either loss: ``lm_weights`` marks the real tokens). A model trained on one length only
learns where the question sits at that length and may fail on shorter prompts.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from lhc.data.iterators import row_rngs, stack_rows
from lhc.data.passkey import Filler, passkey_batch
from lhc.lm.passkey_eval import passkey_accuracy
from lhc.lm.tokenizers import ByteTokenizer
from lhc.train.causal_lm import CausalLMTask, weighted_cross_entropy
from lhc.train.tasks import register_task


def right_pad(row: dict[str, np.ndarray], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """A ``[1, n]`` row of tokens / targets / weights right-padded to ``length``, with
    ``lm_weights`` marking its n real positions (padding weighs nothing in either loss)."""
    pad = length - row["tokens"].shape[1]
    fill = lambda x, value: np.pad(x, ((0, 0), (0, pad)), constant_values=value)
    return {
        "tokens": fill(row["tokens"], pad_id),
        "targets": fill(row["targets"], pad_id),
        "weights": fill(row["weights"], 0.0),
        "lm_weights": fill(np.ones_like(row["weights"]), 0.0),
    }


@register_task("passkey")
class PasskeyTask(CausalLMTask):
    """Config keys: those of ``CausalLMTask`` with ``data`` = ``length`` (tokens per
    training sequence), ``min_length`` (optional: lengths vary from it up to
    ``length``), ``filler_paths`` (``None`` for the generated filler, or a list of
    text files), ``digits``, ``lm_loss_weight``; and ``passkey_eval`` = ``lengths``, ``depths``, ``samples``,
    ``batch_size``, ``prefill_chunk``, ``output_dir`` (optional)."""

    tokenizer = ByteTokenizer()

    def _filler(self) -> Filler:
        paths = self.config.data.get("filler_paths")
        return Filler(None if paths is None else list(paths))

    def _generator_kwargs(self) -> dict:
        data = self.config.data
        return dict(
            length=int(data.length) + 1,  # inputs plus the last target
            tokenizer=self.tokenizer,
            filler=self._filler(),
            digits=int(data.get("digits", 5)),
        )

    def _make_batch(self, seed, index, rows):
        kwargs = self._generator_kwargs()
        min_length = self.config.data.get("min_length")
        if min_length is None:

            def row(rng):
                batch = passkey_batch(rng, 1, **kwargs)
                return {**batch, "lm_weights": np.ones_like(batch["weights"])}

        else:
            longest = kwargs["length"] - 1
            if not 1 <= int(min_length) <= longest:
                raise ValueError(
                    f"config.data.min_length must lie in [1, length={longest}], got {min_length}"
                )

            def row(rng):
                length = int(rng.integers(int(min_length), longest + 1))
                batch = passkey_batch(rng, 1, **{**kwargs, "length": length + 1})
                return right_pad(batch, longest, self.tokenizer.pad_id)

        return stack_rows(row, row_rngs(seed, index, rows))

    def loss(self, params, batch, rng):
        """The answer digits' loss, plus ``lm_loss_weight`` times every token's."""
        return self.loss_from_logits(self._logits(params, batch, rng), batch)

    def loss_from_logits(self, logits, batch):
        """``loss``'s ``(loss, metrics)`` from the model's logits of ``batch``."""
        lm_weight = float(self.config.data.get("lm_loss_weight", 0.0))
        if lm_weight < 0:
            raise ValueError(f"config.data.lm_loss_weight must be >= 0, got {lm_weight}")
        loss, accuracy, _ = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
        metrics = {"accuracy": accuracy, "answer_loss": loss}
        if lm_weight:
            every = batch.get("lm_weights", jnp.ones_like(batch["weights"]))
            lm_loss, _, _ = weighted_cross_entropy(logits, batch["targets"], every)
            metrics["lm_loss"] = lm_loss
            loss = loss + lm_weight * lm_loss
        return loss, metrics

    def evaluate(self, params):
        metrics = super().evaluate(params)
        # Uniform guessing of the digits (the first is never 0).
        digits = int(self.config.data.get("digits", 5))
        metrics["eval/chance_loss"] = (math.log(9) + (digits - 1) * math.log(10)) / digits
        settings = self.config.get("passkey_eval")
        if settings is None or not settings.get("lengths"):
            return metrics
        result = passkey_accuracy(
            self.model,
            params,
            self.tokenizer,
            lengths=[int(n) for n in settings.lengths],
            depths=[float(d) for d in settings.depths],
            samples=int(settings.samples),
            seed=int(self.config.seed) + 2_000_003,
            filler=self._filler(),
            prefill_chunk=int(settings.get("prefill_chunk", 1024)),
            batch_size=settings.get("batch_size"),
        )
        metrics.update(result.metrics())
        output_dir = settings.get("output_dir")
        if output_dir and jax.process_index() == 0:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, "passkey_table.md"), "w") as handle:
                handle.write(result.table() + "\n")
            result.plot(os.path.join(output_dir, "passkey_heatmap.png"))
        print(result.table())
        return metrics
