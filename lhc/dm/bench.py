"""Decision Transformer against Decision Mixer: actions per second and FLOPs per action.

For each model of ``--models`` (random weights, ``--seed``) and each batch of
``--batches`` environments: the rollout's per-step call (``lhc.dm.rollout.make_policy``'s
jitted forward pass, here over a batch of environments) on full windows of K steps
(3K tokens; ``lhc.dm.rollout.window`` of random episodes, so the layout, normalisation
and the unknown newest action are the rollout's), which returns the action at each
newest state token. Time: the fastest of ``--repeats`` calls after a compiling one,
the models and batches called in turn in every repeat (``bench.interleaved_best``);
actions per second count the batch. FLOPs per action: ``lhc.dm.flops_per_action`` (the
blocks' forward FLOPs on a full window; a routed block counted on the tokens it selected
in these calls, as if they were gathered, plus its router). The implementation masks a
routed layer's attention instead of gathering its tokens (the released semantics), so
the measured time does not fall with the selection: the FLOPs are what a gathered
implementation would spend. ``selected``: the fraction of the window's tokens that the
routed layers selected (their mean); on random weights it shows the initialised router,
not a trained one.

Models, selecting as ``lhc.dm.task`` does at inference (``configs/dm_gym.py``'s names):
``dt`` (no routers); ``dm`` (routers on the odd layers, selection by the auxiliary
predictor); ``dm_noaux`` (top-k over the window with the predicted capacity);
``dm_fixed`` (capacity fixed at half the tokens, which only training uses: it selects
by the auxiliary predictor like ``dm``, so on random weights its row is ``dm``'s; not
in the default list).

Sizes (``--size``):

* ``paper``: 6 layers, 4 heads, width 256, K 120 (360 tokens), capacity MLP 512: the
  defaults of the Decision Mixer's released code (ruthless-man/Decision-Mixer; the
  paper's runs go up to K 120, see ``experiments/dm/README.md``);
* ``gym``: 3 layers, 1 head, width 128, K 20: the Decision Transformer's gym settings
  (``configs/dm_gym.py``'s defaults), capacity MLP 512;
* ``tiny``: 2 layers, 1 head, width 16, K 4 (``configs/dm_gym.py``'s ``runlocal``),
  capacity MLP 16 (for tests; the small MLP keeps the router's cost in proportion to
  the block's).

Assumptions, not from the paper: Hopper's state and action sizes (11, 3), episodes of
up to 1000 steps (the D4RL gym environments'), windows ending at step 2K, normal
normalised states, uniform actions, rewards of about 3 per step and returns to go from
Hopper's target 3600 (scaled by 1000).

    lhc bench dm --batches 1,16
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench
from lhc.dm import rollout
from lhc.dm.config import DMConfig
from lhc.dm.model import DecisionModel, flops_per_action

STATE_DIM, ACTION_DIM = 11, 3  # Hopper
TARGET_RETURN, RTG_SCALE = 3600.0, 1000.0
# layers, heads, width, context K, capacity MLP width
SIZES = {
    "paper": (6, 4, 256, 120, 512),
    "gym": (3, 1, 128, 20, 512),
    "tiny": (2, 1, 16, 4, 16),
}
# name -> (DMConfig fields, selection at inference)
MODELS = {
    "dt": (dict(router=False), "topk"),
    "dm": (dict(router=True), "aux"),
    "dm_noaux": (dict(router=True), "topk"),
    "dm_fixed": (dict(router=True, fixed_capacity=0.5), "aux"),
}


def model_config(model: str, size: str) -> DMConfig:
    """The ``DMConfig`` of ``model`` (a name of ``MODELS``) at ``size``."""
    layers, heads, width, context, capacity_hidden = SIZES[size]
    return DMConfig(
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        context=context,
        embed_dim=width,
        num_layers=layers,
        num_heads=heads,
        capacity_hidden=capacity_hidden,
        **MODELS[model][0],
    )


def windows(config: DMConfig, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The rollout's inputs for ``batch`` random episodes at step ``2K``: full windows of
    ``K`` steps (``[batch, K, ...]``)."""
    rng = np.random.default_rng(seed)
    inputs = []
    for _ in range(batch):
        history = rollout.History.start(rng.normal(size=config.state_dim), TARGET_RETURN)
        for _ in range(2 * config.context):
            history.step(
                rng.uniform(-1, 1, config.action_dim),
                rng.normal(3.0, 1.0),
                rng.normal(size=config.state_dim),
            )
        inputs.append(
            rollout.window(
                history,
                config.context,
                state_mean=0.0,
                state_std=1.0,
                rtg_scale=RTG_SCALE,
                max_ep_len=config.max_ep_len,
                action_dim=config.action_dim,
            )
        )
    return {key: np.concatenate([w[key] for w in inputs]) for key in inputs[0]}


