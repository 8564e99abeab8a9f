r"""GCA, the paper's 128M setting, pre-trained on PG-19 (tfds ``pg19``) for a TPU slice.

    lhc compile --config configs/gca_pg19.py --topology v5p:2x2x2
    lhc train --config configs/gca_pg19.py --workdir gs://BUCKET/gca_pg19 \
        --config.data.data_dir=gs://BUCKET/tensorflow_datasets \
        --config.data.tokenizer=/path/to/gpt2/tokenizer.json

The official run (``scripts/pretrain_pg19.sh``, ``config/DRT/config_63.json``):
``GCAConfig.paper_128m`` (d 768, 12 heads of 64, 6 lower layers, a 2-layer chunk encoder,
6 upper layers in one retrieval group, 64-position chunks, top-8, window 512 = lhc's 513),
GPT-2 tokens with the landmark as id 50264, windows of 16380 text tokens (260 chunks),
batch 4 per GPU on 8 GPUs (32 here, data parallel), 60k steps, AdamW at 2e-3 with 2%
warm-up and cosine decay to 4e-4, betas (0.9, 0.95), weight decay 0.001, clipping 1.0,
bfloat16 compute. PG-19 must be prepared under ``data_dir`` beforehand
(``tfds build pg19``; nothing is downloaded by lhc), and GPT-2's ``tokenizer.json`` is a
file the user supplies.

``lhc compile --config configs/gca_pg19.py --topology v5p:2x2x2`` (8 chips, 4 windows of
16380 tokens per chip; compiled on a 2-core CPU host in 8 min 46 s, 2026-12-02, jax 0.10.2)
plans per chip: peak 91.08 GiB (arguments 1.63, outputs 1.63 aliased to them,
temporaries 89.45) and 63.2 TFLOP per step. A v5p chip is listed with 95 GB of HBM,
88.5 GiB if that means 10^9 bytes, which this peak exceeds; XLA compiled it without
complaint, so whether it fits is unverified until it runs on a v5p. GCA has no
rematerialisation option yet; the temporaries are activations of 16K-token windows
(their float32 logits over 50K tokens alone are 12.3 GiB a chip), so two windows per chip
(``--config.batch_size=16``, or 16 chips for a batch of 32) halve them.

Add ``runlocal`` for a CPU smoke test of the same wiring at toy sizes
(``--config.data.tfds_name`` / ``data_dir`` pointing at any prepared text dataset).
"""

import dataclasses

import ml_collections

from lhc.gca import GCAConfig
from lhc.gca.config import paper_optimizer
from lhc.train.config import base_config, parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, runlocal=False)
    config = base_config("text_lm")
    config.seed = 0
    config.num_steps = 60_000
    config.batch_size = 32
    config.eval_batches = 8
    config.log_every = 50
    config.checkpoint_every = 1000
    config.data = ml_collections.ConfigDict(
        dict(
            tfds_name="pg19",
            data_dir=None,
            feature="book_text",
            split="train",
            eval_split="validation",
            length=16_380,
            tokenizer="gpt2/tokenizer.json",
        )
    )
    model = GCAConfig.paper_128m(gca_impl="pallas", dtype="bfloat16", param_dtype="float32")
    if arg.runlocal:
        model = GCAConfig.tiny(vocab_size=260, landmark_id=259, max_len=1 << 16)
        config.num_steps, config.batch_size, config.eval_batches = 4, 2, 1
        config.data.length, config.data.tokenizer = 126, "bytes"
        config.data.feature = "text"
    config.model_factory = "lhc.gca:GCA"
    config.model = ml_collections.ConfigDict(dataclasses.asdict(model))
    config.optimizer = ml_collections.ConfigDict(paper_optimizer())
    return config
