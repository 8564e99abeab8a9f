"""Language modelling on a tensorflow-datasets text dataset (PG-19) for any causal LM.

``config.task = "text_lm"``; the model comes from ``config.model_factory`` as in the
causal-LM task. ``config.data``:

* ``tfds_name`` (``"pg19"``), ``data_dir`` (where it is prepared; ``None`` for tfds's
  default), ``feature`` (``"book_text"``), ``split`` and ``eval_split``;
* ``length``: tokens per training window;
* ``tokenizer``: a Hugging Face ``tokenizer.json`` path (GPT-2's for the GCA paper), or
  ``"bytes"`` for ``lhc.lm.ByteTokenizer``. The model's vocabulary must hold its ids.

Windows come from ``lhc.data.TfdsText`` (every token counts in the loss);
``evaluate`` reports the loss and perplexity on ``eval_batches`` windows of
``eval_split``.
"""

from __future__ import annotations

import functools
import math

import jax

from lhc.data.iterators import IndexedIterator, row_rngs
from lhc.data.text import TfdsText
from lhc.lm.checkpoints import load_tokenizer
from lhc.lm.tokenizers import ByteTokenizer
from lhc.train.causal_lm import CausalLMTask


class TextLMTask(CausalLMTask):
    """See the module docstring for the config keys."""

    @functools.cached_property
    def tokenizer(self):
        name = self.config.data.get("tokenizer", "bytes")
        return ByteTokenizer() if name == "bytes" else load_tokenizer(name)

    @functools.cached_property
    def _sources(self) -> dict[str, TfdsText]:
        return {}

    def _source(self, split: str) -> TfdsText:
        """The split's reader, opened once."""
        if split not in self._sources:
            data = self.config.data
            self._sources[split] = TfdsText(
                data.tfds_name,
                split=split,
                tokenizer=self.tokenizer,
                data_dir=data.get("data_dir"),
                feature=data.get("feature", "text"),
            )
        return self._sources[split]

    def _batches(self, split: str):
        length = int(self.config.data.length)
        return lambda seed, index, rows: self._source(split).batch(
            row_rngs(seed, index, rows), length
        )

    def _indexed(self, split, seed, process_index, process_count) -> IndexedIterator:
        return self.indexed_iterator(self._batches(split), process_index, process_count, seed)

    def _iterator(self, seed, process_index, process_count):
        return self._indexed(self.config.data.split, seed, process_index, process_count)

    def _eval_iterator(self, process_index, process_count):
        split = self.config.data.get("eval_split", "validation")
        return self._indexed(split, int(self.config.seed) + 1_000_003, process_index, process_count)

    def batch_spec(self, batch_size):
        # From the config alone: compiling for a TPU needs no prepared data.
        length = int(self.config.data.length)
        return {
            "tokens": jax.ShapeDtypeStruct((batch_size, length), "int32"),
            "targets": jax.ShapeDtypeStruct((batch_size, length), "int32"),
            "weights": jax.ShapeDtypeStruct((batch_size, length), "float32"),
        }

    def evaluate(self, params):
        metrics = super().evaluate(params)
        metrics["eval/perplexity"] = math.exp(min(metrics["eval/loss"], 50.0))
        return metrics
