"""Causal language modelling on generated sequences (associative recall, copying).

The model comes from ``config.model_factory``: the name of a registered model
(``lhc.nn.config.register_model``; default ``DEFAULT_MODEL_FACTORY``, ``"transformer"``:
the ``lhc.lm.Transformer``), built from ``config.model``, the fields of its config; or
an import path ``"package.module:name"`` to a registered model class (``"pkg.mod:MyLM"``,
which needs no import beforehand) or to a function ``factory(config.model) ->
nn.Module``. The module follows the causal-LM protocol, ``logits, cache =
model.apply({"params": p}, tokens, positions)`` with ``tokens, positions: int32[B, T]``
and ``logits: float[B, T, V]``, so any causal LM (GCA, recurrent models) trains through
this task by pointing ``model_factory`` at its own model. The data come from
``lhc.data.synthetic``. The loss is next-token cross-entropy restricted to the positions
the generator marks (``weights``), so the chance level is known exactly.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.data import synthetic
from lhc.data.iterators import IndexedIterator, row_rngs, stack_rows
from lhc.nn.config import build_model, registered_models, registered_name
from lhc.parallel import batch_share, global_batch, zigzag_order
from lhc.train.tasks import Task, import_path

DEFAULT_MODEL_FACTORY = "transformer"

_GENERATORS = {
    "associative_recall": synthetic.associative_recall,
    "copy": synthetic.copy_task,
}


def weighted_cross_entropy(logits, targets, weights):
    """Mean next-token cross-entropy and accuracy over positions with weight 1.

    Args:
      logits: float32[B, T, V].
      targets: int32[B, T].
      weights: float32[B, T].

    Returns:
      ``(loss, accuracy, num_tokens)`` as float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    token_nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    num_tokens = jnp.maximum(weights.sum(), 1.0)
    loss = (token_nll * weights).sum() / num_tokens
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    accuracy = (correct * weights).sum() / num_tokens
    return loss, accuracy, weights.sum()


