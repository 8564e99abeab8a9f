r"""NoLiMa's miniature: a decoder, GCA or Mamba-2 model trained on a generated world of
latent associations (``lhc.nolima.world``), on a CPU.

    lhc train --config configs/nolima_world.py:model=decoder --workdir /tmp/nolima/decoder
    lhc bench nolima --workdir /tmp/nolima/decoder --world --lengths 250,500,1000,2000,4000

The world: 4 regions x 3 cities x 3 landmarks, made-up names. Each training sequence is
filler prose with decoys (20% of lines, and at least two: someone next to a landmark
of another region),
one needle ("Olga lives next to the Vornak Gate.") at a uniform depth, and a question of
one of three types (direct: the landmark; one-hop: its city; two-hop: its region), then
the name. Lengths are uniform in [128, 512] byte tokens; the loss is the answer's plus
the next-token loss of the whole sequence (``lm_loss_weight=1``).

Models (``model=``): ``decoder``, an ``lhc.lm.Transformer`` of 4 layers, width 128 (4
heads of 32, SwiGLU 256, RoPE); ``gca``, GCA of width 64 (2 lower layers, a 1-layer chunk
encoder, 2 upper layers, 32-token chunks, top-4 retrieval, a 65-token window); ``mamba2``,
2 Mamba-2 layers of width 64. Batch 8, ``steps`` (default 3000). Add ``runlocal`` for a
smoke test of a few steps.
"""

import ml_collections

from lhc.gca.config import GCAConfig
from lhc.lm.config import LMConfig
from lhc.recurrent.config import Mamba2Config
from lhc.train.config import base_config, model_section, parse_arg
from lhc.train.optim import adamw_cosine

_MODELS = {
    "decoder": (
        "transformer",
        dict(
            vocab_size=259,
            num_layers=4,
            embed_dim=128,
            num_heads=4,
            num_kv_heads=4,
            head_dim=32,
            mlp_dim=256,
            max_len=1 << 17,
            tie_embeddings=True,
        ),
    ),
    "gca": (
        "lhc.gca:GCA",
        dict(
            vocab_size=260,
            embed_dim=64,
            num_heads=2,
            num_kv_heads=2,
            head_dim=32,
            mlp_dim=128,
            lower_layers=2,
            encoder_layers=1,
            upper_layers=(2,),
            chunk_size=32,
            top_k=4,
            window=65,
        ),
    ),
    "mamba2": (
        "lhc.recurrent:Mamba2LM",
        dict(vocab_size=259, num_layers=2, embed_dim=64, head_dim=16, state_dim=16, chunk_size=64),
    ),
}


_CONFIG_CLASSES = {"decoder": LMConfig, "gca": GCAConfig, "mamba2": Mamba2Config}


def get_config(arg=None):
    arg = parse_arg(arg, model="decoder", steps=3000, runlocal=False)
    if arg.model not in _MODELS:
        raise ValueError(f"config arg model must be one of {sorted(_MODELS)}, got {arg.model!r}")
    factory, fields = _MODELS[arg.model]
    config = base_config("lhc.nolima.task:WorldTask")
    config.seed = 0
    config.num_steps = 10 if arg.runlocal else int(arg.steps)
    config.batch_size = 8
    config.eval_batches = 2
    config.log_every = 10
    config.checkpoint_every = 500
    config.world = ml_collections.ConfigDict(dict(regions=4, cities=3, landmarks=3, seed=0))
    config.data = ml_collections.ConfigDict(
        dict(
            length=512,
            min_length=128,
            decoy_rate=0.2,
            min_decoys=2,
            question_types=("onehop", "twohop", "direct"),
            lm_loss_weight=1.0,
        )
    )
    config.model_factory = factory
    config.model = model_section(_CONFIG_CLASSES[arg.model], **fields)
    config.optimizer = ml_collections.ConfigDict(adamw_cosine())
    return config
