"""A language model for decoding from any source: an imported checkpoint (a Hugging
Face directory, a GGUF file, a named pretrained model) or an lhc training run."""

from __future__ import annotations

import os
from typing import Any

from lhc.lm.checkpoints import Checkpoint, load_checkpoint
from lhc.lm.tokenizers import ByteTokenizer
from lhc.train.trainer import restore_params


def load_language_model(
    checkpoint: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    **overrides: Any,
) -> Checkpoint:
    """The model, parameters, tokenizer and stop tokens of ``checkpoint`` or ``workdir``.

    Args:
        checkpoint: a Hugging Face directory, a ``.gguf`` file or a name from
            ``lhc.lm.pretrained_models.MODELS`` (``lhc.lm.load_checkpoint``).
        workdir: an lhc run: its recorded config and the checkpoint at ``step`` (latest
            when None). The tokenizer is the task's (``task.tokenizer``), else bytes when
            the model reads at least the 259 byte ids.
        dtype, **overrides: for ``checkpoint`` only (``lhc.lm.load_checkpoint``).

    Raises:
        ValueError: both or neither of ``checkpoint`` and ``workdir``, overrides for a
            workdir (its model is the run's), or a run whose model does not read text.
        FileNotFoundError: the checkpoint or the run does not exist.
    """
    if (checkpoint is None) == (workdir is None):
        raise ValueError(
            f"give exactly one of checkpoint and workdir, got checkpoint={checkpoint!r} "
            f"workdir={workdir!r}"
        )
    if checkpoint is not None:
        return load_checkpoint(checkpoint, dtype=dtype, **overrides)
    if overrides or dtype is not None:
        raise ValueError(
            f"a workdir's model is the one it trained: dtype and overrides apply to imported "
            f"checkpoints only, got dtype={dtype!r} {sorted(overrides)}"
        )
    experiment, params, _ = restore_params(None, os.fspath(workdir), step)
    model = experiment.task.model
    tokenizer = getattr(experiment.task, "tokenizer", None)
    if tokenizer is None:
        tokenizer = ByteTokenizer()
        vocab = getattr(model.config, "vocab_size", 0)
        if vocab < tokenizer.vocab_size:
            raise ValueError(
                f"workdir {os.fspath(workdir)!r}: the run's task has no tokenizer and its "
                f"model reads {vocab} token ids, fewer than the {tokenizer.vocab_size} of "
                f"bytes: it is not a model of text"
            )
    stops = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    return Checkpoint(model, params, tokenizer, stops, os.fspath(workdir))
