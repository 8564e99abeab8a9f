"""Fine-tuning a decoder LM on a user's own text files: ``config.task = "finetune"``.

The model is an ``lhc.lm.Transformer`` whose config is ``config.model``; with
``config.init_from`` naming a pretrained checkpoint, the fields left ``None`` come from
it (``lhc.train.init_from``). ``config.data``:

* ``paths``: text files and folders (``lhc.data.text_files``), one document per file,
  or per ``separator``-delimited part of one;
* ``length``: tokens per training window;
* ``eval_fraction``: the share of each document's tokens held out for the eval loss;
* ``tokenizer``: a Hugging Face directory or ``tokenizer.json``, or a ``.gguf`` file;
  empty: the run's copy of the checkpoint's;
* ``separate_documents``: the documents packed in a window attend only to themselves
  and restart their positions (``lhc.lm.packing``; ``attention_impl="xla"``); False:
  one stream joined by end-of-sequence tokens, positions counting through the window.

``config.loss_chunk``: the head's loss over ``loss_chunk`` positions at a time (no
``[B, T, V]`` logits held; 0: the whole logits). ``config.model.remat_policy``
rematerialises each layer in the backward pass.

``evaluate`` reports the held-out loss and perplexity on ``eval_batches`` batches of
held-out windows (the same windows every time).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from lhc.data.text_files import TextFiles
from lhc.lm.checkpoints import load_tokenizer
from lhc.train.causal_lm import CausalLMTask


class FineTuneTask(CausalLMTask):
    """See the module docstring for the config keys."""

    @functools.cached_property
    def tokenizer(self):
        path = self.config.data.tokenizer
        if not path or not os.path.exists(path):
            raise FileNotFoundError(
                f"config.data.tokenizer: no tokenizer at {path!r} (a Hugging Face directory, "
                f"a tokenizer.json or a .gguf file; left empty, the checkpoint of "
                f"config.init_from gives it)"
            )
        return load_tokenizer(path)

    @functools.cached_property
    def text(self) -> TextFiles:
        data = self.config.data
        if not data.paths:
            raise ValueError(
                "config.data.paths: give the text files or folders to train on, "
                "comma-separated (--config.data.paths=FILE)"
            )
        text = TextFiles(
            data.paths,
            self.tokenizer,
            int(data.length),
            eval_fraction=float(data.eval_fraction),
            separator=data.get("separator") or None,
        )
        if int(self.config.eval_batches) and not text.held_out.num_windows:
            text.eval_batch(0, range(1), 1)  # says why, before the first step
        return text

    def _window_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.config.data.get("separate_documents", True):
            batch = dict(
                batch,
                positions=np.broadcast_to(
                    np.arange(batch["tokens"].shape[1], dtype=np.int32), batch["tokens"].shape
                ).copy(),
            )
            batch["segment_ids"] = np.zeros_like(batch["tokens"])
        return batch

    def _make_batch(self, seed, index, rows):
        batch_size = int(self.config.batch_size)
        return self._window_batch(self.text.train_batch(seed, index, rows, batch_size))

    def _make_eval_batch(self, seed, index, rows):
        del seed  # the same held-out windows every evaluation
        return self._window_batch(self.text.eval_batch(index, rows, int(self.config.batch_size)))

    def batch_spec(self, batch_size):
        # From the config alone: compiling for an accelerator needs no data.
        shape = (batch_size, int(self.config.data.length))
        spec = {
            name: jax.ShapeDtypeStruct(shape, "int32")
            for name in ("tokens", "targets", "positions", "segment_ids")
        }
        spec["weights"] = jax.ShapeDtypeStruct(shape, "float32")
        return spec

    def _forward_metrics(self, params, batch, rng=None):
        chunk = int(self.config.get("loss_chunk", 0))
        if not chunk:
            return super()._forward_metrics(params, batch, rng)
        (nll, hit), _ = self._apply(params, batch, rng, targets=batch["targets"], loss_chunk=chunk)
        weights = batch["weights"]
        num_tokens = jnp.maximum(weights.sum(), 1.0)
        loss = (nll * weights).sum() / num_tokens
        accuracy = (hit * weights).sum() / num_tokens
        return loss, accuracy, weights.sum()

    def _logits(self, params, batch, rng=None):
        logits, _ = self._apply(params, batch, rng)
        return logits

    def _apply(self, params, batch, rng=None, **kwargs):
        separate = self.config.data.get("separate_documents", True)
        rngs = None if rng is None else {"train": rng}
        return self.model.apply(
            {"params": params},
            batch["tokens"],
            batch["positions"],
            segment_ids=batch["segment_ids"] if separate else None,
            rngs=rngs,
            **kwargs,
        )

    def evaluate(self, params):
        if not int(self.config.eval_batches):
            return {}
        metrics = super().evaluate(params)
        metrics["eval/perplexity"] = math.exp(min(metrics["eval/loss"], 50.0))
        return metrics
