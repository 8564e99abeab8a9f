r"""GCA (or a dense baseline) trained on passkey retrieval at 512 tokens, on a CPU.

    lhc train --config configs/gca_passkey.py:tiny --workdir /tmp/gca_passkey
    lhc eval --workdir /tmp/gca_passkey \
        --config.passkey_eval.lengths="(512,2048,8192,32768,131072,524288)" \
        --config.passkey_eval.output_dir=experiments/gca

Sizes (the part after the colon):
  tiny      GCA: width 64, 2 heads of 32, 2 lower layers, a 1-layer chunk encoder, one
            group of 2 upper layers, 32-position chunks (31 text tokens and a landmark),
            top-4 retrieval, a 65-position sliding window (so most needles of a
            512-token sequence lie outside every window and only retrieval reaches
            them); batch 8, 1200 steps (10 min 53 s on a 2-core CPU, see
            experiments/gca).
  baseline  the dense ``lhc.lm.Transformer`` of the same width and depth (4 layers,
            RoPE, full causal attention), trained the same way; max_len 32768 so that
            it can be evaluated past its training length.
  Add ``runlocal`` for a smoke test of a few steps.

Byte tokens (``lhc.lm.ByteTokenizer``); the landmark is id 259. The loss is the five
answer digits' plus the next-token loss of the whole sequence (``lm_loss_weight=1``;
with the answer's loss alone, 800 steps of the tiny GCA stayed at chance).
"""

import ml_collections

from lhc.gca.config import GCAConfig, paper_optimizer
from lhc.lm.config import LMConfig
from lhc.train.config import base_config, model_section, parse_arg

WIDTH, HEADS, MLP = 64, 2, 128
VOCAB = 260  # 256 bytes, pad / bos / eos, and GCA's landmark
TRAIN_LENGTH = 512


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", runlocal=False)
    if arg.size not in ("tiny", "baseline"):
        raise ValueError(f"config arg size must be 'tiny' or 'baseline', got {arg.size!r}")
    config = base_config("passkey")
    config.seed = 0
    config.num_steps = 10 if arg.runlocal else 1200
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
            # JSON lines, one record per (length, depth) with every example's hit,
            # labelled (the run's seed is added).
            results="",
            label="",
        )
    )
    if arg.size == "tiny":
        config.model_factory = "lhc.gca:GCA"
        # What differs from GCAConfig's defaults (the landmark is vocab_size - 1).
        config.model = model_section(
            GCAConfig,
            vocab_size=VOCAB,
            embed_dim=WIDTH,
            num_heads=HEADS,
            num_kv_heads=HEADS,
            head_dim=WIDTH // HEADS,
            mlp_dim=MLP,
            lower_layers=2,
            encoder_layers=1,
            upper_layers=(2,),
            chunk_size=32,
            top_k=4,
            window=65,
        )
    else:
        config.model_factory = "transformer"
        # What differs from LMConfig's defaults.
        config.model = model_section(
            LMConfig,
            vocab_size=VOCAB,
            num_layers=4,
            embed_dim=WIDTH,
            num_heads=HEADS,
            num_kv_heads=HEADS,
            head_dim=WIDTH // HEADS,
            mlp_dim=MLP,
            max_len=32_768,
            tie_embeddings=True,
        )
    config.optimizer = ml_collections.ConfigDict(paper_optimizer())
    return config
