"""Training: the task registry, optimizers, Orbax checkpoints, metrics and the loop;
reading a run back for evaluation and decoding (``lhc.train.runs``).

Each name is imported on first use, so reading a run (``load_language_model``,
``restore_params``) does not import the trainer, the optimizers or the metric writers.
"""

import importlib

# name -> the module of lhc.train that defines it.
_NAMES = {
    "Checkpointer": "checkpoint",
    "apply_overrides": "config",
    "base_config": "config",
    "load_config": "config",
    "parse_arg": "config",
    "MetricWriter": "metrics",
    "read_metrics": "metrics",
    "make_optimizer": "optim",
    "make_schedule": "optim",
    "Run": "runs",
    "build_run": "runs",
    "load_language_model": "runs",
    "restore_params": "runs",
    "Task": "tasks",
    "get_task": "tasks",
    "register_task": "tasks",
    "Experiment": "trainer",
    "Interrupted": "trainer",
    "NonFiniteLossError": "trainer",
    "WorkdirError": "trainer",
    "build_experiment": "trainer",
    "evaluate": "trainer",
    "train_and_evaluate": "trainer",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"lhc.train.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lhc.train' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
