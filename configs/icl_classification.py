r"""In-context classification pretraining for the Iterative Vectors experiment
(``lhc.icl.classification``): every prompt a new generated task, on a CPU.

    lhc train --config configs/icl_classification.py --workdir /tmp/iv/model

Prompts of 2 to ``classes`` (default 2) classes with 1 to ``shots`` (default 1)
demonstrations per class, then a query (``input\nlabel`` blocks joined by ``\n\n\n``,
byte tokens, right-padded to ``width``, default 28); an input is one upper-case letter,
its class's keyword or with probability 0.1 any; the loss on the label words. A
curriculum: the first ``plain_steps`` (default 2000) steps show the labels right after
their inputs (``input label``, no separator), the next ``mixed_steps`` (default 0) the
separator in half of the prompts, then in all. The model: 2 layers, width 64, 4 heads
of 16, SwiGLU 256, untied embeddings; batch 64, ``steps`` (default 5000), AdamW at 3e-3
(5% warm-up, cosine to 10%), seed 0. ``runlocal`` for a smoke test.

Without the curriculum no model learned the task: with the separator from the start,
the model learns to answer with one of the labels in its context but not which one
(the matching needs the input two tokens back from each label and one token back from
the separator); the 2-class prompts without a separator are learned after a plateau of
about 1500 steps, and from there the separator within a few hundred. With more classes
or demonstrations (``classes=3,shots=2,width=72``) a hard switch to the separator
stayed near chance; ``mixed_steps`` got above it
(``experiments/icl/iterative_vectors/README.md``).
"""

import ml_collections

from lhc.lm.config import LMConfig
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine


def _stages(arg) -> list[dict]:
    """Without separator for ``plain_steps``, then with it in half the prompts for
    ``mixed_steps``."""
    stages = [
        dict(steps=int(arg.plain_steps), separator=False),
        dict(steps=int(arg.mixed_steps), separator=0.5),
    ]
    stages = [s for s in stages if s["steps"] > 0]
    if arg.runlocal:  # one step of each
        stages = [dict(s, steps=1) for s in stages]
    return stages


def get_config(arg=None):
    arg = parse_arg(
        arg,
        steps=5000,
        lr=3e-3,
        batch=64,
        classes=2,
        shots=1,
        width=28,
        plain_steps=2000,
        mixed_steps=0,
        runlocal=False,
    )
    config = base_config("lhc.icl.task:PretrainTask")
    config.seed = 0
    config.num_steps = 5 if arg.runlocal else int(arg.steps)
    config.batch_size = 4 if arg.runlocal else int(arg.batch)
    config.eval_batches = 1 if arg.runlocal else 4
    config.log_every = 50
    config.eval_every = 500
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(
            name="icl_classification",
            max_classes=int(arg.classes),
            max_shots=int(arg.shots),
            width=int(arg.width),
            keywords=1,
            input_length=1,
            noise=0.1,
            stages=_stages(arg),
        )
    )
    config.model = model_section(
        LMConfig,
        vocab_size=256,
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        mlp_dim=256,
        max_len=1024,
        scan_layers=True,
    )
    config.optimizer = ml_collections.ConfigDict(
        adamw_cosine(
            learning_rate=float(arg.lr),
            warmup_fraction=0.05,
            end_lr_fraction=0.1,
            b2=0.98,
            weight_decay=0.0,
        )
    )
    return config
