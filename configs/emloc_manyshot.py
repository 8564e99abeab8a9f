r"""EMLoC's miniature: a decoder trained on many-shot in-context classification
(``lhc.emloc.manyshot``), text or images, on a CPU.

    lhc train --config configs/emloc_manyshot.py:modality=text --workdir /tmp/emloc/text
    lhc train --config configs/emloc_manyshot.py:modality=image --workdir /tmp/emloc/image

Episodes of 5 classes with labels, keywords (text: 2 letters from the class's 2, each
replaced by a random letter with probability 0.1) or 8 x 8 binary prototypes (images:
4 patches of 4 x 4, pixel flips 0.1, Gaussian noise 0.3) drawn anew for every
sequence; 12 demonstrations per training sequence (48 tokens for text, 72 for
images), the loss on the labels. The model: an ``lhc.lm.Transformer`` of 4 layers,
width 64, 4 query heads sharing 2 key/value heads of 16, SwiGLU 256, RoPE, looping
over its layers (EMLoC keeps different tokens in every layer); for images, a two-layer
patch encoder gives the placeholder tokens their embeddings. Batch 64, ``steps``
(default 2500), AdamW at 1e-3 with cosine decay, seed 0. Add ``runlocal`` for a smoke test.
"""

import ml_collections

from lhc.train.config import base_config, parse_arg
from lhc.train.optim import adamw_cosine


def get_config(arg=None):
    arg = parse_arg(arg, modality="text", steps=2500, runlocal=False)
    config = base_config("lhc.emloc.manyshot:ManyShotTask")
    config.seed = 0
    config.num_steps = 5 if arg.runlocal else int(arg.steps)
    config.batch_size = 4 if arg.runlocal else 64
    config.eval_batches = 1 if arg.runlocal else 4
    config.log_every = 50
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(name="manyshot", shots=8 if arg.runlocal else 12, modality=arg.modality,
             classes=5, keywords=2, input_length=2, noise=0.1, image_size=8, patch=4,
             pixel_noise=0.3)
    )  # fmt: skip
    config.model = ml_collections.ConfigDict(
        dict(vocab_size=260, num_layers=4, embed_dim=64, num_heads=4, num_kv_heads=2,
             head_dim=16, mlp_dim=256, max_len=2048, rope_theta=10_000.0, norm_eps=1e-6,
             tie_embeddings=True, scan_layers=False, dtype="float32", param_dtype="float32",
             attention_impl="xla")
    )  # fmt: skip
    config.optimizer = ml_collections.ConfigDict(adamw_cosine(config.num_steps, 1e-3))
    return config
