r"""A dense decoder for QuantSpec's measurements: passkey retrieval at 512 tokens, on a CPU.

    lhc train --config configs/quantspec_passkey.py:tiny --workdir /tmp/quantspec_passkey
    lhc bench quantspec --workdir /tmp/quantspec_passkey --prompt-lengths 512,2048,8192

Sizes (the part after the colon): ``tiny``, an ``lhc.lm.Transformer`` of 4 layers, width
128, 4 heads of 32 channels (so that QuantSpec's KV groups of 32 channels cover a head),
SwiGLU 256, RoPE, full causal attention, max_len 16384; batch 8, 1000 steps. Add
``runlocal`` for a smoke test of a few steps.

Byte tokens; the loss is the five answer digits' plus the next-token loss of the whole
sequence (``lm_loss_weight=1``), so the model is also a language model of the filler text
that the benchmark's prompts are made of: what its draft and target disagree on is what
the acceptance rate measures.
"""

import ml_collections

from lhc.lm.config import LMConfig
from lhc.quantspec import PASSKEY_MODEL
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", runlocal=False)
    if arg.size != "tiny":
        raise ValueError(f"config arg size must be 'tiny', got {arg.size!r}")
    config = base_config("passkey")
    config.seed = 0
    config.num_steps = 10 if arg.runlocal else 1000
    config.batch_size = 8
    config.eval_batches = 2
    config.log_every = 10
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(length=512, filler_paths=None, digits=5, lm_loss_weight=1.0)
    )
    config.passkey_eval = ml_collections.ConfigDict(
        dict(
            lengths=(),
            depths=(0.0, 0.5, 1.0),
            samples=4,
            batch_size=4,
            prefill_chunk=512,
            output_dir="",
        )
    )
    config.model_factory = "transformer"
    config.model = model_section(LMConfig, **PASSKEY_MODEL.to_dict())
    config.optimizer = ml_collections.ConfigDict(adamw_cosine())
    return config