def _policy(model: DecisionModel, selection: str):
    """``make_policy``'s jitted call over a batch: ``(params, inputs) -> (actions [B, A],
    tokens selected per routed layer [B] each)``."""

    @jax.jit
    def act(params, inputs):
        actions, aux = model.apply({"params": params}, **inputs, selection=selection)
        return actions[:, -1], [info["selected"].sum(-1) for info in aux["routers"]]

    return act


def measure(
    models, size: str = "paper", batches=(1,), repeats: int = 3, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per model and batch: seconds per call, actions per second, parameters,
    FLOPs per action, tokens selected per routed layer (mean over the batch) and their
    mean fraction of the window (None for the Decision Transformer)."""
    calls, configs, parameters = {}, {}, {}
    for name in models:
        config = configs[name] = model_config(name, size)
        model = DecisionModel(config)
        example = {k: jnp.asarray(v) for k, v in windows(config, 1, seed).items()}
        params = nn.meta.unbox(model.init(jax.random.key(seed), **example)["params"])
        parameters[name] = sum(x.size for x in jax.tree.leaves(params))
        act = _policy(model, MODELS[name][1])
        for batch in batches:
            inputs = {k: jnp.asarray(v) for k, v in windows(config, batch, seed).items()}
            calls[name, batch] = functools.partial(act, params, inputs)
    best = bench.interleaved_best(calls, repeats)
    rows = []
    for (name, batch), call in calls.items():
        config = configs[name]
        _, selected = jax.device_get(call())
        counts = [float(np.mean(c)) for c in selected]
        rows.append(
            {
                "model": name,
                "selection": MODELS[name][1] if config.router else None,
                "batch": batch,
                "seconds": best[name, batch],
                "actions_per_s": batch / best[name, batch],
                "parameters": parameters[name],
                "flops_per_action": flops_per_action(config, counts if config.router else None),
                "selected_tokens": counts,
                "selected_fraction": float(np.mean(counts)) / config.num_tokens if counts else None,
            }
        )
    return rows


def table(rows) -> str:
    dt_flops = next((row["flops_per_action"] for row in rows if row["model"] == "dt"), None)
    shown = [
        {
            **row,
            "ms": 1e3 * row["seconds"],
            "mflops": row["flops_per_action"] / 1e6,
            "vs_dt": dt_flops and row["flops_per_action"] / dt_flops,
        }
        for row in rows
    ]
    return bench.markdown_table(
        [("model", "model"), ("selection", "selection"), ("batch", "batch"),
         ("ms / call", "ms", ".2f"), ("actions/s", "actions_per_s", ".1f"),
         ("parameters", "parameters", ","), ("MFLOPs / action", "mflops", ".2f"),
         ("FLOPs / DT's", "vs_dt", ".2fx"), ("selected", "selected_fraction", "%")],
        shown,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the table; returns the ``size``, its ``sizes`` and the
    ``rows``."""
    parser = bench.parser("dm", __doc__)
    parser.add_argument(
        "--models",
        type=bench.str_list,
        default=["dt", "dm", "dm_noaux"],
        help=f"of {', '.join(MODELS)}",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="paper")
    parser.add_argument(
        "--batches", type=bench.int_list, default=[1, 16], help="environments per call"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the fastest counts")
    parser.add_argument("--seed", type=int, default=0, help="weights and episodes")
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    layers, heads, width, context, capacity_hidden = SIZES[args.size]
    print(
        f"{args.size} size: layers {layers}, heads {heads}, width {width}, K {context} "
        f"({3 * context} tokens), capacity MLP {capacity_hidden}; state {STATE_DIM}, "
        f"action {ACTION_DIM}; random weights (seed {args.seed})\n"
    )
    rows = measure(args.models, args.size, args.batches, args.repeats, args.seed)
    print(table(rows))
    sizes = dict(
        layers=layers,
        heads=heads,
        width=width,
        context=context,
        capacity_hidden=capacity_hidden,
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
    )
    return bench.finish({"size": args.size, "sizes": sizes, "rows": rows}, args)
