"""Training: the task registry, optimizers, Orbax checkpoints, metrics and the loop."""

from lhc.train.checkpoint import Checkpointer
from lhc.train.config import apply_overrides, base_config, load_config, parse_arg
from lhc.train.language_model import load_language_model
from lhc.train.metrics import MetricWriter, read_metrics
from lhc.train.optim import make_optimizer, make_schedule
from lhc.train.tasks import Task, get_task, register_task
from lhc.train.trainer import (
    Experiment,
    Interrupted,
    NonFiniteLossError,
    WorkdirError,
    build_experiment,
    evaluate,
    restore_params,
    train_and_evaluate,
)

__all__ = [
    "Checkpointer",
    "Experiment",
    "Interrupted",
    "MetricWriter",
    "NonFiniteLossError",
    "Task",
    "WorkdirError",
    "apply_overrides",
    "base_config",
    "build_experiment",
    "evaluate",
    "get_task",
    "load_config",
    "load_language_model",
    "make_optimizer",
    "make_schedule",
    "parse_arg",
    "read_metrics",
    "register_task",
    "restore_params",
    "train_and_evaluate",
]
