r"""Fine-tune a pretrained decoder LM on your own text files.

    lhc train --config configs/lm_finetune.py --workdir /tmp/ft \
        --config.init_from=smollm2-135m-instruct --config.data.paths=notes.txt

``init_from``: a pretrained model's name (``lhc.lm.pretrained_models``), a Hugging Face
directory, a ``.gguf`` file, or an lhc run (``WORKDIR[:STEP]``). The model's fields left
``None`` below come from the checkpoint; set any of them to change it, e.g.
``--config.model.max_len=16384`` (the changes are listed in ``WORKDIR/init_from.json``).
``data.paths``: text files and folders, comma-separated, one document per file (or per
``data.separator``-delimited part); the last ``data.eval_fraction`` of each document is
held out for the eval loss. ``--config.lora.rank=8`` trains low-rank adapters on the
projections that ``lora.targets`` match (regular expressions over paths such as
``layers/attention/query``), the model frozen.

The default is CPU-sized: windows of 256 tokens, 8 per step, 200 steps at a learning
rate of 2e-5 after a warm-up, float32.

``:long`` extends the context (``experiments/context_extension``): windows of ``context``
tokens (16,384) of a model trained to ``original`` (8,192), RoPE scaled by the ratio
(``scaling=yarn``, ``linear`` or ``ntk``), LoRA rank 8 on q/k/v/o, 50 steps of one window,
each layer rematerialised and attention in key blocks; ``:long,context=32768`` for an
accelerator.
"""

import dataclasses

import ml_collections

from lhc.lm.config import LMConfig
from lhc.train.config import base_config, parse_arg
from lhc.train.optim import adamw_cosine

# The run's numerics and layout; every other field of the model comes from the checkpoint.
_TRAINING_FIELDS = dict(
    dtype="float32",
    param_dtype="float32",
    scan_layers=True,
    switch_layers=False,
    kernel_layout="in_out",
    remat_policy="none",
    attention_impl="xla",
    dropout_rate=0.0,
)


# Context extension (``:long``): the RoPE scaling of the extended model, by name.
_SCALINGS = {
    "yarn": lambda factor, original: {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
    },
    "linear": lambda factor, original: {"rope_type": "linear", "factor": factor},
    "ntk": lambda factor, original: {"rope_type": "ntk", "factor": factor},
}


def get_config(arg=None):
    arg = parse_arg(arg, runlocal=False, long=False, scaling="yarn", context=16384, original=8192)
    config = base_config("finetune")
    config.init_from = "smollm2-135m-instruct"
    config.num_steps = 4 if arg.runlocal else 200
    config.batch_size = 8
    config.eval_every = 50
    config.eval_batches = 4
    config.checkpoint_every = 50
    config.log_every = 10
    config.loss_chunk = 1024  # positions of the head's loss at a time (0: the whole logits)
    config.model = ml_collections.ConfigDict(
        {f.name: _TRAINING_FIELDS.get(f.name) for f in dataclasses.fields(LMConfig) if f.init}
    )
    config.data = ml_collections.ConfigDict(
        dict(
            paths="",
            length=256,
            eval_fraction=0.05,
            separator="",
            tokenizer="",
            separate_documents=True,
        )
    )
    # Low-rank adapters (lhc.nn.lora): rank 0 trains every weight; rank r >= 1 trains
    # only adapters on the projections whose paths match `targets`, the model frozen.
    config.lora = ml_collections.ConfigDict(
        dict(rank=0, alpha=16.0, dropout=0.0, targets=("attention/(query|value)",))
    )
    config.optimizer = ml_collections.ConfigDict(
        adamw_cosine(
            learning_rate=2e-5, warmup_fraction=0.05, end_lr_fraction=0.1, weight_decay=0.0
        )
    )
    if arg.long:
        _long(config, arg)
    return config


def _long(config, arg) -> None:
    """Context extension: ``context`` tokens per window (from the checkpoint's
    ``original``), the RoPE ``scaling`` by the ratio, LoRA on the attention projections,
    every layer rematerialised and attention in blocks so a window fits a CPU's memory."""
    if arg.scaling not in _SCALINGS:
        raise ValueError(
            f"config arg scaling must be one of {sorted(_SCALINGS)}, got {arg.scaling!r}"
        )
    factor = arg.context / arg.original
    config.num_steps = 2 if arg.runlocal else 50
    config.batch_size = 1
    config.log_every = 1
    config.eval_every = 25
    config.eval_batches = 2
    config.checkpoint_every = 1  # a 16K step takes over half an hour on a 2-core CPU
    config.model.max_len = arg.context
    config.model.rope_scaling = _SCALINGS[arg.scaling](factor, arg.original)
    config.model.attention_impl = "chunked"  # online softmax over key blocks
    config.model.remat_policy = "full"
    config.data.length = arg.context
    config.data.separate_documents = False  # one long text; the blocked attention has no mask
    config.lora.rank = 8
    config.lora.targets = ("attention/(query|key|value|out)",)
    config.optimizer.learning_rate = 1e-4
