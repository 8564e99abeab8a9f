"""``train_and_evaluate(config, workdir)``: the one training loop every task runs through.

Mesh -> task -> sharded state -> jitted step -> loop with checkpoints, metrics and
evaluation. Resuming is automatic: when ``workdir/checkpoints`` holds a step, the
state (parameters, optimizer, step, RNG) and the data-iterator position are restored
from it, so an interrupted run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from lhc import parallel
from lhc.lm.config import LMConfig
from lhc.train import config as config_lib
from lhc.train import init_from, telemetry
from lhc.train.checkpoint import (
    Checkpointer,
    UnreadableCheckpoint,
    array_paths,
    restore_tree,
    save_tree,
    state_differences,
)
from lhc.train.metrics import MetricWriter
from lhc.train.optim import make_optimizer
from lhc.train.runs import FROZEN_DIR, Run, build_run, restore_params

log = logging.getLogger(__name__)

# {"step": int32[], "params": ..., "opt_state": ..., "rng": uint32[2]}, and "carry" for a
# task whose init_carry is not None.
State = dict[str, Any]


class NonFiniteLossError(FloatingPointError):
    """Raised when the training loss becomes NaN or infinite."""


@dataclasses.dataclass
class Experiment(Run):
    """Everything a run is built from, before any step is taken: a ``Run`` (config,
    mesh, rules, task) and how it learns.

    Attributes:
      optimizer: the optax transformation.
      schedule: its learning-rate schedule.
      state_shardings: NamedShardings of the train state.
    """

    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: Any = None
    # With config.lora: the model's own parameters, outside the train state (and their
    # shardings); the state's params are the adapters.
    frozen: Any = None
    frozen_shardings: Any = None

    def init_fn(self):
        """``rng -> state`` with parameters still boxed by logical axis names (and, with
        adapters, the frozen parameters under ``"frozen"``, which ``_take_frozen``
        moves out)."""

        def init(rng):
            params_rng, state_rng = jax.random.split(rng)
            params, frozen = self.init_params(params_rng)
            state = {
                "step": jnp.zeros((), jnp.int32),
                "params": params,
                "opt_state": self.optimizer.init(params),
                "rng": state_rng,
            }
            carry = self.task.init_carry(int(self.config.batch_size))
            if carry is not None:
                state["carry"] = carry
            if frozen is not None:
                state["frozen"] = frozen
            return state

        return init

    def _take_frozen(self, state, shardings):
        """Moves ``"frozen"`` out of ``state`` and ``shardings`` into ``self``."""
        self.frozen = state.pop("frozen", None)
        self.frozen_shardings = shardings.pop("frozen", None)
        self.state_shardings = shardings
        return state

    @property
    def frozen_args(self) -> tuple:
        """The train step's arguments after the batch: the frozen parameters, if any."""
        return () if self.frozen is None else (self.frozen,)

    def evaluate_params(self, params) -> dict[str, float]:
        """The task's evaluation of the train state's ``params``."""
        with self.applying():
            return self.task.evaluate(self.model_params(params, self.frozen))

    def abstract_state(self):
        """ShapeDtypeStructs of the state with their shardings (no memory allocated)."""
        rng = jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32)
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            boxed = jax.eval_shape(self.init_fn(), rng)
            shardings = parallel.logical_shardings(boxed, self.mesh, self.rules)
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            parallel.unbox(boxed),
            shardings,
        )
        return self._take_frozen(abstract, shardings)

    def init_state(self, seed: int) -> State:
        rng = jax.random.key_data(jax.random.key(seed))
        state, shardings = parallel.sharded_init(self.init_fn(), self.mesh, self.rules, rng)
        return self._take_frozen(state, shardings)

    def abstract_batch(self):
        """ShapeDtypeStructs of one global batch with their shardings."""
        spec = self.task.batch_spec(int(self.config.batch_size))
        shardings = self.batch_shardings(spec)
        return {
            name: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[name])
            for name, s in spec.items()
        }

    def batch_shardings(self, batch_spec):
        return {
            name: parallel.batch_sharding(self.mesh, self.rules, len(spec.shape))
            for name, spec in batch_spec.items()
        }

    def train_step_fn(self):
        """The un-jitted ``(state, batch) -> (state, metrics)`` update."""
        task, optimizer, schedule = self.task, self.optimizer, self.schedule

        def train_step(state, batch, frozen=None):
            step_rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
            carry = state.get("carry")

            def loss_fn(params):
                params = self.model_params(params, frozen)
                with self.applying():
                    if carry is None:
                        loss, metrics = task.loss(params, batch, step_rng)
                        return loss, (metrics, None)
                    return task.carried_loss(params, batch, step_rng, carry)

            (loss, (metrics, carry)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"]
            )
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            metrics = dict(metrics)
            metrics["loss"] = loss
            metrics["grad_norm"] = optax.tree.norm(grads)
            metrics["learning_rate"] = schedule(state["step"])
            new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state)
            if carry is not None:
                new_state["carry"] = jax.lax.stop_gradient(carry)
            return new_state, metrics

        return train_step

    def jit_train_step(self):
        batch_spec = self.task.batch_spec(int(self.config.batch_size))
        frozen = () if self.frozen_shardings is None else (self.frozen_shardings,)
        return jax.jit(
            self.train_step_fn(),
            in_shardings=(self.state_shardings, self.batch_shardings(batch_spec), *frozen),
            out_shardings=(self.state_shardings, parallel.replicated(self.mesh)),
            donate_argnums=(0,),
        )


