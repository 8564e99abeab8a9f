"""Reading an lhc run for inference: its recorded config, its task and model, and the
parameters of one checkpoint, without the trainer, the optimizer or the metric writers.

    run, params, step = restore_params(None, "/tmp/assoc")   # the latest checkpoint
    logits, _ = run.task.model.apply({"params": params}, tokens, positions)

``load_language_model`` gives any language model, an imported checkpoint's or a run's,
as one ``lhc.lm.Checkpoint`` ready to decode (what ``lhc generate`` and the benches load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from lhc import parallel
from lhc.lm.checkpoints import Checkpoint, load_checkpoint
from lhc.lm.tokenizers import ByteTokenizer
from lhc.nn.lora import LoRA
from lhc.nn.lora import combine as lora_combine
from lhc.nn.lora import merge as lora_merge
from lhc.nn.lora import split as lora_split
from lhc.train import config as config_lib
from lhc.train.checkpoint import Checkpointer, UnreadableCheckpoint, restore_tree
from lhc.train.tasks import Task, get_task

log = logging.getLogger(__name__)

FROZEN_DIR = "frozen"  # an adapter run's frozen parameters, in its workdir


@dataclasses.dataclass
class Run:
    """What a run's parameters are read into and used with.

    Attributes:
      config: the experiment config.
      mesh: the device mesh.
      rules: logical-axis rules.
      task: the task instance (``task.model`` is the model).
    """

    config: ml_collections.ConfigDict
    mesh: Mesh
    rules: Any
    task: Task

    def abstract_params(self, init=None):
        """ShapeDtypeStructs of the parameters with their shardings (nothing allocated);
        of ``init(rng)``'s tree when given (default ``task.init_params``)."""
        rng = jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32)
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            boxed = jax.eval_shape(init or self.task.init_params, rng)
            shardings = parallel.logical_shardings(boxed, self.mesh, self.rules)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            parallel.unbox(boxed),
            shardings,
        )

    # Low-rank adapters (config.lora, lhc.nn.lora): the train state holds the adapters,
    # the model's own parameters stay frozen, saved once in WORKDIR/frozen.

    @property
    def lora(self) -> LoRA | None:
        return LoRA.from_config(self.config.get("lora"))

    def init_params(self, rng) -> tuple[Any, Any]:
        """``(trained, frozen)`` boxed parameters: the adapters and the model's own with
        ``config.lora``, else all of the task's and None.

        Raises:
          ValueError: ``lora.targets`` match no projection of the model.
        """
        lora = self.lora
        if lora is None:
            return self.task.init_params(rng), None
        with lora.applied():
            params = self.task.init_params(rng)
        frozen, adapters = lora_split(params)
        if not adapters:
            raise ValueError(
                f"config.lora.targets {list(lora.targets)}: match no projection of the model "
                f"(paths such as 'layers/attention/query', 'layers/mlp/down')"
            )
        return adapters, frozen

    def applying(self):
        """The context a model is applied in: its adapters added, when it has some."""
        lora = self.lora
        return contextlib.nullcontext() if lora is None else lora.applied()

    def model_params(self, trained, frozen) -> Any:
        """The tree the model is applied to (inside ``applying()``)."""
        return trained if frozen is None else lora_combine(frozen, trained)

    def merged_params(self, trained, frozen) -> Any:
        """Parameters of the plain model: the adapters folded into their kernels."""
        if frozen is None:
            return trained
        layout = getattr(getattr(self.task.model, "config", None), "kernel_layout", "in_out")
        return lora_merge(lora_combine(frozen, trained), self.lora, layout)


def build_run(config: ml_collections.ConfigDict, devices=None) -> Run:
    """Mesh, rules and task of ``config`` (on ``devices``, default all)."""
    config_lib.check_config(config)
    mesh = parallel.mesh_from_config(config, devices)
    rules = parallel.rules_from_config(config)
    return Run(config, mesh, rules, get_task(config.task)(config, mesh, rules))


