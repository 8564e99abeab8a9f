"""What the measurements on a model share: the model itself and prompts of filler text."""

from __future__ import annotations

import argparse

import jax
import numpy as np

from lhc import bench, lm
from lhc.quantspec import decoding


def load_model(
    workdir: str | None,
    random_seed: int | None,
    checkpoint: str | None = None,
    dtype: str | None = None,
):
    """``(model, params, tokenizer)``: an imported checkpoint's (in ``dtype``), a trained
    run's (``lhc.bench.load_model_source``: SystemExit with one line when missing), or
    random weights of ``lhc.quantspec.PASSKEY_MODEL`` (byte tokens)."""
    if checkpoint is not None or workdir is not None:
        source = argparse.Namespace(checkpoint=checkpoint, workdir=workdir, dtype=dtype)
        loaded = bench.load_model_source(source)
        return loaded.model, loaded.params, loaded.tokenizer
    params = lm.init_params(decoding.PASSKEY_MODEL, jax.random.key(random_seed or 0))
    return lm.Transformer(decoding.PASSKEY_MODEL), params, lm.ByteTokenizer()


def filler_prompts(batch: int, length: int, seed: int = 0, tokenizer=None, filler=None):
    """``batch`` prompts of ``length`` filler tokens (``lhc.train.passkey.Filler``: the
    generated filler, or snippets of text files) in ``tokenizer``'s tokens (bytes)."""
    from lhc.train.passkey import Filler

    tokenizer = tokenizer or lm.ByteTokenizer()
    source = filler or Filler()
    rng = np.random.default_rng(seed)
    return np.stack([source.tokens(tokenizer, rng, length) for _ in range(batch)]).astype(np.int32)