def check_workdir(workdir: str) -> None:
    """ValueError in one line unless ``workdir`` is a directory this process can write,
    or can be made one (``gs://`` and other remote paths are not checked)."""
    if "://" in workdir:
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r}: expected a directory, found a file")
    existing = workdir
    while not os.path.exists(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--workdir {workdir!r}: {existing!r} is not writable")


def build_experiment(config: ml_collections.ConfigDict, devices=None) -> Experiment:
    """Mesh, rules, task and optimizer for ``config`` (on ``devices``, default all)."""
    run = build_run(config, devices)
    optimizer, schedule = make_optimizer(config.optimizer, int(config.num_steps))
    return Experiment(run.config, run.mesh, run.rules, run.task, optimizer, schedule)


def _checkpointer(config, workdir: str) -> Checkpointer:
    return Checkpointer(
        os.path.join(workdir, "checkpoints"),
        save_interval_steps=int(config.get("checkpoint_every", 1000)),
        max_to_keep=config.get("max_checkpoints_to_keep", 3),
        async_save=bool(config.get("async_checkpointing", True)),
    )


_ADVICE = "lower optimizer.learning_rate, enable optimizer.grad_clip_norm, or check the data"


def _raise_if_non_finite(pending: list[tuple[int, Any, Any]]) -> None:
    """Checks buffered per-step ``(step, loss, grad_norm)``; names the first step whose
    loss (or gradient) is not finite."""
    if not pending:
        return
    values = jax.device_get([(loss, grad_norm) for _, loss, grad_norm in pending])
    for (step, _, _), (loss, grad_norm) in zip(pending, values):
        if not np.isfinite(loss):
            raise NonFiniteLossError(f"training loss is {float(loss)} at step {step}; {_ADVICE}")
        if not np.isfinite(grad_norm):
            raise NonFiniteLossError(
                f"gradient norm is {float(grad_norm)} at step {step} (loss {float(loss)}); "
                f"{_ADVICE}"
            )


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])) if leaves else True


def _check_before_save(pending: list, state: State, step: int) -> None:
    """Raises ``NonFiniteLossError`` unless every loss since the last check is finite and
    the state about to be saved holds finite values only."""
    _raise_if_non_finite(pending)
    pending.clear()
    if not bool(_all_finite({"params": state["params"], "opt_state": state["opt_state"]})):
        raise NonFiniteLossError(
            f"parameters or optimizer state are not finite after step {step} (the losses "
            f"were finite); not saving a checkpoint. {_ADVICE}"
        )