def restore_params(
    config: ml_collections.ConfigDict | None,
    workdir: str,
    step: int | None = None,
    *,
    fallback: bool = False,
    merge_adapters: bool = True,
) -> tuple[Run, Any, int]:
    """Parameters of the checkpoint at ``step`` (latest when None) in ``workdir``.

    Only the parameters are read, so ``config`` may name another optimizer, batch size
    or number of steps than the run had; the model must be the same. ``config=None``
    takes the config the run recorded (``workdir/config.json``). With ``fallback`` and
    ``step=None``, an unreadable newest step gives way to the newest readable one.

    Returns:
      ``(run, params, step)``; for a run with ``config.lora``, ``params`` are the plain
      model's, its adapters folded into the frozen weights saved in ``workdir/frozen``
      (the adapters alone with ``merge_adapters=False``).

    Raises:
      FileNotFoundError: no checkpoint in ``workdir`` (or no recorded config).
      ValueError: the checkpoint is corrupt or does not match ``config``.
    """
    run = build_run(resolve_config(config, workdir))
    abstract = run.abstract_params(lambda rng: run.init_params(rng)[0])
    directory = os.path.join(workdir, "checkpoints")
    missing = (
        f"--workdir {workdir!r} holds no checkpoint (looked in {directory!r}); "
        f"train first with `lhc train`"
    )
    if not os.path.isdir(directory) and "://" not in directory:
        raise FileNotFoundError(missing)
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        if step is None and checkpointer.latest_step() is None:
            raise FileNotFoundError(missing)
        if step is not None:
            params, step = checkpointer.restore_params(step, abstract)
        else:
            params, step = _newest_params(checkpointer, abstract, fallback)
    finally:
        checkpointer.close()
    if run.lora is not None and merge_adapters:
        frozen = restore_tree(
            os.path.join(workdir, FROZEN_DIR),
            run.abstract_params(lambda rng: run.init_params(rng)[1]),
        )
        params = run.merged_params(params, frozen)
    return run, params, step


def _newest_params(checkpointer: Checkpointer, abstract, fallback: bool):
    """The parameters of the newest step, or with ``fallback`` of the newest readable
    one (each unreadable step said in a warning); otherwise an unreadable newest step
    is an error that names the earlier steps."""
    steps = sorted(checkpointer.all_steps(), reverse=True)
    for index, step in enumerate(steps):
        try:
            return checkpointer.restore_params(step, abstract)
        except UnreadableCheckpoint as error:
            earlier = steps[index + 1 :]
            if not (fallback and earlier):
                if not earlier:
                    raise
                hint = f"earlier steps: {earlier}: pass --step {earlier[0]} or --fallback"
                raise UnreadableCheckpoint(f"{error}; {hint}") from None
            log.warning("%s; evaluating step %d instead", error, earlier[0])
    raise AssertionError("unreachable: the loop returns or raises")


def resolve_config(
    config: ml_collections.ConfigDict | None, workdir: str
) -> ml_collections.ConfigDict:
    """``config``, or the one recorded in ``workdir`` when None. When both exist and
    differ, a warning lists the keys that differ (the given config is used)."""
    recorded_path = os.path.join(workdir, config_lib.RUN_CONFIG)
    if config is None:
        return config_lib.load_run_config(workdir)
    if os.path.isfile(recorded_path):
        differences = config_lib.config_differences(config_lib.load_run_config(workdir), config)
        if differences:
            log.warning(
                "the config differs from the one recorded in %s (recorded -> given):\n  %s",
                recorded_path,
                "\n  ".join(differences),
            )
    return config


def load_language_model(
    checkpoint: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    **overrides: Any,
) -> Checkpoint:
    """The model, parameters, tokenizer and stop tokens of ``checkpoint`` or ``workdir``.

    Args:
        checkpoint: a Hugging Face directory, a ``.gguf`` file or a name from
            ``lhc.lm.pretrained_models.MODELS`` (``lhc.lm.load_checkpoint``).
        workdir: an lhc run: its recorded config and the checkpoint at ``step`` (latest
            when None). The tokenizer is the task's (``task.tokenizer``), else bytes when
            the model reads at least the 259 byte ids.
        dtype, **overrides: for ``checkpoint`` only (``lhc.lm.load_checkpoint``).

    Raises:
        ValueError: both or neither of ``checkpoint`` and ``workdir``, overrides for a
            workdir (its model is the run's), or a run whose model does not read text.
        FileNotFoundError: the checkpoint or the run does not exist.
    """
    if (checkpoint is None) == (workdir is None):
        raise ValueError(
            f"give exactly one of checkpoint and workdir, got checkpoint={checkpoint!r} "
            f"workdir={workdir!r}"
        )
    if checkpoint is not None:
        return load_checkpoint(checkpoint, dtype=dtype, **overrides)
    if overrides or dtype is not None:
        raise ValueError(
            f"a workdir's model is the one it trained: dtype and overrides apply to imported "
            f"checkpoints only, got dtype={dtype!r} {sorted(overrides)}"
        )
    run, params, _ = restore_params(None, os.fspath(workdir), step)
    model = run.task.model
    tokenizer = getattr(run.task, "tokenizer", None)
    if tokenizer is None:
        tokenizer = ByteTokenizer()
        vocab = getattr(model.config, "vocab_size", 0)
        if vocab < tokenizer.vocab_size:
            raise ValueError(
                f"workdir {os.fspath(workdir)!r}: the run's task has no tokenizer and its "
                f"model reads {vocab} token ids, fewer than the {tokenizer.vocab_size} of "
                f"bytes: it is not a model of text"
            )
    stops = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    return Checkpoint(model, params, tokenizer, stops, os.fspath(workdir))
