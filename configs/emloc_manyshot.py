r"""EMLoC's miniature: a decoder trained on many-shot in-context classification
(``lhc.emloc.manyshot``, the task ``lhc.emloc.task``), text or images, on a CPU.

    lhc train --config configs/emloc_manyshot.py:modality=text --workdir /tmp/emloc/text
    lhc train --config configs/emloc_manyshot.py:modality=image,lr=1e-3,init=/tmp/emloc/text \
        --workdir /tmp/emloc/image

Episodes of 4 classes with labels (capital letters) and, drawn anew for every
sequence, a keyword letter per class (text: the input is the keyword, replaced by a
random letter with probability 0.1) or an 8 x 8 binary prototype (images: the prototype
with pixels flipped with probability 0.1 and Gaussian noise 0.3, one 8 x 8 patch, one
placeholder token). Training sequences hold 4 to 16 demonstrations (uniform; right-
padded to 48 tokens), the loss on the labels. The model: an ``lhc.lm.Transformer`` of 2
layers, width 64, 4 query heads sharing 2 key/value heads of 16, SwiGLU 128, RoPE,
untied embeddings, looping over its layers (EMLoC keeps different tokens in every
layer); for images, a two-layer patch encoder gives the placeholder tokens their
embeddings. Batch 128, ``steps`` (default 3000), AdamW at 3e-3 (5% warm-up, cosine
decay to 10%, b2 0.98, no weight decay; ``lr``), seed 0. ``init=WORKDIR`` starts
from that run's parameters (the image model from the text model: every parameter
fine-tuned, the patch encoder new; from scratch it stayed at chance for 2700 steps).
Add ``runlocal`` for a smoke test.

The settings of the associative-recall config (``configs/lm_assoc_recall.py``), whose
induction mechanism forms within 1200 steps, were the starting point; with 4 layers,
tied embeddings, 5-10 classes, 20-40 demonstrations per sequence, batch 16-64 or a
learning rate of 1e-3, the model stayed at chance for 1000-2000 steps.
"""

import ml_collections

from lhc.lm.config import LMConfig
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine


def get_config(arg=None):
    arg = parse_arg(arg, modality="text", steps=3000, lr=3e-3, init="", runlocal=False)
    config = base_config("lhc.emloc.task:ManyShotTask")
    config.seed = 0
    config.num_steps = 5 if arg.runlocal else int(arg.steps)
    config.init_params_from = arg.init or None
    config.batch_size = 4 if arg.runlocal else 128
    config.eval_batches = 1 if arg.runlocal else 4
    config.log_every = 50
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(
            name="manyshot",
            shots=8 if arg.runlocal else 16,
            min_shots=4,
            modality=arg.modality,
            classes=4,
            keywords=1,
            input_length=1,
            noise=0.1,
            image_size=8,
            patch=8,
            pixel_noise=0.3,
        )
    )
    config.model = model_section(
        LMConfig,
        vocab_size=260,
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        max_len=2048,
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