def _close_all(*closers, raise_errors: bool = True) -> None:
    """Calls every closer, even if one raises; re-raises the first error afterwards
    (unless ``raise_errors`` is False: an error is already on its way out)."""
    first = None
    for close in closers:
        try:
            close()
        except BaseException as error:  # noqa: BLE001 - each resource gets its close
            log.exception("error while closing the run")
            first = first or error
    if first is not None and raise_errors:
        raise first


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, command: str | None = None
) -> dict[str, Any]:
    """Trains ``config.task`` for ``config.num_steps`` steps in ``workdir``.

    Resumes from the latest checkpoint in ``workdir/checkpoints``; records the resolved
    config in ``workdir/config.json``; writes metrics to ``workdir/metrics.jsonl`` and
    ``workdir/tensorboard`` (process 0), dropping any rows of an interrupted run after the
    restored step; evaluates every ``config.eval_every`` steps and at the end.

    Every step's loss and gradient norm are checked before a checkpoint is saved, and the
    saved state must be finite, so no checkpoint holds a diverged run. However the loop
    ends (done, an error, an interrupt, a preemption signal), the save in flight is
    finished and the checkpointer and metric writers are closed.

    Args:
      config: the experiment config.
      workdir: the run's directory (local or ``gs://``).
      command: the command line recorded in ``config.json`` (default: this process's).

    Returns:
      The last logged train metrics and the final evaluation metrics, as floats.

    Raises:
      NonFiniteLossError: when the loss becomes NaN/inf (the message names the step).
    """
    check_workdir(workdir)  # the config is checked by build_experiment, before building
    parallel.maybe_initialize_distributed()
    config, overrides = init_from.resolve(config, workdir)
    exp = build_experiment(config)
    num_steps = int(config.num_steps)
    state = exp.init_state(int(config.seed))
    data = exp.task.train_iterator(*parallel.batch_share(exp.mesh, exp.rules))
    source = init_from.source_spec(config)
    fresh = "://" not in workdir and not os.path.isdir(os.path.join(workdir, "checkpoints"))
    if source is not None and fresh:  # refused here, before the workdir is written
        state = _init_params_from(exp, state, init_from.parse_source(source))
    checkpointer = _checkpointer(config, workdir)
    closers = [checkpointer.close]
    try:
        resumed = _restore_newest_readable(config, workdir, checkpointer, state)
        source = None if resumed else source
        if source is not None and not fresh:
            state = _init_params_from(exp, state, init_from.parse_source(source))
        if jax.process_index() == 0:  # only now: a refused start leaves the record as it was
            if source is not None:
                init_from.record(init_from.parse_source(source), config, workdir, overrides)
            config_lib.save_run_config(config, workdir, command or shlex.join(sys.argv))
        frozen_dir = os.path.join(workdir, FROZEN_DIR)
        if resumed is not None:
            latest, state, data_state = resumed
            data.set_state(data_state)
            if exp.frozen is not None:  # an adapter run's frozen weights, saved at its start
                abstract = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                    exp.frozen,
                )
                exp.frozen = restore_tree(frozen_dir, abstract)
            log.info("resumed from step %d in %s", latest, workdir)
        elif exp.frozen is not None:
            save_tree(frozen_dir, exp.frozen)
        start_step = int(jax.device_get(state["step"]))
        writer = MetricWriter(
            workdir, tensorboard=bool(config.get("tensorboard", True)), resume_step=start_step
        )
        closers.insert(0, writer.close)
        progress = tqdm.tqdm(
            total=num_steps,
            initial=start_step,
            disable=jax.process_index() != 0 or not config.get("progress_bar", True),
            desc=str(config.task),
        )
        closers.insert(0, progress.close)
        with _stop_on_signals() as received:
            profile_dir = os.path.join(workdir, telemetry.PROFILE_DIR)
            summary = _loop(
                exp, state, data, checkpointer, writer, progress, start_step, received, profile_dir
            )
    except BaseException:
        _close_all(*closers, raise_errors=False)  # the loop's error is the one to see
        raise
    _close_all(*closers)
    if received:
        raise Interrupted(received[0], summary["step"])
    return summary


class Interrupted(Exception):
    """Training stopped on SIGINT or SIGTERM, its checkpoint saved."""

    def __init__(self, signal_name: str, step: int):
        self.signal_name, self.step = signal_name, step
        super().__init__(
            f"{signal_name} at step {step}: checkpoint saved; run the same command to resume"
        )


@contextlib.contextmanager
def _stop_on_signals():
    """A list that the first SIGINT or SIGTERM appends its name to: the loop finishes
    its step, saves a checkpoint and stops. A second signal raises KeyboardInterrupt at
    once (the save in flight still finishes: ``train_and_evaluate`` closes the
    checkpointer on every way out, and a step directory is only complete once renamed).
    Only on a single host, from the main thread; with several processes the preemption
    notice of ``jax.distributed`` (SIGTERM on Cloud TPU VMs) is what Orbax's
    ``PreemptionCheckpointingPolicy`` reacts to (``Checkpointer.reached_preemption``)."""
    received: list[str] = []
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signal.Signals(signum).name)
        log.warning("%s: finishing the step, then saving a checkpoint", received[0])

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class WorkdirError(ValueError):
    """The workdir holds a run that this config cannot continue."""


