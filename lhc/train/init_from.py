"""Where a fresh run's parameters come from: ``config.init_from``.

One key names the source: a pretrained model's name (``lhc.lm.pretrained_models``), a
Hugging Face directory, a ``.gguf`` file, or an lhc run as ``WORKDIR`` (its latest step)
or ``WORKDIR:STEP``. ``config.init_params_from``, which earlier configs recorded for a
run, is the same key. Resuming a run never reads the source again.

A checkpoint source also gives the model: every field of ``config.model`` left ``None``
is taken from the checkpoint's own config, read from its metadata, and the fields the
config sets (``max_len``, ``rope_scaling``, ``dtype``, ``scan_layers``...) override it;
the overrides that differ from the checkpoint are listed in the log and in
``WORKDIR/init_from.json``. ``config.data.tokenizer`` left empty becomes the run's copy
of the checkpoint's tokenizer, ``WORKDIR/tokenizer`` (written when the run starts), so
evaluation, generation and benches read the run's tokenizer. A checkpoint whose arrays
do not fit the resolved model is refused, naming them, before the workdir is touched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import ml_collections

from lhc.lm.checkpoints import (
    checkpoint_config,
    load_checkpoint,
    load_tokenizer,
    resolve_checkpoint,
)
from lhc.lm.config import LMConfig
from lhc.train import config as config_lib

log = logging.getLogger(__name__)

RECORD = "init_from.json"
# How the run computes, not what the model is: set by the run, never listed as overrides.
RUN_FIELDS = frozenset(
    ("dtype", "param_dtype", "scan_layers", "switch_layers", "kernel_layout", "remat_policy")
    + ("attention_impl",)
)
TOKENIZER_DIR = "tokenizer"


@dataclasses.dataclass(frozen=True)
class Source:
    """A resolved ``config.init_from``.

    Attributes:
        spec: as the config gives it.
        kind: ``"workdir"`` (an lhc run) or ``"checkpoint"`` (a name, a Hugging Face
            directory, a GGUF file).
        path: the run's directory, or the checkpoint's local path.
        step: the run's step (``None``: its latest); ``None`` for a checkpoint.
    """

    spec: str
    kind: str
    path: str
    step: int | None = None


def source_spec(config: ml_collections.ConfigDict) -> str | None:
    """``config.init_from`` (or its older name ``init_params_from``), or None.

    Raises:
        ValueError: both keys set to different sources.
    """
    given = {key: config.get(key) for key in ("init_from", "init_params_from") if config.get(key)}
    if len(set(given.values())) > 1:
        raise ValueError(
            f"config.init_from {given['init_from']!r} and config.init_params_from "
            f"{given['init_params_from']!r} name different sources; set one"
        )
    return str(next(iter(given.values()))) if given else None


def _is_run(path: str) -> bool:
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return True
    recorded = os.path.join(path, config_lib.RUN_CONFIG)
    if not os.path.isfile(recorded):
        return False
    with open(recorded) as f:
        try:
            return isinstance(json.load(f).get("config"), dict)
        except (json.JSONDecodeError, AttributeError):
            return False


def parse_source(spec: str) -> Source:
    """What ``spec`` names (see the module docstring).

    Raises:
        FileNotFoundError: neither an lhc run nor a checkpoint (the message lists the
            known model names).
    """
    head, _, tail = spec.rpartition(":")
    if head and tail.isdigit() and _is_run(head):
        return Source(spec, "workdir", head, int(tail))
    if os.path.isdir(spec) and _is_run(spec):
        return Source(spec, "workdir", spec)
    try:
        return Source(spec, "checkpoint", resolve_checkpoint(spec))
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"config.init_from {spec!r}: not an lhc run (WORKDIR or WORKDIR:STEP) and {error}"
        ) from None


def _recorded(workdir: str) -> ml_collections.ConfigDict | None:
    if not os.path.isfile(os.path.join(workdir, config_lib.RUN_CONFIG)):
        return None
    return config_lib.load_run_config(workdir)


def resolve(
    config: ml_collections.ConfigDict, workdir: str
) -> tuple[ml_collections.ConfigDict, list[str]]:
    """``(config, overrides)``: ``config`` with the model and tokenizer of a checkpoint
    source filled in (locked; the same object when there is nothing to fill) and
    ``"model.FIELD: checkpoint -> run"`` for every field the config sets to another
    value than the checkpoint's.

    A run that ``workdir`` already records with the same source takes the filled
    values from its ``config.json``: resuming reads nothing of the source.
    """
    spec = source_spec(config)
    model = config.get("model")
    empty = [
        key
        for key, value in (model.items() if isinstance(model, ml_collections.ConfigDict) else ())
        if value is None
    ]
    no_tokenizer = "data" in config and "tokenizer" in config.data and not config.data.tokenizer
    if spec is None or not (empty or no_tokenizer):
        return config, []
    recorded = _recorded(workdir)
    filled = ml_collections.ConfigDict(config.to_dict())
    if recorded is not None and source_spec(recorded) == spec:
        for key in empty:
            filled.model[key] = recorded.model[key]
        if no_tokenizer:
            filled.data.tokenizer = recorded.data.tokenizer
        filled.lock()
        return filled, _recorded_overrides(workdir)
    source = parse_source(spec)
    if source.kind == "workdir":  # an lhc run: its model is the config's own
        return config, []
    fields = {f.name: getattr(checkpoint_config(source.path), f.name) for f in _fields()}
    overrides = []
    for key in model.keys():
        if key not in fields:
            raise ValueError(f"config.model.{key}: not a field of lhc.lm.LMConfig")
        value = model[key]
        if value is None:
            filled.model[key] = _plain(fields[key])
        elif key not in RUN_FIELDS and _plain(value) != _plain(fields[key]):
            overrides.append(f"model.{key}: {_plain(fields[key])!r} -> {_plain(value)!r}")
    if no_tokenizer:
        filled.data.tokenizer = os.path.join(os.path.abspath(workdir), TOKENIZER_DIR)
    filled.lock()
    return filled, overrides


def _fields():
    return [f for f in dataclasses.fields(LMConfig) if f.init]


def _plain(value: Any) -> Any:
    """A config value as JSON holds it (tuples as lists, mappings as dicts)."""
    if isinstance(value, (ml_collections.ConfigDict,)):
        value = value.to_dict()
    if hasattr(value, "items"):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _recorded_overrides(workdir: str) -> list[str]:
    path = os.path.join(workdir, RECORD)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return list(json.load(f).get("overrides", []))


def load_params(source: Source, model_config: LMConfig, state_params: Any) -> Any:
    """The parameters of the checkpoint ``source`` in the layout and dtype of
    ``model_config``, placed like ``state_params`` (the run's freshly initialised ones).

    Raises:
        ValueError: the checkpoint's arrays do not fit ``model_config`` (from the
            format's loader, naming the tensors) or ``state_params`` (naming the arrays).
    """
    fields = {f.name: getattr(model_config, f.name) for f in _fields()}
    loaded = load_checkpoint(source.path, **fields)
    params = loaded.params
    expected = {
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state_params)
    }
    got = {
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    differ = [
        f"{key}: run {expected.get(key, '(absent)')}, checkpoint {got.get(key, '(absent)')}"
        for key in sorted(set(expected) | set(got))
        if expected.get(key) != got.get(key)
    ]
    if differ:
        raise ValueError(
            f"config.init_from {source.spec!r}: {len(differ)} arrays do not fit the run's "
            f"model, e.g. {'; '.join(differ[:3])}. Nothing was written"
        )
    shardings = jax.tree.map(lambda x: x.sharding, state_params)
    return jax.tree.map(
        lambda x, target, s: jax.device_put(x.astype(target.dtype), s),
        params,
        state_params,
        shardings,
    )


def record(source: Source, config: ml_collections.ConfigDict, workdir: str, overrides) -> None:
    """Writes ``WORKDIR/init_from.json`` (the source, its local path, the overrides)
    and, when the config reads the run's tokenizer, the checkpoint's tokenizer into
    ``WORKDIR/tokenizer``."""
    tokenizer = config.get("data", {}).get("tokenizer") if "data" in config else None
    run_tokenizer = os.path.join(os.path.abspath(workdir), TOKENIZER_DIR)
    if tokenizer == run_tokenizer and not os.path.isdir(run_tokenizer):
        load_tokenizer(source.path).save(run_tokenizer)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, RECORD), "w") as f:
        json.dump(
            {
                "init_from": source.spec,
                "path": os.path.abspath(source.path),
                "overrides": overrides,
            },
            f,
            indent=2,
        )
        f.write("\n")
    for line in overrides:
        log.info("init_from %s: %s", source.spec, line)
