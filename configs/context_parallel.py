r"""A long-sequence training step of a released model's shape, for ``lhc compile``.

    lhc compile --config configs/context_parallel.py:model=llama3.1-8b,length=131072,sequence=8,fsdp=2 \
        --topology v5p:2x2x4

Random weights in the shape of ``model`` (a preset of ``lhc.lm.PRESETS``), windows of
``length`` tokens, one per fsdp row (each split over the ``sequence`` devices), bfloat16, every layer rematerialised, the
head's loss over 1,024 positions at a time; the mesh ``(1, fsdp, 1, sequence)`` with
``impl`` attention (``ring``, ``allgather``, or ``chunked`` with ``sequence=1``: the
best setting without the sequence axis). Only for compiling: the text data of a real
run are those of ``configs/lm_finetune.py``.
"""

import ml_collections

from lhc.lm.config import get_preset
from lhc.train.config import base_config, parse_arg
from lhc.train.optim import adamw_cosine


def get_config(arg=None):
    arg = parse_arg(arg, model="llama3.2-1b", length=32768, sequence=8, fsdp=1, impl="ring")
    config = base_config("finetune")
    config.init_from = ""
    config.num_steps = 1
    config.batch_size = arg.fsdp  # one window per fsdp row, split over the sequence axis
    config.loss_chunk = 1024
    model = get_preset(
        arg.model,
        max_len=arg.length,
        dtype="bfloat16",
        param_dtype="float32",
        scan_layers=True,
        remat_policy="full",
        attention_impl=arg.impl,
    )
    config.model = ml_collections.ConfigDict(model.to_dict())
    config.data = ml_collections.ConfigDict(
        dict(paths="", length=arg.length, eval_fraction=0.05, separator="", tokenizer="",
             separate_documents=False)
    )  # fmt: skip
    config.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0, targets=()))
    config.optimizer = ml_collections.ConfigDict(adamw_cosine(learning_rate=1e-5))
    config.mesh_shape = (1, arg.fsdp, 1, arg.sequence)
    return config