def _restore_newest_readable(config, workdir: str, checkpointer: Checkpointer, state):
    """``(step, state, data_state)`` of the newest checkpoint step in ``workdir`` that
    restores, or None when there is none. A newer step that cannot be read is said in a
    warning and moved aside to ``checkpoints/<step>.unreadable`` (nothing is deleted),
    so the run continues from the step before it and can save that step number again.

    Raises:
      WorkdirError: a step written for another config (``_check_resumable``), or every
        step unreadable.
    """
    directory = checkpointer.directory
    unreadable, found = [], None
    for step in sorted(checkpointer.all_steps(), reverse=True):
        try:
            _check_resumable(config, workdir, checkpointer, step, state)
            found = (step, *checkpointer.restore(step, state))
            break
        except UnreadableCheckpoint as error:
            unreadable.append((step, error))
    if not unreadable:
        return found
    if found is None or "://" in directory:
        reasons = "; ".join(str(error) for _, error in unreadable)
        hint = "" if found is None else f"; move them aside to resume from step {found[0]}"
        raise WorkdirError(f"--workdir {workdir!r}: {reasons}. Nothing was changed there{hint}")
    for step, error in unreadable:
        aside = os.path.join(directory, f"{step}.unreadable")
        while os.path.exists(aside):
            aside += "_"
        if jax.process_index() == 0:
            os.rename(os.path.join(directory, str(step)), aside)
        log.warning("%s; moved to %s; resuming from step %d", error, aside, found[0])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("lhc: unreadable checkpoints moved aside")
    checkpointer.reload()
    return found


def _check_resumable(config, workdir: str, checkpointer: Checkpointer, step: int, state) -> None:
    """Refuses a resume whose config builds another train state than the one saved at
    ``step`` (compared on the checkpoint's metadata: every array's path and shape; a
    dtype may differ, restoring casts), naming the arrays and the config keys that
    differ from ``config.json``."""
    differences = state_differences(checkpointer.state_arrays(step), array_paths(state))
    differences.sort(key=lambda line: not line.startswith("params/"))  # the model's first
    if not differences:
        return
    changed = []
    if os.path.isfile(os.path.join(workdir, config_lib.RUN_CONFIG)):
        changed = config_lib.config_differences(config_lib.load_run_config(workdir), config)
    keys = f"; config keys that differ from its {config_lib.RUN_CONFIG}: {'; '.join(changed)}"
    raise WorkdirError(
        f"--workdir {workdir!r}: its checkpoint at step {step} holds another train state than "
        f"this config builds ({len(differences)} arrays differ, e.g. {differences[0]})"
        f"{keys if changed else ''}. Nothing was changed there. Resume with the run's own "
        f"config, or start a new run in another --workdir (to fine-tune from this one: "
        f"--config.init_from={workdir})"
    )


def _init_params_from(exp: Experiment, state, source: init_from.Source):
    """``state`` with the parameters of ``source`` (an lhc run's checkpoint, or a
    pretrained checkpoint in the run model's layout) and the optimizer state
    initialised for them; with adapters, ``exp.frozen`` takes them instead."""
    target = state["params"] if exp.frozen is None else exp.frozen
    if source.kind == "checkpoint":
        model_config = getattr(exp.task.model, "config", None)
        if not isinstance(model_config, LMConfig):
            raise ValueError(
                f"config.init_from {source.spec!r}: a pretrained checkpoint loads into an "
                f"lhc.lm.Transformer, the task's model is a {type(exp.task.model).__name__}"
            )
        params = init_from.load_params(source, model_config, target)
        log.info("parameters from %s (%s)", source.spec, source.path)
    else:
        params = _run_params(source, target)
    if exp.frozen is not None:
        exp.frozen = params
        return state
    opt_state = jax.jit(exp.optimizer.init, out_shardings=exp.state_shardings["opt_state"])(params)
    return dict(state, params=params, opt_state=opt_state)


