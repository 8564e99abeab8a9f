r"""Decision Transformer or Decision Mixer on an offline dataset (``lhc.dm.task``).

    python -m lhc.dm.behaviour --env Hopper-v5 --out /tmp/d4rl --sac-steps 100000 \
        --dataset-steps 100000
    lhc train --config configs/dm_gym.py:data=/tmp/d4rl/hopper-medium.hdf5,env=Hopper-v5,model=dm \
        --workdir /tmp/dm/hopper-medium-dm

``model``: ``dt`` (the Decision Transformer), ``dm`` (Decision Mixer: routers on odd
layers, capacity predicted, the auxiliary predictor selecting at inference), ``dm_noaux``
(no auxiliary predictor: top-k selection at inference too) or ``dm_fixed`` (capacity
fixed at half the tokens). Sizes are the official Decision Transformer's gym settings
(3 layers, 1 head, width 128, K 20, dropout 0.1, AdamW 1e-4 with weight decay 1e-4,
warm-up, gradient clipping 0.25, batch 64), which the Decision Mixer's code starts from
at this scale; ``layers``, ``width``, ``heads``, ``context``, ``steps``, ``lr`` and
``batch`` override them. Rollouts every ``eval_every`` steps: ``episodes`` episodes
conditioned on ``target`` (default: the Decision Mixer's hopper 3600, halfcheetah 12000,
walker2d 5000; 0 otherwise, e.g. Pendulum's best possible return), returns scaled by
1000; ``results=FILE`` appends each rollout evaluation (every episode's return) to a
JSON-lines file. Add ``runlocal`` for a smoke test.
"""

import ml_collections

from lhc.train.config import base_config, parse_arg

TARGETS = {"hopper": 3600.0, "halfcheetah": 12000.0, "walker2d": 5000.0}
MODELS = {
    "dt": dict(router=False),
    "dm": dict(router=True, aux=True),
    "dm_noaux": dict(router=True, aux=False),
    "dm_fixed": dict(router=True, aux=True, fixed_capacity=0.5),
}


def get_config(arg=None):
    arg = parse_arg(
        arg,
        data="",
        env="",
        model="dt",
        target=0.0,
        rtg_scale=1000.0,
        layers=3,
        width=128,
        heads=1,
        context=20,
        dropout=0.1,
        steps=10000,
        lr=1e-4,
        batch=64,
        episodes=5,
        eval_every=2000,
        seed=0,
        runlocal=False,
        results="",
    )
    if arg.model not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {arg.model!r}")
    config = base_config("lhc.dm.task:DecisionTask")
    config.seed = int(arg.seed)
    config.num_steps = 4 if arg.runlocal else int(arg.steps)
    config.batch_size = 4 if arg.runlocal else int(arg.batch)
    config.log_every = 2 if arg.runlocal else 100
    config.eval_every = 0 if arg.runlocal else int(arg.eval_every)
    config.checkpoint_every = 2000
    target = float(arg.target) or TARGETS.get(str(arg.env).split("-")[0].lower(), 0.0)
    config.data = ml_collections.ConfigDict(
        dict(
            path=arg.data,
            env=arg.env,
            target_return=target,
            rtg_scale=float(arg.rtg_scale),
            max_ep_len=1000,
            eval_episodes=1 if arg.runlocal else int(arg.episodes),
            results=str(arg.results),
        )
    )
    model = dict(router=False, aux=True, fixed_capacity=None) | MODELS[arg.model]
    config.model = ml_collections.ConfigDict(
        dict(
            num_layers=2 if arg.runlocal else int(arg.layers),
            embed_dim=16 if arg.runlocal else int(arg.width),
            num_heads=1 if arg.runlocal else int(arg.heads),
            context=4 if arg.runlocal else int(arg.context),
            dropout=float(arg.dropout),
            **model,
        )
    )
    config.optimizer = ml_collections.ConfigDict(
        dict(
            name="adamw",
            learning_rate=float(arg.lr),
            warmup_fraction=0.1,
            schedule="constant",
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=1e-4,
            grad_clip_norm=0.25,
        )
    )
    return config
