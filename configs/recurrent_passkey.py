r"""A recurrent LM (Mamba-2 or GLA) trained on passkey retrieval at 256 tokens, on a CPU.

    lhc train --config configs/recurrent_passkey.py:tiny,model=mamba2 --workdir /tmp/mamba2_passkey
    lhc eval --workdir /tmp/mamba2_passkey \
        --config.passkey_eval.lengths="(256,1024,4096,25600)"

Sizes (the part after the colon): ``tiny``, 2 layers of width 64 (Mamba-2: heads of 16
channels, state 16; GLA: 2 heads, keys 16, values 32, MLP 128), batch 8, 3000 steps
(at 1,200 steps Mamba-2 had learned the task on one seed of three).
Flags: ``model=mamba2|gla``; ``init=zero|noise|fitted|passing|tbtt`` (the initial state
of every training sequence, ``lhc.recurrent.task``: zero; Random Noise of std
``noise_std=``; Fitted Noise from the moments that zero-state steps record; State
Passing; TBTT over documents of ``chunks=`` training lengths), to post-train a zero-state
run by resuming its workdir with more steps (``--config.num_steps=``); ``runlocal`` (a
few steps, a smoke test).

Byte tokens; the loss is the answer digits' plus the next-token loss of the whole
sequence, as in ``configs/gca_passkey.py``. The state does not grow with the context,
so the evaluation may run at 100x the training length.
"""

import ml_collections

from lhc.recurrent.config import GLAConfig, Mamba2Config
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine

VOCAB = 259  # 256 bytes, pad / bos / eos
TRAIN_LENGTH = 256
_MODELS = {
    "mamba2": (
        "lhc.recurrent:Mamba2LM",
        dict(num_layers=2, embed_dim=64, head_dim=16, state_dim=16, chunk_size=64),
    ),
    "gla": (
        "lhc.recurrent:GLALM",
        dict(
            num_layers=2,
            embed_dim=64,
            num_heads=2,
            key_dim=16,
            value_dim=32,
            mlp_dim=128,
            chunk_size=64,
        ),
    ),
}


def get_config(arg=None):
    arg = parse_arg(
        arg, size="tiny", model="mamba2", init="zero", noise_std=1.0, chunks=4, runlocal=False
    )
    if arg.size != "tiny":
        raise ValueError(f"config arg size must be 'tiny', got {arg.size!r}")
    if arg.model not in _MODELS:
        raise ValueError(f"config arg model must be one of {sorted(_MODELS)}, got {arg.model!r}")
    factory, fields = _MODELS[arg.model]
    config = base_config("lhc.recurrent.task:RecurrentPasskeyTask")
    config.initial_state = ml_collections.ConfigDict(
        dict(kind=arg.init, std=arg.noise_std, fit_decay=0.99, chunks=arg.chunks)
    )
    config.seed = 0
    config.num_steps = 10 if arg.runlocal else 3000
    config.batch_size = 8
    config.eval_batches = 2
    config.log_every = 10
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(length=TRAIN_LENGTH, filler_paths=None, digits=5, lm_loss_weight=1.0)
    )
    config.passkey_eval = ml_collections.ConfigDict(
        dict(
            lengths=(),
            depths=(0.0, 0.25, 0.5, 0.75, 1.0),
            samples=4,
            batch_size=4,
            prefill_chunk=1024,
            output_dir="",
        )
    )
    config.model_factory = factory
    config_class = {"mamba2": Mamba2Config, "gla": GLAConfig}[arg.model]
    config.model = model_section(config_class, vocab_size=VOCAB, **fields)
    config.optimizer = ml_collections.ConfigDict(adamw_cosine())
    return config
