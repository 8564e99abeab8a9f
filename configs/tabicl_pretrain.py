r"""TabICL pretraining on the synthetic prior (MLP-SCM / tree-SCM mixture).

    lhc train --config configs/tabicl_pretrain.py:tiny --workdir /tmp/tabicl_tiny

Sizes (the part after the colon):
  tiny   a 4-block model (embed 32) on 16 tables of 128 rows and <= 10 features per
         step; a few minutes on a 2-core CPU (experiments/tabicl/README.md).
  paper  the published model (27M parameters) and stage of the curriculum, 512 tables
         per step: ``configs/tabicl_pretrain.py:paper,stage=2``. Stage 1: T = 1024,
         lr 1e-4, cosine with 2% warmup, 100K steps. Stage 2: T in [1K, 40K], train
         fraction 0.5-0.9, lr 2e-5 with polynomial decay (power 2) to 5e-6, 2K steps.
         Stage 3: T in [40K, 60K], lr 2e-6, column and row stages frozen, 50 steps.
         AdamW without weight decay, gradient clipping 1.0 throughout. Resume a stage
         from the previous stage's workdir by copying its checkpoint in.

Differences from the reference pretraining: in stages 2 and 3 the reference draws a row
count and train size per group and accumulates gradients over single-table micro
batches of different lengths; here every step's tables share one row count and train
size (one compiled shape per step), drawn from the same distributions. The train size
is rounded down to a multiple of ``prior.train_size_multiple`` to bound recompilation.
"""

import ml_collections

from lhc.tabicl import prior as prior_lib
from lhc.tabicl.config import TabICLConfig
from lhc.train.config import base_config, parse_arg


def _prior_fields(prior: prior_lib.PriorConfig, **changes) -> dict:
    fields = {
        name: getattr(prior, name) for name in prior.__dataclass_fields__ if name != "batch_size"
    }
    fields.update(changes)
    return fields


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", stage=1, runlocal=False)
    if arg.size not in ("tiny", "paper"):
        raise ValueError(f"config arg size must be 'tiny' or 'paper', got {arg.size!r}")
    stage = prior_lib.curriculum_stage(arg.stage)

    config = base_config("lhc.tabicl.task:PretrainTask")

    if arg.size == "tiny":
        config.num_steps = 400
        config.batch_size = 16
        config.eval_tables = 64
        config.model = ml_collections.ConfigDict(
            TabICLConfig(
                embed_dim=32,
                col_num_blocks=1,
                col_num_inds=16,
                row_num_blocks=1,
                row_nhead=4,
                icl_num_blocks=2,
            ).to_dict()
        )
        config.prior = ml_collections.ConfigDict(
            _prior_fields(
                prior_lib.PriorConfig(),
                num_rows=128,
                max_features=10,
                tables_per_group=4,
                train_size_multiple=16,
            )
        )
        learning_rate, schedule, warmup, end_fraction, power = 1e-3, "cosine", 0.05, 0.0, 1.0
        frozen = ()
    else:
        config.num_steps = stage.num_steps
        config.batch_size = stage.prior.batch_size
        config.eval_tables = 512
        config.model = ml_collections.ConfigDict(TabICLConfig().to_dict())  # the paper's model
        config.prior = ml_collections.ConfigDict(
            _prior_fields(
                stage.prior,
                rows_per_group=False,
                row_multiple=None if stage.prior.min_rows is None else 1024,
                train_size_multiple=64,
            )
        )
        learning_rate = stage.learning_rate
        schedule = {
            "cosine_warmup": "cosine",
            "polynomial_decay": "polynomial",
            "constant": "constant",
        }[stage.schedule]
        warmup = stage.warmup_fraction
        end_fraction = stage.end_learning_rate / stage.learning_rate
        power = stage.decay_power
        names = {"col": "col_embedder", "row": "row_interactor"}
        frozen = tuple(names[part] for part in stage.frozen)

    if arg.runlocal:
        config.num_steps = 10
        config.eval_tables = 8

    config.optimizer = ml_collections.ConfigDict(
        dict(
            name="adamw",
            learning_rate=learning_rate,
            warmup_steps=None,
            warmup_fraction=warmup,  # of num_steps, as overridden
            schedule=schedule,
            end_lr_fraction=end_fraction,
            decay_power=power,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            grad_clip_norm=1.0,
            frozen=frozen,
        )
    )
    return config