class CausalLMTask(Task):
    """Trains the causal LM that ``config.model_factory`` builds on ``config.data.name``.

    Config keys used: ``model_factory`` (optional: a registered model's name, or an
    import path ``"package.module:name"`` of a registered model class or a factory
    function; default ``DEFAULT_MODEL_FACTORY``), ``model`` (the fields of the model's
    config; for the default, those of ``lhc.lm.LMConfig``), ``data``
    (``name`` and the generator's keyword arguments), ``batch_size``, ``seed``,
    ``eval_batches``.

    The task uses the model only through the causal-LM protocol (``init`` and
    ``apply`` with ``tokens, positions``), never through its internals.
    """

    def _model_factory_path(self) -> str:
        return self.config.get("model_factory", DEFAULT_MODEL_FACTORY)

    def make_model(self):
        path = self._model_factory_path()
        if isinstance(path, str) and ":" not in path:
            if path not in registered_models():
                raise ValueError(
                    f"config.model_factory: unknown model {path!r}; expected a registered "
                    f"model ({', '.join(registered_models())}) or an import path "
                    f"'package.module:name'"
                )
            return build_model(path, self.config.model)
        factory = import_path(path, "config.model_factory")
        if registered_name(factory) is not None:
            return build_model(factory, self.config.model)
        if not callable(factory):
            raise ValueError(
                f"config.model_factory: {path!r} must name a function "
                f"model_config -> flax.linen.Module, got a {type(factory).__name__}"
            )
        model = factory(self.config.model)
        if not isinstance(model, nn.Module):
            got = f"the class {model.__name__}" if isinstance(model, type) else type(model).__name__
            raise ValueError(
                f"config.model_factory: {path!r} must return a flax.linen.Module instance, "
                f"got {got}"
            )
        return model

    def _generator_kwargs(self) -> dict:
        kwargs = dict(self.config.data)
        name = kwargs.pop("name")
        if name not in _GENERATORS:
            raise ValueError(f"config.data.name must be one of {sorted(_GENERATORS)}, got {name!r}")
        return kwargs

    def _make_batch(self, seed, index, rows):
        generator = _GENERATORS[self.config.data.name]
        kwargs = self._generator_kwargs()
        batch = stack_rows(lambda rng: generator(rng, 1, **kwargs), row_rngs(seed, index, rows))
        return self._laid_out(batch)

    def _laid_out(self, batch):
        """``batch`` in the token order of the mesh: with the sequence split over devices
        (a ``sequence`` mesh axis above 1), the zig-zag order that gives every device
        equal causal-attention work (``lhc.parallel.zigzag_order``; config
        ``sequence_layout="contiguous"`` keeps the order), every ``[B, T]`` array
        permuted alike and the tokens' ``positions`` added. The model masks attention by
        position and the loss sums over tokens, so the result is the same."""
        shards = dict(getattr(self.mesh, "shape", {})).get("sequence", 1)
        if shards == 1 or self.config.get("sequence_layout", "zigzag") != "zigzag":
            return batch
        length = batch["tokens"].shape[1]
        order = zigzag_order(length, shards)
        out = {
            k: v[:, order] if v.ndim == 2 and v.shape[1] == length else v for k, v in batch.items()
        }
        out["positions"] = np.broadcast_to(order.astype(np.int32), batch["tokens"].shape).copy()
        return out

    def _make_eval_batch(self, seed, index, rows):
        """Held-out batches: by default drawn as the training batches are."""
        return self._make_batch(seed, index, rows)

    def _iterator(
        self, seed: int, process_index: int, process_count: int, make_batch=None
    ) -> IndexedIterator:
        return self.indexed_iterator(
            make_batch or self._make_batch, process_index, process_count, seed
        )

    def _eval_iterator(self, process_index: int, process_count: int) -> IndexedIterator:
        eval_seed = int(self.config.seed) + 1_000_003  # a stream disjoint from training
        return self._iterator(eval_seed, process_index, process_count, self._make_eval_batch)

    def batch_spec(self, batch_size):
        example = self._make_batch(0, 0, range(1))
        return {
            name: jax.ShapeDtypeStruct((batch_size,) + value.shape[1:], value.dtype)
            for name, value in example.items()
        }

    def init_params(self, rng):
        spec = self.batch_spec(1)["tokens"]
        tokens = jnp.zeros(spec.shape, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(spec.shape[1], dtype=jnp.int32), spec.shape)
        output, variables = self.model.init_with_output(rng, tokens, positions)
        _check_protocol_output(output, tokens.shape, self._model_factory_path())
        return variables["params"]

    def train_iterator(self, process_index, process_count):
        return self._iterator(int(self.config.seed), process_index, process_count)

    def _logits(self, params, batch, rng=None):
        tokens = batch["tokens"]
        positions = batch.get("positions")
        if positions is None:
            positions = jnp.broadcast_to(
                jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape
            )
        # In training the model gets an rng stream "train" for whatever it draws only then
        # (GCA's Gumbel retrieval noise); a model without such noise ignores it.
        rngs = None if rng is None else {"train": rng}
        logits, _ = self.model.apply({"params": params}, tokens, positions, rngs=rngs)
        return logits

    def _forward_metrics(self, params, batch, rng=None):
        logits = self._logits(params, batch, rng)
        return weighted_cross_entropy(logits, batch["targets"], batch["weights"])

    def loss(self, params, batch, rng):
        loss, accuracy, _ = self._forward_metrics(params, batch, rng)
        return loss, {"accuracy": accuracy}

    def evaluate(self, params):
        """Loss and answer accuracy on ``config.eval_batches`` held-out batches."""
        iterator = self._eval_iterator(*batch_share(self.mesh, self.rules))
        step = jax.jit(self._forward_metrics)
        total_loss = total_correct = total_tokens = 0.0
        for _ in range(int(self.config.eval_batches)):
            batch = global_batch(next(iterator), self.mesh, self.rules)
            loss, accuracy, num_tokens = jax.device_get(step(params, batch))
            total_loss += float(loss) * float(num_tokens)
            total_correct += float(accuracy) * float(num_tokens)
            total_tokens += float(num_tokens)
        metrics = {
            "eval/loss": total_loss / total_tokens,
            "eval/accuracy": total_correct / total_tokens,
        }
        chance = chance_loss(self.config.data)
        if chance is not None:
            metrics["eval/chance_loss"] = chance
        return metrics


def _check_protocol_output(output, tokens_shape, path: str) -> None:
    """Raises ValueError unless ``output`` is ``(logits[B, T, V], cache)``."""
    if not (isinstance(output, tuple) and len(output) == 2):
        raise ValueError(
            f"config.model_factory: the model of {path!r} must return (logits, cache) "
            f"from apply(params, tokens, positions), got {type(output).__name__}"
        )
    logits = output[0]
    shape, dtype = getattr(logits, "shape", None), getattr(logits, "dtype", None)
    if (
        shape is None
        or len(shape) != 3
        or tuple(shape[:2]) != tuple(tokens_shape)
        or not jnp.issubdtype(dtype, jnp.floating)
    ):
        raise ValueError(
            f"config.model_factory: the model of {path!r} must return float logits "
            f"[B, T, V] with [B, T] = {tuple(tokens_shape)}, got shape {shape} of {dtype}"
        )


def chance_loss(data_config) -> float | None:
    """Cross-entropy of the best guess that ignores the context (uniform answers)."""
    name = data_config.get("name")
    if name == "associative_recall":
        return math.log(data_config.num_values)
    if name == "copy":
        return math.log(data_config.vocab_size - 1)
    return None