def _run_params(source: init_from.Source, target):
    """The parameters of the lhc run ``source`` at its step (latest when None), placed
    like ``target``."""
    directory = os.path.join(source.path, "checkpoints")
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        if source.step is None and checkpointer.latest_step() is None:
            raise FileNotFoundError(
                f"config.init_from {source.spec!r} holds no checkpoint (looked in {directory!r})"
            )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        params, step = checkpointer.restore_params(source.step, abstract)
    finally:
        checkpointer.close()
    log.info("parameters from step %d of %s", step, source.path)
    return params


def _loop(
    exp, state, data, checkpointer, writer, progress, start_step, stop=(), profile_dir=None
) -> dict[str, Any]:
    """The steps from ``start_step`` on. Within a step the rows are written before its
    checkpoint, so a run resumed from a checkpoint has every row up to it. Once ``stop``
    is non-empty (a signal), the step in progress is saved and the loop ends. The train
    rows carry the throughput columns of ``lhc.train.telemetry``; ``config.profile_steps``
    traces steps into ``profile_dir``."""
    config = exp.config
    num_steps = int(config.num_steps)
    log_every = max(int(config.get("log_every", 10)), 1)
    eval_every = int(config.get("eval_every", 0))
    train_step = exp.jit_train_step()
    clock = telemetry.step_clock(exp, exp.task.batch_spec(int(config.batch_size)))
    profile_steps = config.get("profile_steps") or ()
    profiler = telemetry.Profiler(profile_steps, profile_dir or "profile", start_step)
    summary: dict[str, Any] = {}
    pending: list[tuple[int, Any, Any]] = []
    step = start_step
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules), contextlib.ExitStack() as done:
        done.callback(profiler.stop)  # a run that ends before the trace's last step
        while step < num_steps:
            batch = parallel.global_batch(next(data), exp.mesh, exp.rules)
            clock.exclude(profiler.before_step(step, state))
            if step == start_step:  # compiled and timed apart: train/compile_s
                state, metrics = clock.first_step(train_step, state, batch, exp.frozen_args)
            else:
                state, metrics = train_step(state, batch, *exp.frozen_args)
                clock.count()
            step += 1
            clock.exclude(profiler.after_step(step, state))
            pending.append((step, metrics["loss"], metrics["grad_norm"]))
            progress.update(1)
            waited = False  # for the device, after work that is no train step
            if step % log_every == 0 or step == num_steps:
                _raise_if_non_finite(pending)
                pending.clear()
                host_metrics = {f"train/{k}": float(v) for k, v in jax.device_get(metrics).items()}
                host_metrics.update(clock.row())
                writer.write(step, host_metrics)
                progress.set_postfix(loss=f"{host_metrics['train/loss']:.4f}")
                summary.update(host_metrics)
                waited = True
            if (eval_every and step % eval_every == 0) or step == num_steps:
                eval_metrics = exp.evaluate_params(state["params"])
                writer.write(step, eval_metrics)
                summary.update(eval_metrics)
                waited = True
            preempted = checkpointer.reached_preemption(step)
            if stop or preempted or step == num_steps or checkpointer.should_save(step):
                _check_before_save(pending, state, step)
                writer.flush()
                checkpointer.save(step, state, data.get_state(), force=True)
                waited = True
            if waited:
                clock.restart()
            if preempted:
                log.warning("preemption signal at step %d: checkpoint saved, stopping", step)
                break
            if stop:
                checkpointer.wait()
                if step not in checkpointer.all_steps():
                    raise RuntimeError(f"{stop[0]}: the checkpoint of step {step} was not written")
                break
        _raise_if_non_finite(pending)
        if start_step == num_steps:  # already complete: evaluate again, log nothing new
            summary.update(exp.evaluate_params(state["params"]))
    summary["step"] = step
    return summary


def evaluate(
    config: ml_collections.ConfigDict | None,
    workdir: str,
    step: int | None = None,
    *,
    fallback: bool = False,
) -> dict[str, Any]:
    """Restores the parameters of the latest (or ``step``) checkpoint and runs the task's
    evaluation; ``config=None`` evaluates with the config the run recorded; ``fallback``
    as ``restore_params``'s."""
    parallel.maybe_initialize_distributed()
    exp, params, restored_step = restore_params(config, workdir, step, fallback=fallback)
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules):
        metrics = exp.task.evaluate(params)
    metrics["step"] = restored_step
    return metrics
