"""``config.task`` and ``config.model_factory``: names, import paths and clear errors."""

import importlib
import math
import pathlib
import re

import jax
import ml_collections
import numpy as np
import pytest

from lhc import lm, train
from lhc.train import causal_lm, tasks
from lhc.train import config as config_lib

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = str(REPO / "configs" / "lm_assoc_recall.py")
FIXTURES = "_task_fixtures"

# Two steps of a small variant of the tiny config: mechanics, not learning.
FAST = [
    "num_steps=2",
    "batch_size=8",
    "log_every=1",
    "checkpoint_every=2",
    "eval_batches=1",
    "progress_bar=False",
    "tensorboard=False",
    "data.num_pairs=4",
    "data.num_queries=2",
    "model.max_len=11",
    "model.num_layers=1",
    "model.embed_dim=16",
    "model.head_dim=4",
    "model.mlp_dim=32",
]


@pytest.fixture(autouse=True)
def fixtures_importable(monkeypatch):
    """Makes ``tests/train/_task_fixtures.py`` importable as ``_task_fixtures``."""
    monkeypatch.syspath_prepend(str(HERE))


def _config(*overrides):
    return config_lib.load_config(CONFIG + ":tiny", list(FAST) + list(overrides))


def _task(config):
    return train.build_experiment(config).task


# config.task ---------------------------------------------------------------------------


def test_registered_name_and_path_give_the_same_class():
    by_name = train.get_task("causal_lm")
    by_path = train.get_task("lhc.train.causal_lm:CausalLMTask")
    assert by_name is by_path is causal_lm.CausalLMTask


def test_unregistered_task_is_reachable_by_path():
    import _task_fixtures

    task = train.get_task(f"{FIXTURES}:PathOnlyTask")
    assert task is _task_fixtures.PathOnlyTask
    assert task not in tasks._REGISTRY.values()


@pytest.mark.parametrize(
    "path",
    ["lhc.train.causal_lm:", ":CausalLMTask", "a:b:c", "lhc train:Task", "lhc.train.:Task", ":"],
)
def test_malformed_task_path(path):
    expected = re.escape(
        f"config.task: expected an import path 'package.module:name', got {path!r}"
    )
    with pytest.raises(ValueError, match=expected):
        train.get_task(path)


def test_task_that_is_not_a_string():
    with pytest.raises(ValueError, match="config.task: expected a task name .* got NoneType"):
        train.get_task(None)


def test_unknown_task_name_lists_the_known_and_the_path_form():
    with pytest.raises(ValueError, match="config.task: unknown task 'no_such_task'") as info:
        train.get_task("no_such_task")
    assert "'causal_lm'" in str(info.value)
    assert "'package.module:Class'" in str(info.value)


def test_task_path_to_a_missing_module():
    with pytest.raises(ValueError, match="config.task: no module 'lhc.no_such_module'"):
        train.get_task("lhc.no_such_module:Task")


def test_task_module_whose_dependency_is_missing(tmp_path, monkeypatch):
    (tmp_path / "_needs_a_missing_dependency.py").write_text("import lhc_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError,
        match="config.task: module '_needs_a_missing_dependency' .* failed to import: "
        "No module named 'lhc_no_such_dependency'",
    ):
        train.get_task("_needs_a_missing_dependency:Task")


def test_task_path_to_a_missing_attribute():
    with pytest.raises(
        ValueError, match="config.task: module 'lhc.train.causal_lm' has no attribute 'NoSuchTask'"
    ):
        train.get_task("lhc.train.causal_lm:NoSuchTask")


@pytest.mark.parametrize(
    "path, got",
    [
        (f"{FIXTURES}:NotATask", "the class NotATask"),
        ("lhc.train.causal_lm:weighted_cross_entropy", "an object of type function"),
        ("lhc.train.tasks:Task", "lhc.train.Task itself"),
    ],
)
def test_task_path_to_something_that_is_not_a_task(path, got):
    expected = f"config.task: {path!r} must name a subclass of lhc.train.Task, got {got}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        train.get_task(path)


@pytest.mark.parametrize("old, new", sorted(tasks.MOVED_PATHS.items()))
def test_a_recorded_path_resolves_to_where_its_object_moved(old, new):
    module, name = new.split(":")
    moved = getattr(importlib.import_module(module), name)
    assert tasks.import_path(old, "config.task") is moved
    assert old.split(":")[0] != module  # a move, not the same place


def test_a_moved_task_path_gives_the_moved_task():
    from lhc.tabicl.task import PretrainTask

    assert train.get_task("lhc.tabicl.pretrain:PretrainTask") is PretrainTask


