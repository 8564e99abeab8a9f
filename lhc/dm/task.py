"""Decision Transformer / Decision Mixer training on an offline dataset, as a task of
``lhc train``, evaluated by conditioned rollouts.

The loss is the mean squared error of the predicted actions on the real (unpadded)
steps of DT windows (``SegmentSampler``), plus, for the Decision Mixer with its
auxiliary predictor, the predictor's cross-entropy against the top-k selections (its
input is detached, so this term trains the predictor alone; the released code gives it
a separate Adam at 1e-4, here it shares the run's optimizer). ``evaluate`` reports the
held-out action MSE, then rolls the model out ``eval_episodes`` times (seeds 0, 1, ...)
in ``env`` conditioned on ``target_return``: mean and standard deviation of the
returns, the D4RL normalised score where the environment has reference returns, and
the forward FLOPs per action (with the mean number of tokens each routed layer
selected).

Config keys: ``data`` (``path``: a D4RL HDF5 or npz file; ``env``: gymnasium id for
rollouts, empty for none; ``target_return``, ``rtg_scale``, ``max_ep_len``,
``eval_episodes``; ``results``: a JSON-lines file each rollout evaluation appends a
record to, with every episode's return and normalised score), ``model`` (``DMConfig`` fields except the state and action sizes,
which come from the data, plus ``aux``: select with the auxiliary predictor at
inference; False is the "no auxiliary predictor" ablation, which selects by top-k over
the window at inference too), ``batch_size``, ``seed``.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from lhc.dm import rollout as rollout_lib
from lhc.dm.config import DMConfig
from lhc.dm.data import REF_SCORES, SegmentSampler, load_dataset, normalized_score
from lhc.dm.model import DecisionModel, aux_loss, flops_per_action
from lhc.dm.report import model_name
from lhc.extras import require
from lhc.stats import append_records
from lhc.train.tasks import Task

gym = require("gymnasium", "dm")

_EVAL_SEED_OFFSET = 7_777_777


class DecisionTask(Task):
    def make_model(self):
        data = self.config.data
        self.dataset = load_dataset(str(data.path))
        fields = dict(self.config.model)
        self.use_aux = bool(fields.pop("aux", True))
        self.sampler = SegmentSampler(
            self.dataset,
            int(fields.get("context", 20)),
            rtg_scale=float(data.rtg_scale),
            max_ep_len=int(data.max_ep_len),
        )
        try:
            self.model_config = DMConfig.from_dict(
                dict(
                    fields,
                    state_dim=self.dataset.observations.shape[1],
                    action_dim=self.dataset.actions.shape[1],
                    max_ep_len=int(data.max_ep_len),
                )
            )
        except ValueError as error:
            raise ValueError(f"config.model: {error}") from error
        # The model acts in [-1, 1] (tanh); actions are divided by the environment's bounds.
        self.action_scale = np.ones(self.model_config.action_dim, np.float32)
        if str(data.get("env", "")):
            with gym.make(str(data.env)) as env:
                self.action_scale = np.asarray(env.action_space.high, np.float32)
        scaled = np.abs(self.dataset.actions / self.action_scale)
        if scaled.max() > 1 + 1e-5:
            raise ValueError(
                f"config.data.path: actions reach {scaled.max():.3g} times the bounds of "
                f"config.data.env={data.get('env', '')!r} (expected within [-1, 1]; name the "
                f"dataset's environment in config.data.env)"
            )
        return DecisionModel(self.model_config)

    @property
    def inference_selection(self) -> str:
        return "aux" if self.model_config.router and self.use_aux else "topk"

    def _make_batch(self, seed, index, rows):
        rng = np.random.default_rng([seed, index, rows.start])
        batch = self.sampler.sample(rng, len(rows))
        batch["actions"] = batch["actions"] / self.action_scale
        return batch

    def batch_spec(self, batch_size):
        cfg = self.model_config
        k = cfg.context
        return {
            "states": jax.ShapeDtypeStruct((batch_size, k, cfg.state_dim), jnp.float32),
            "actions": jax.ShapeDtypeStruct((batch_size, k, cfg.action_dim), jnp.float32),
            "rewards": jax.ShapeDtypeStruct((batch_size, k, 1), jnp.float32),
            "returns_to_go": jax.ShapeDtypeStruct((batch_size, k, 1), jnp.float32),
            "timesteps": jax.ShapeDtypeStruct((batch_size, k), jnp.int32),
            "mask": jax.ShapeDtypeStruct((batch_size, k), jnp.float32),
        }

    def init_params(self, rng):
        spec = self.batch_spec(1)
        zeros = {key: jnp.zeros(s.shape, s.dtype) for key, s in spec.items()}
        return self.model.init(rng, **self._inputs(zeros))["params"]

    def train_iterator(self, process_index, process_count):
        return self.indexed_iterator(self._make_batch, process_index, process_count)

    @staticmethod
    def _inputs(batch):
        return {key: batch[key] for key in ("states", "actions", "returns_to_go", "timesteps")} | {
            "mask": batch["mask"] > 0
        }

    def loss(self, params, batch, rng):
        return self._loss(params, batch, rng, float(self.model_config.dropout) == 0.0)

    def _loss(self, params, batch, rng, deterministic: bool):
        predicted, aux = self.model.apply(
            {"params": params},
            **self._inputs(batch),
            selection="topk",
            deterministic=deterministic,
            rngs={"dropout": rng},
        )
        weights = batch["mask"][..., None]
        count = jnp.maximum(weights.sum() * predicted.shape[-1], 1.0)
        mse = (((predicted - batch["actions"]) ** 2) * weights).sum() / count
        metrics = {"action_mse": mse}
        total = mse
        if aux["routers"]:
            valid = jnp.repeat(batch["mask"] > 0, 3, axis=1)
            selector = aux_loss(aux["routers"], valid)
            metrics["aux_loss"] = selector
            metrics["selected_fraction"] = jnp.mean(
                jnp.stack(
                    [info["topk"].sum() / jnp.maximum(valid.sum(), 1) for info in aux["routers"]]
                )
            )
            if self.use_aux:
                total = total + selector
        return total, metrics

    @functools.cached_property
    def _eval_batch(self):
        seed = int(self.config.seed) + _EVAL_SEED_OFFSET
        batch = self.sampler.sample(np.random.default_rng(seed), 256)
        batch["actions"] = batch["actions"] / self.action_scale
        return batch

    def rollouts(self, params, episodes: int, target_return: float) -> dict:
        data = self.config.data
        env = gym.make(str(data.env))
        policy = rollout_lib.make_policy(self.model, params, self.inference_selection)
        results = [
            rollout_lib.rollout(
                env,
                policy,
                target_return=target_return,
                context=self.model_config.context,
                state_mean=self.sampler.state_mean,
                state_std=self.sampler.state_std,
                rtg_scale=float(data.rtg_scale),
                max_ep_len=int(data.max_ep_len),
                seed=seed,
                action_scale=self.action_scale,
            )
            for seed in range(episodes)
        ]
        env.close()
        returns = np.asarray([r["episode_return"] for r in results])
        selected = None
        if results[0]["selected"]:
            selected = np.mean([r["selected"] for r in results], axis=0)
        metrics = {
            "returns": returns,
            "eval/return_mean": float(returns.mean()),
            "eval/return_std": float(returns.std()),
            "eval/length_mean": float(np.mean([r["length"] for r in results])),
            "eval/flops_per_action": flops_per_action(self.model_config, selected),
        }
        family = str(data.env).split("-")[0].lower()
        if family in REF_SCORES:
            scores = normalized_score(family, returns)
            metrics["eval/normalized_mean"] = float(np.mean(scores))
            metrics["eval/normalized_std"] = float(np.std(scores))
        if selected is not None:
            for index, count in enumerate(selected):
                metrics[f"eval/selected_tokens_{index}"] = float(count)
        return metrics

    def evaluate(self, params):
        batch = {k: jnp.asarray(v) for k, v in self._eval_batch.items()}
        _, metrics = self._loss(params, batch, jax.random.key(0), deterministic=True)
        result = {"eval/action_mse": float(metrics["action_mse"])}
        episodes = int(self.config.data.get("eval_episodes", 0))
        if str(self.config.data.get("env", "")) and episodes > 0:
            rollouts = self.rollouts(params, episodes, float(self.config.data.target_return))
            returns = rollouts.pop("returns")
            result.update(rollouts)
            if self.config.data.get("results"):
                self._record(result, returns)
        return result

    def _record(self, metrics: dict, returns: np.ndarray) -> None:
        """Appends this evaluation (every episode's return) to ``data.results``."""
        data = self.config.data
        family = str(data.env).split("-")[0].lower()
        record = dict(
            env=str(data.env),
            dataset=os.path.splitext(os.path.basename(str(data.path)))[0],
            model=model_name(self.config.model),
            seed=int(self.config.seed),
            steps=int(self.config.num_steps),
            target_return=float(data.target_return),
            returns=[round(float(r), 2) for r in returns],
            normalized=(
                [round(float(s), 3) for s in normalized_score(family, returns)]
                if family in REF_SCORES
                else None
            ),
            **{k.removeprefix("eval/"): v for k, v in metrics.items()},
        )
        append_records(str(data.results), [record])
