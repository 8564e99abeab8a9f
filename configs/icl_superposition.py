r"""Task superposition from scratch (``lhc.icl.superposition``): a Llama-style decoder
trained on character-level prompts that each hold one task, on a CPU.

    lhc train --config configs/icl_superposition.py:kind=bias_add --workdir /tmp/sup/bias_add
    lhc train --config configs/icl_superposition.py:kind=copy --workdir /tmp/sup/copy

The paper's code trains 6 layers of width 384 (6 heads, MLP 4x) on 100 demonstrations
per prompt, batch 960, 10K steps. Here: ``size=paper`` keeps those widths; the default
``size=small`` (4 layers, width 128, 4 heads, MLP 512) trains on a 2-core CPU in minutes.
Prompts of ``demos`` (default 40) demonstrations, batch 32, AdamW 5e-4 with 10% warm-up
then constant and a linear decay over the last 10% (the code's warmup-stable-decay,
approximated by warm-up then cosine to 0.1 here), b2 0.98, weight decay 0.01, seed 0.
Add ``runlocal`` for a smoke test.
"""

import ml_collections

from lhc.lm.config import LMConfig
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine

SIZES = {
    "small": dict(num_layers=4, embed_dim=128, num_heads=4, head_dim=32, mlp_dim=512),
    "paper": dict(num_layers=6, embed_dim=384, num_heads=6, head_dim=64, mlp_dim=1536),
}


def get_config(arg=None):
    arg = parse_arg(
        arg, size="small", kind="bias_add", demos=20, steps=2000, lr=1e-3, batch=64, runlocal=False
    )
    if arg.size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {arg.size!r}")
    config = base_config("lhc.icl.task:SuperpositionTask")
    config.seed = 0
    config.num_steps = 5 if arg.runlocal else int(arg.steps)
    config.batch_size = 4 if arg.runlocal else int(arg.batch)
    config.eval_batches = 1 if arg.runlocal else 4
    config.log_every = 50
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(name="superposition", kind=arg.kind, demos=8 if arg.runlocal else int(arg.demos))
    )
    size = SIZES[arg.size]
    config.model = model_section(
        LMConfig,
        vocab_size=256,
        max_len=2048,
        num_kv_heads=size["num_heads"],
        scan_layers=True,
        **size,
    )
    config.optimizer = ml_collections.ConfigDict(
        adamw_cosine(
            learning_rate=float(arg.lr),
            warmup_fraction=0.1,
            end_lr_fraction=0.1,
            b2=0.98,
            weight_decay=0.01,
        )
    )
    return config