# config.model_factory ------------------------------------------------------------------


def test_default_factory_is_the_lhc_transformer():
    explicit = _config()
    assert explicit.model_factory == causal_lm.DEFAULT_MODEL_FACTORY
    implicit = _config()
    with implicit.unlocked():
        del implicit["model_factory"]
    for config in (explicit, implicit):
        model = _task(config).model
        assert isinstance(model, lm.Transformer)
        assert model.config == lm.LMConfig(**config.model.to_dict())


@pytest.mark.parametrize(
    "factory",
    ["transformer", "lhc.lm:Transformer", "lhc.lm.factories:transformer_from_config"],
)
def test_the_transformer_by_name_by_class_and_by_the_recorded_factory_path(factory):
    config = _config(f"model_factory={factory}")
    model = _task(config).model
    assert type(model) is lm.Transformer
    assert model.config == lm.LMConfig(**config.model.to_dict())


def test_a_registered_class_path_builds_its_model_and_names_bad_fields():
    from lhc.recurrent import Mamba2Config, Mamba2LM

    config = _config("model_factory=lhc.recurrent:Mamba2LM")
    with config.unlocked():
        config.model = ml_collections.ConfigDict(dict(vocab_size=8, num_layers=1, embed_dim=16))
    model = _task(config).model
    assert type(model) is Mamba2LM
    assert model.config == Mamba2Config(vocab_size=8, num_layers=1, embed_dim=16)
    with config.unlocked():
        config.model.num_layer = 2
    with pytest.raises(ValueError, match="config.model: unknown .*'num_layer' .*'num_layers'"):
        _task(config)


def test_misspelled_factory_key_fails_on_the_locked_config():
    with pytest.raises(ValueError, match="unknown key 'model_factor'.*did you mean model_factory"):
        _config("model_factor=x:y")


@pytest.mark.parametrize(
    "path, message",
    [
        (
            "transformer_from_config",
            "unknown model 'transformer_from_config'; expected a registered",
        ),
        ("lhc.no_such_module:build", "no module 'lhc.no_such_module'"),
        ("lhc.train.causal_lm:no_such_factory", "has no attribute 'no_such_factory'"),
        (f"{FIXTURES}:NOT_CALLABLE", "must name a function model_config -> flax.linen.Module"),
        (f"{FIXTURES}:not_a_module", "must return a flax.linen.Module instance, got dict"),
        (f"{FIXTURES}:module_class", "must return a flax.linen.Module instance, got the class"),
    ],
)
def test_bad_model_factory(path, message):
    with pytest.raises(ValueError, match="config.model_factory: .*" + re.escape(message)):
        _task(_config(f"model_factory={path}"))


def test_factory_model_that_breaks_the_protocol():
    task = _task(_config(f"model_factory={FIXTURES}:logits_only_lm"))
    with pytest.raises(ValueError, match=r"config.model_factory: .* must return \(logits, cache\)"):
        task.init_params(jax.random.key(0))


def test_causal_lm_task_trains_a_model_from_another_factory(tmp_path):
    import _task_fixtures

    config = _config(f"model_factory={FIXTURES}:running_mean_lm")
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 2
    for key in ("train/loss", "eval/loss"):
        assert math.isfinite(summary[key]), (key, summary[key])

    _, params, step = train.restore_params(config, str(tmp_path))
    assert step == 2
    assert sorted(params) == sorted(_task_fixtures.RUNNING_MEAN_PARAMS)
    vocab, width = config.model.vocab_size, config.model.embed_dim
    assert params["token_embed"].shape == (vocab, width)
    assert params["readout"].shape == (width, vocab)


# Carry between steps -------------------------------------------------------------------


def test_the_carry_goes_from_step_to_step_and_survives_a_resume(tmp_path):
    config = _config(f"task={FIXTURES}:CarryingTask", "num_steps=2")
    task = _task(config)
    batches = task.train_iterator(0, 1)
    totals = np.cumsum([next(batches)["tokens"].sum() for _ in range(4)])

    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["train/carried_steps"] == 2
    assert summary["train/carried_total"] == totals[1]
    # Resumed to step 4: the carry comes back from the checkpoint, not from init_carry.
    summary = train.train_and_evaluate(
        _config(f"task={FIXTURES}:CarryingTask", "num_steps=4"), str(tmp_path)
    )
    assert summary["train/carried_steps"] == 4
    assert summary["train/carried_total"] == totals[3]
