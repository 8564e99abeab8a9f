"""The task interface and registry used by ``train_and_evaluate``.

A task supplies the model, its parameter initialisation, a checkpointable data
iterator of process-local batches, the loss and the evaluation. ``config.task`` names
it one way: the shared tasks of ``lhc.train`` by name (``"causal_lm"``, ``"passkey"``,
``"text_lm"``), a method's task by its import path (``"lhc.<method>.task:Class"``), so
a method package adds a task without editing ``lhc.train``, and ``lhc.train`` imports
only the method package it runs. Your own task may also be named by ``@register_task``
once its module is imported.

An import path that earlier runs recorded in their ``config.json`` keeps resolving
after its object moved (``MOVED_PATHS``), for tasks and model factories alike.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import Mesh

from lhc.data.iterators import DataIterator, IndexedIterator

# Shared tasks only; a method names its task in its config by import path.
_BUILTIN_TASKS = {
    "causal_lm": "lhc.train.causal_lm:CausalLMTask",
    "finetune": "lhc.train.finetune:FineTuneTask",
    "passkey": "lhc.train.passkey:PasskeyTask",
    "text_lm": "lhc.train.text_lm:TextLMTask",
}
# Recorded import path -> where that object is now (tasks and model factories).
MOVED_PATHS = {
    # The Transformer's and the recurrent LMs' factories, before the model registry.
    "lhc.train.causal_lm:transformer_from_config": "lhc.lm:Transformer",
    "lhc.lm.factories:transformer_from_config": "lhc.lm:Transformer",
    "lhc.recurrent.factories:mamba2_from_config": "lhc.recurrent:Mamba2LM",
    "lhc.recurrent.factories:gla_from_config": "lhc.recurrent:GLALM",
    # Every method's tasks in its task.py, the passkey task beside its data.
    "lhc.train.passkey_task:PasskeyTask": "lhc.train.passkey:PasskeyTask",
    "lhc.tabicl.pretrain:PretrainTask": "lhc.tabicl.task:PretrainTask",
    "lhc.emloc.manyshot:ManyShotTask": "lhc.emloc.task:ManyShotTask",
    "lhc.nolima.world:WorldTask": "lhc.nolima.task:WorldTask",
    "lhc.icl.classification:PretrainTask": "lhc.icl.task:PretrainTask",
    "lhc.icl.superposition:SuperpositionTask": "lhc.icl.task:SuperpositionTask",
}
_DOTTED_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_IMPORT_PATH = re.compile(rf"({_DOTTED_NAME}):({_DOTTED_NAME})")
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

    def indexed_iterator(
        self, make_batch, process_index: int, process_count: int, seed: int | None = None
    ) -> IndexedIterator:
        """``IndexedIterator(make_batch)`` over ``config.batch_size`` rows, seeded with
        ``seed`` (default ``config.seed``): what ``train_iterator`` returns for a task whose
        batches are a function of ``(seed, index, rows)``."""
        return IndexedIterator(
            make_batch,
            seed=int(self.config.seed) if seed is None else int(seed),
            batch_size=int(self.config.batch_size),
            process_index=process_index,
            process_count=process_count,
        )

    def loss(self, params, batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Scalar float32 loss and a dict of scalar metrics for one global batch."""
        raise NotImplementedError

    def evaluate(self, params) -> dict[str, float]:
        """Evaluation metrics of ``params`` (called on every process)."""
        return {}

    def init_carry(self, batch_size: int) -> Any:
        """What the loss carries from each training step to the next (for example the
        recurrent states of truncated backpropagation through time), for a global batch
        of ``batch_size``; None (the default) for a task that carries nothing.

        A pytree of arrays, boxed with logical axis names (``nn.LogicallyPartitioned``) where it
        should be sharded. It is part of the train state: checkpointed with it and
        restored on resume.
        """
        del batch_size
        return None

    def carried_loss(self, params, batch, rng: jax.Array, carry) -> tuple[jax.Array, tuple]:
        """``loss, (metrics, new_carry)`` for a task whose ``init_carry`` is not None;
        the trainer stops gradients through ``new_carry``. The default is ``loss`` with
        the carry unchanged."""
        loss, metrics = self.loss(params, batch, rng)
        return loss, (metrics, carry)


def register_task(name: str):
    """Class decorator: ``@register_task("my_task")`` makes ``config.task="my_task"`` work."""

    def decorator(cls):
        _REGISTRY[name] = cls
        return cls

    return decorator


def import_path(path: str, what: str) -> Any:
    """The object that an import path ``"package.module:name"`` points to.

    The module is imported; ``name`` may be dotted (``"module:Outer.inner"``).

    Args:
      path: the import path.
      what: the config key the path comes from (e.g. ``"config.model_factory"``); every
        error message starts with it.

    Returns:
      The object.

    Raises:
      ValueError: when ``path`` is not of the form ``"package.module:name"``, the module
        does not exist or fails to import for a missing dependency, or the module has
        no such attribute.
    """
    path = MOVED_PATHS.get(path, path) if isinstance(path, str) else path
    match = _IMPORT_PATH.fullmatch(path) if isinstance(path, str) else None
    if match is None:
        raise ValueError(f"{what}: expected an import path 'package.module:name', got {path!r}")
    module_name, attribute = match.groups()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise ValueError(
                f"{what}: no module {module_name!r} (from {path!r}); expected an "
                f"importable 'package.module:name'"
            ) from error
        raise ValueError(
            f"{what}: module {module_name!r} (from {path!r}) failed to import: {error}"
        ) from error
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ValueError(
                f"{what}: module {module_name!r} has no attribute {attribute!r} (from {path!r})"
            )
        value = getattr(value, part)
    return value


def get_task(name: str) -> type[Task]:
    """The task class that ``config.task`` names.

    Args:
      name: a registered task name (``"causal_lm"``, or a name given to
        ``@register_task`` in a module already imported) or an import path
        ``"package.module:Class"`` of a ``Task`` subclass.

    Returns:
      The ``Task`` subclass.

    Raises:
      ValueError: for an unknown name, a malformed path, a missing module or
        attribute, or an object that is not a ``Task`` subclass.
    """
    if not isinstance(name, str):
        raise ValueError(
            f"config.task: expected a task name or 'package.module:Class', "
            f"got {type(name).__name__} {name!r}"
        )
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN_TASKS:
        path = _BUILTIN_TASKS[name]
    elif ":" in name:
        path = name
    else:
        known = sorted(set(_REGISTRY) | set(_BUILTIN_TASKS))
        raise ValueError(
            f"config.task: unknown task {name!r}; expected one of the known tasks {known} "
            f"or an import path 'package.module:Class' of a lhc.train.Task subclass"
        )
    task = import_path(path, "config.task")
    if task is Task or not (isinstance(task, type) and issubclass(task, Task)):
        if task is Task:
            got = "lhc.train.Task itself"
        elif isinstance(task, type):
            got = f"the class {task.__name__}"
        else:
            got = f"an object of type {type(task).__name__}"
        raise ValueError(f"config.task: {path!r} must name a subclass of lhc.train.Task, got {got}")
    return task
