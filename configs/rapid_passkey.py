r"""Models for RAPID's measurements: passkey retrieval at 512 tokens, on a CPU.

    lhc train --config configs/rapid_passkey.py:tiny --workdir /tmp/rapid/target
    lhc train --config configs/rapid_passkey.py:large --workdir /tmp/rapid/large
    lhc bench rapid --workdir /tmp/rapid/target --draft-workdir /tmp/rapid/large \
        --context-lengths 2048,8192,32768

Sizes (the part after the colon): ``tiny``, an ``lhc.lm.Transformer`` of 4 layers, width
128, 4 heads of 32 channels, SwiGLU 256, RoPE, full causal attention (the target, and the
drafter of self-speculation); ``large``, 6 layers of width 160 (5 heads of 32, SwiGLU
384): the larger drafter of upward speculation. Both read byte tokens, have max_len 65536
(32K-token contexts plus the generated tokens) and train on batches of 8 for 2000 steps.
Add ``runlocal`` for a smoke test of a few steps.

The loss is the five answer digits' plus the next-token loss of the whole sequence
(``lm_loss_weight=1``), so the models are also language models of the filler text that
follows the answer in the benchmark's generations. Sequence lengths are uniform in
[128, 512] (``min_length``): the drafter reads RAG prompts of a few hundred tokens, and a
model trained at exactly 512 tokens answers only there (1.0 at 512 tokens, 0.12-0.19
at 288-458 tokens after 2000 steps).
"""

import ml_collections

from lhc.lm.config import LMConfig
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine

VOCAB = 259  # 256 bytes, pad / bos / eos
SIZES = {
    "tiny": dict(num_layers=4, embed_dim=128, num_heads=4, num_kv_heads=4, mlp_dim=256),
    "large": dict(num_layers=6, embed_dim=160, num_heads=5, num_kv_heads=5, mlp_dim=384),
}


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", runlocal=False)
    if arg.size not in SIZES:
        raise ValueError(f"config arg size must be one of {sorted(SIZES)}, got {arg.size!r}")
    config = base_config("passkey")
    config.seed = 0
    config.num_steps = 10 if arg.runlocal else 2000
    config.batch_size = 8
    config.eval_batches = 2
    config.log_every = 10
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(length=512, min_length=128, filler_paths=None, digits=5, lm_loss_weight=1.0)
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
    config.model = model_section(
        LMConfig,
        vocab_size=VOCAB,
        head_dim=32,
        max_len=65_536,
        tie_embeddings=True,
        **SIZES[arg.size],
    )
    config.optimizer = ml_collections.ConfigDict(adamw_cosine())
    return config
