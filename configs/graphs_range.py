r"""A GCN on a synthetic range task (``lhc.graphs.task``), its range tracked in training.

    lhc train --config configs/graphs_range.py:depth=4 --workdir /tmp/range/depth4

The paper's grid experiment: a 16x16 grid, scalar features x ~ N(0, 1), the node-level
label ``y = M x`` with ``M`` the 5th power of the symmetric-normalised adjacency with
self-loops (``operator=power``, ``k=5``, ``interaction=copy``), a GCN with skip
connections of ``depth`` layers (width 64). Here: batch 32 fresh feature draws, 1000
steps, AdamW at 3e-3 (2% warm-up, cosine to 20%), seed 0; every 100 steps the held-out
MSE and the four range variants of the model and of the task on 4 feature draws. Add
``runlocal`` for a smoke test (a 4x4 grid, 4 steps). For a graph-level task
(``graph_level=True``, e.g. ``interaction=l2``) set ``activation=gelu``: the Hessian of a
ReLU network is zero almost everywhere, and so would be its range.
"""

import ml_collections

from lhc.train.config import base_config, parse_arg
from lhc.train.optim import adamw_cosine


def get_config(arg=None):
    arg = parse_arg(
        arg,
        depth=4,
        layer="gcn",
        width=64,
        operator="power",
        k=5,
        interaction="copy",
        graph_level=False,
        activation="relu",
        steps=1000,
        lr=3e-3,
        batch=32,
        runlocal=False,
    )
    config = base_config("lhc.graphs.task:RangeTask")
    config.seed = 0
    config.num_steps = 4 if arg.runlocal else int(arg.steps)
    config.batch_size = 4 if arg.runlocal else int(arg.batch)
    config.log_every = 2 if arg.runlocal else 50
    config.eval_every = 2 if arg.runlocal else 100
    config.checkpoint_every = 500
    side = 4 if arg.runlocal else 16
    config.data = ml_collections.ConfigDict(
        dict(
            graph="grid",
            rows=side,
            cols=side,
            operator=arg.operator,
            k=int(arg.k),
            interaction=arg.interaction,
            graph_level=bool(arg.graph_level),
            channels=1,
            eval_graphs=1 if arg.runlocal else 4,
            chunk_size=128,
        )
    )
    config.model = ml_collections.ConfigDict(
        dict(
            layer=arg.layer,
            num_layers=int(arg.depth),
            hidden_dim=int(arg.width),
            residual=True,
            activation=arg.activation,
        )
    )
    config.optimizer = ml_collections.ConfigDict(
        adamw_cosine(learning_rate=float(arg.lr), weight_decay=0.0)
    )
    return config
