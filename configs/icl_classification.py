r"""In-context classification pretraining for the Iterative Vectors experiment
(``lhc.icl.classification``): every prompt a new generated task, on a CPU.

    lhc train --config configs/icl_classification.py --workdir /tmp/iv/model

Prompts of 2-5 classes with 1 to ``shots`` (default 2) demonstrations per class, then a
query (``input\nlabel`` blocks joined by ``\n\n\n``, byte tokens, right-padded to
``width``, default 112); an input is one letter, its class's keyword or with probability
0.1 any letter; the loss on the label words. The model: 2 layers, width 64, 4 heads of
16, SwiGLU 256, untied embeddings; batch 128, ``steps`` (default 3000), AdamW at 3e-3 (5%
warm-up, cosine to 10%), seed 0. ``runlocal`` for a smoke test.

The settings that made EMLoC's many-shot model learn in context (small, large batch,
high learning rate). With 4 layers of width 128, batch 32 and 1e-3 the model learned
to answer with one of the labels in its context but not which one: still at chance
after 1000 steps, with 4-letter inputs from one keyword per class as with two; so did
these settings with 4-letter inputs, and with 1-letter inputs after 3000 steps, and with
up to 4 demonstrations per class (``shots=4,width=224``) after 1000
(``experiments/icl_iterative_vectors/README.md``).
"""

import ml_collections

from lhc.train.config import base_config, parse_arg
from lhc.train.optim import adamw_cosine


def get_config(arg=None):
    arg = parse_arg(arg, steps=3000, lr=3e-3, batch=128, shots=2, width=112, runlocal=False)
    config = base_config("lhc.icl.classification:PretrainTask")
    config.seed = 0
    config.num_steps = 5 if arg.runlocal else int(arg.steps)
    config.batch_size = 4 if arg.runlocal else int(arg.batch)
    config.eval_batches = 1 if arg.runlocal else 4
    config.log_every = 50
    config.eval_every = 500
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(name="icl_classification", max_classes=5, max_shots=int(arg.shots),
             width=int(arg.width), keywords=1, input_length=1, noise=0.1)
    )  # fmt: skip
    config.model = ml_collections.ConfigDict(
        dict(vocab_size=256, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=4,
             head_dim=16, mlp_dim=256, max_len=1024, rope_theta=10_000.0, norm_eps=1e-6,
             tie_embeddings=False, scan_layers=True, dtype="float32", param_dtype="float32",
             attention_impl="xla")
    )  # fmt: skip
    config.optimizer = ml_collections.ConfigDict(
        adamw_cosine(config.num_steps, float(arg.lr), warmup_steps=max(config.num_steps // 20, 1),
                     end_lr_fraction=0.1, b2=0.98, weight_decay=0.0)
    )  # fmt: skip
    return config
