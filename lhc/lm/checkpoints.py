"""One loader for every checkpoint format a user brings: a Hugging Face directory, a
llama.cpp GGUF file, or the name of an offline pretrained model (``lhc.lm.pretrained``).

    ckpt = lm.load_checkpoint("smollm2-135m-instruct")          # or a directory, a .gguf
    prompt = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    out = lm.generate(ckpt.model, ckpt.params, [ckpt.tokenizer.encode(prompt)],
                      max_new_tokens=32, stop_tokens=ckpt.stop_tokens)

An lhc training run (a workdir) loads through ``lhc.train.load_language_model``, which
takes either.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.lm import hf
from lhc.lm.config import LMConfig
from lhc.lm.hf_config import config_from_hf
from lhc.lm.model import Transformer
from lhc.lm.pretrained_models import MODELS, pretrained
from lhc.lm.tokenizers import HFTokenizer, Tokenizer


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A language model ready to decode.

    Attributes:
        model: a causal-LM protocol module (``lhc.lm.Transformer`` for imported checkpoints).
        params: its parameters.
        tokenizer: its tokenizer, with the chat template when the checkpoint has one.
        stop_tokens: the ids that end a reply (end of sequence, end of turn).
        path: where it was loaded from.
    """

    model: nn.Module
    params: Any
    tokenizer: Tokenizer
    stop_tokens: tuple[int, ...]
    path: str

    @property
    def config(self):
        return self.model.config


def default_dtype() -> str:
    """float32 on a CPU (where bfloat16 matmuls are slow and inexact), else bfloat16."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve_checkpoint(checkpoint: str | os.PathLike) -> str:
    """The local path of ``checkpoint``: a name from ``lhc.lm.pretrained_models.MODELS``
    (fetched the first time), or an existing directory or ``.gguf`` file.

    Raises:
        FileNotFoundError: neither a known name nor an existing path.
    """
    text = os.fspath(checkpoint)
    if text in MODELS:
        return os.fspath(pretrained(text))
    if os.path.isdir(text) or (os.path.isfile(text) and text.endswith(".gguf")):
        return text
    if os.path.exists(text):
        raise FileNotFoundError(
            f"checkpoint {text!r} must be a Hugging Face directory or a .gguf file"
        )
    raise FileNotFoundError(
        f"checkpoint {text!r}: no such directory or .gguf file, and not a known model name "
        f"({', '.join(sorted(MODELS))})"
    )


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a checkpoint: a Hugging Face directory or ``tokenizer.json``
    (``HFTokenizer.from_file``), or a ``.gguf`` file (``lhc.lm.gguf.load_tokenizer``)."""
    if os.fspath(path).endswith(".gguf"):
        from lhc.lm import gguf

        return gguf.load_tokenizer(path)
    return HFTokenizer.from_file(path)


def checkpoint_config(checkpoint: str | os.PathLike, **overrides: Any) -> LMConfig:
    """The ``LMConfig`` of a checkpoint (``resolve_checkpoint``'s names and paths) read
    from its metadata alone (``config.json``, or the GGUF header), no weights loaded;
    ``overrides`` are further fields.

    Raises:
        FileNotFoundError, ValueError: as ``load_checkpoint``.
    """
    path = resolve_checkpoint(checkpoint)
    if path.endswith(".gguf"):
        from lhc.lm import gguf

        hf_config = gguf.hf_config(path)
    else:
        config_path = os.path.join(path, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"no config.json in {path}")
        with open(config_path) as f:
            hf_config = json.load(f)
    return config_from_hf(hf_config, **overrides)


def default_layers(backend: str | None = None) -> dict[str, bool]:
    """How a loaded checkpoint runs its layers on ``backend`` (default: JAX's), as
    ``LMConfig`` fields.

    XLA's CPU backend copies a stacked layer's weights out of a scan before multiplying
    by them, which slows a batch-1 decode step that only streams weights
    (``experiments/lm_decode``: SmolLM2 at 49% of the memory bandwidth scanned, 60%
    switched; a random 100M Llama 36% and 65%); an array per layer chosen by
    ``lax.switch`` reads in place at the cost of compiling a product per layer (SmolLM2's
    first ``generate`` 9.2 s instead of 6.3 s). On TPU and GPU the layers stay stacked and scanned (compiled once, MaxText's
    layout; not measured here).
    """
    if (backend or jax.default_backend()) == "cpu":
        return {"scan_layers": False, "switch_layers": True}
    return {"scan_layers": True, "switch_layers": False}


def load_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    **overrides: Any,
) -> Checkpoint:
    """Loads a Hugging Face directory, a GGUF file or a named pretrained model.

    Args:
        checkpoint: a path or a name (``resolve_checkpoint``).
        dtype: compute and parameter dtype; ``default_dtype()`` when None.
        mesh, rules: shard the parameters (see ``lhc.lm.hf.load``).
        **overrides: ``LMConfig`` fields, e.g. ``max_len``, ``attention_impl``. The layers
            run as one compiled block by default (``default_layers``): on a CPU an array
            per layer chosen by ``lax.switch`` (``switch_layers=True``), elsewhere a
            stacked array scanned (``scan_layers=True``). ``scan_layers=False`` alone
            gives the plain loop (EMLoC keeps different tokens per layer).

    Raises:
        FileNotFoundError, ValueError: from the format's loader, naming the file.
    """
    path = resolve_checkpoint(checkpoint)
    dtype = jnp.dtype(default_dtype() if dtype is None else dtype)
    if "scan_layers" not in overrides and "switch_layers" not in overrides:
        overrides = {**default_layers(), **overrides}
    if path.endswith(".gguf"):
        from lhc.lm import gguf

        config, params = gguf.load(path, dtype, mesh=mesh, rules=rules, **overrides)
        stops = gguf.stop_tokens(path)
    else:
        config, params = hf.load(path, dtype, mesh=mesh, rules=rules, **overrides)
        stops = hf.stop_tokens(path)
    tokenizer = load_tokenizer(path)
    if not stops and tokenizer.eos_id is not None:
        stops = (tokenizer.eos_id,)
    return Checkpoint(Transformer(config), params, tokenizer, tuple(stops), path)
