"""The task interface and registry used by ``train_and_evaluate``.

A task supplies the model, its parameter initialisation, a checkpointable data
iterator of process-local batches, the loss and the evaluation. Method packages
define their tasks and name them in ``_BUILTIN_TASKS`` (imported lazily, so
``lhc.train`` never imports a method package it does not run).
"""

from __future__ import annotations

import importlib
from typing import Any

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import Mesh

from lhc.data.iterators import DataIterator

_BUILTIN_TASKS = {
    "causal_lm": "lhc.train.causal_lm:CausalLMTask",
    "tabicl_pretrain": "lhc.tabicl.pretrain:PretrainTask",
}
_REGISTRY: dict[str, type[Task]] = {}


class Task:
    """Base class of trainable tasks. Subclasses override the methods below.

    Attributes:
      config: the full experiment ConfigDict.
      mesh: the device mesh the run uses (evaluation builds global batches on it).
      rules: the logical-axis rules.
      model: the linen module (built once in ``__init__``).
    """

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh, rules):
        self.config = config
        self.mesh = mesh
        self.rules = rules
        self.model = self.make_model()

    def make_model(self) -> nn.Module:
        raise NotImplementedError

    def batch_spec(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one *global* batch of ``batch_size`` examples."""
        raise NotImplementedError

    def init_params(self, rng: jax.Array) -> Any:
        """Parameters, still boxed with their logical axis names (``nn.Partitioned``)."""
        raise NotImplementedError

    def train_iterator(self, process_index: int, process_count: int) -> DataIterator:
        """This process's share (``batch_size // process_count`` rows) of each batch."""
        raise NotImplementedError

    def loss(self, params, batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Scalar float32 loss and a dict of scalar metrics for one global batch."""
        raise NotImplementedError

    def evaluate(self, params) -> dict[str, float]:
        """Evaluation metrics of ``params`` (called on every process)."""
        return {}


def register_task(name: str):
    """Class decorator: ``@register_task("my_task")`` makes ``config.task="my_task"`` work."""

    def decorator(cls):
        _REGISTRY[name] = cls
        return cls

    return decorator


def get_task(name: str) -> type[Task]:
    """The task class registered as ``name`` (importing its module if needed)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN_TASKS:
        module_name, class_name = _BUILTIN_TASKS[name].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    known = sorted(set(_REGISTRY) | set(_BUILTIN_TASKS))
    raise ValueError(f"config.task: unknown task {name!r}; known tasks: {known}")
