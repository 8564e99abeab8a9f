"""Loading configs (``configs/<name>.py:arg``) and applying ``--config.key=value`` overrides."""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import json
import os
import pathlib

import ml_collections


def base_config(task: str) -> ml_collections.ConfigDict:
    """The run settings every experiment config starts from (one place for defaults).

    Experiment configs add ``num_steps``, ``batch_size``, ``model``, ``optimizer`` and
    their task's keys, and override what they need.
    """
    config = ml_collections.ConfigDict()
    config.task = task
    config.seed = 0
    config.log_every = 10  # train metrics every N steps (also the non-finite check)
    config.eval_every = 0  # 0: evaluate only at the end
    config.checkpoint_every = 200  # also saved at the end and on a preemption signal
    config.max_checkpoints_to_keep = 2
    config.async_checkpointing = True
    config.progress_bar = True
    # A fresh run may start from other parameters (fine-tuning): a pretrained model's
    # name, a Hugging Face directory, a .gguf file, or another run as "WORKDIR" (its
    # latest step) or "WORKDIR:STEP" (lhc.train.init_from). The optimizer starts anew.
    # Ignored when resuming. init_params_from: the same key, as earlier runs recorded it.
    config.init_from = None
    config.init_params_from = None
    config.tensorboard = True
    # Throughput columns of the train rows (lhc.train.telemetry): train/mfu divides by
    # this peak FLOP/s of one device; None: a table by device kind (TPU v4/v5e/v5p/v6e,
    # H100, H200; bf16 dense), and no train/mfu column on another device.
    config.peak_flops = None
    # A jax.profiler trace of the steps a <= i < b (0-based) into WORKDIR/profile, e.g.
    # --config.profile_steps="(5,8)"; () traces nothing.
    config.profile_steps = ()
    # Mesh over all devices: data parallel by default; fsdp/tensor/sequence set per run,
    # e.g. --config.mesh_shape="(2,4,1,1)", or "(1,1,1,8)" to split each sequence over 8
    # devices (with --config.model.attention_impl=ring or allgather). One size may be -1;
    # a 3-tuple (as recorded before the sequence axis) leaves the sequence whole.
    config.mesh_axes = ("data", "fsdp", "tensor", "sequence")
    config.mesh_shape = (-1, 1, 1, 1)
    # None: lhc.parallel.LOGICAL_AXIS_RULES, or sequence_parallel_rules() when the mesh
    # splits the sequence.
    config.logical_axis_rules = None
    return config


def model_section(config_class, **values) -> ml_collections.ConfigDict:
    """``config.model`` for a model config class (``lhc.nn.config.ModelConfig``): a config
    file writes only what differs from the class's defaults, and the section holds every
    field (the defaults filled in, checked by the class), so ``--config.model.X=...``
    overrides any of them."""
    return ml_collections.ConfigDict(config_class.from_dict(values).to_dict())


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """Parses the string after the colon of ``--config file.py:arg``.

    ``arg`` is a comma-separated list of ``key=value`` or bare flags, e.g.
    ``"tiny"`` or ``"size=small,runlocal"``. A bare word that is not a key of
    ``defaults`` sets ``size`` when ``defaults`` has a ``size`` key; otherwise a bare
    word sets a boolean flag to True. Values are parsed with the type of the default.

    Returns:
      A ConfigDict with exactly the keys of ``defaults``.
    """
    result = ml_collections.ConfigDict(defaults)
    if not arg:
        return result
    for item in arg.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            key, value = item.split("=", 1)
        elif item in defaults and isinstance(defaults[item], bool):
            key, value = item, "True"
        elif "size" in defaults:
            key, value = "size", item
        else:
            raise ValueError(
                f"config arg {item!r} is not one of the known options {sorted(defaults)}"
            )
        if key not in defaults:
            raise ValueError(f"config arg key {key!r} is not one of {sorted(defaults)}")
        result[key] = _parse_value(value, defaults[key], f"config arg {key!r}")
    return result


def configs_dir() -> pathlib.Path:
    """The repository's ``configs/`` directory (beside the ``lhc`` package)."""
    return pathlib.Path(__file__).resolve().parents[2] / "configs"


def load_config(spec: str, overrides: list[str] | tuple[str, ...] = ()):
    """Loads ``path/to/config.py[:arg]`` and applies ``key=value`` overrides.

    Args:
      spec: a config file path, optionally followed by ``:arg`` passed to its
        ``get_config(arg)``. A bare file name (``"lm_assoc_recall.py:tiny"``) that is not
        in the working directory is looked up in the repository's ``configs/``.
      overrides: strings ``"a.b=value"`` (a leading ``--config.`` or ``config.`` is
        allowed).

    Returns:
      The locked ConfigDict.

    Raises:
      FileNotFoundError: when the config file does not exist.
      ValueError: for an unknown key or a value of the wrong type.
    """
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path) and os.path.dirname(path) in ("", "configs"):
        bundled = configs_dir() / os.path.basename(path)
        path = str(bundled) if bundled.is_file() else path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config: no config file at {path!r} (from {spec!r})")
    module_name = "lhc_config_" + pathlib.Path(path).stem
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"--config: {path!r} defines no get_config(arg=None)")
    config = module.get_config(arg or None)
    if not isinstance(config, ml_collections.ConfigDict):
        raise ValueError(
            f"--config: get_config of {path!r} must return an ml_collections.ConfigDict, "
            f"got {type(config).__name__}"
        )
    apply_overrides(config, overrides)
    config.lock()
    return config


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> None:
    """Applies ``key=value`` strings in place; unknown keys raise ValueError."""
    for override in overrides:
        text = override
        for prefix in ("--config.", "config."):
            if text.startswith(prefix):
                text = text[len(prefix) :]
        if "=" not in text:
            raise ValueError(f"config override {override!r} must look like key=value")
        dotted, value = text.split("=", 1)
        parent = config
        parts = dotted.split(".")
        for depth, name in enumerate(parts):
            known = list(parent.keys()) if isinstance(parent, ml_collections.ConfigDict) else []
            if name not in known:
                where = ".".join(parts[:depth]) or "the config"
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                raise ValueError(
                    f"config override {override!r}: unknown key {name!r} in {where}{hint} "
                    f"(known keys: {sorted(known)})"
                )
            if depth < len(parts) - 1:
                parent = parent[name]
        current = parent[parts[-1]]
        with config.unlocked() if config.is_locked else contextlib.nullcontext():
            parent[parts[-1]] = _parse_value(value, current, f"config override {dotted!r}")


def _parse_value(text: str, current, what: str):
    """Parses ``text`` into the type of ``current``."""
    if isinstance(current, ml_collections.ConfigDict):
        raise ValueError(f"{what}: cannot replace a whole sub-config with {text!r}")
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("1", "true", "yes"):
            return True
        if lowered in ("0", "false", "no"):
            return False
        raise ValueError(f"{what}: expected a boolean, got {text!r}")
    if isinstance(current, str):
        return text
    if current is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"{what}: expected a {type(current).__name__} like {current!r}, got {text!r}"
        ) from None
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(current, (list, tuple)) and not isinstance(value, (list, tuple)):
        raise ValueError(f"{what}: expected a sequence like {current!r}, got {text!r}")
    if not isinstance(current, (list, tuple)) and type(value) is not type(current):
        raise ValueError(
            f"{what}: expected a {type(current).__name__} like {current!r}, got {text!r}"
        )
    return value


# The resolved config of a run, recorded in its workdir ----------------------------------

RUN_CONFIG = "config.json"


def _tuples(value):
    """JSON lists back to the tuples that configs use for sequences."""
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value


def save_run_config(config: ml_collections.ConfigDict, workdir: str, command: str) -> str:
    """Writes ``workdir/config.json``: the resolved config and the command that made it.

    Returns:
      The file's path.

    Raises:
      ValueError: a config value that JSON cannot hold (the error names its key).
    """
    flat = flatten(config)
    for key, value in flat.items():
        try:
            json.dumps(value)
        except TypeError:
            raise ValueError(
                f"config key {key!r}: a {type(value).__name__} cannot be recorded in "
                f"{RUN_CONFIG}; configs hold numbers, strings, booleans, None and tuples"
            ) from None
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, RUN_CONFIG)
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump({"command": command, "config": config.to_dict()}, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(temporary, path)
    return path


def load_run_config(workdir: str, overrides=()) -> ml_collections.ConfigDict:
    """The config recorded by ``lhc train`` in ``workdir`` (``key=value`` overrides
    applied), locked.

    Raises:
      FileNotFoundError: ``workdir`` holds no ``config.json``.
      ValueError: the file is not a recorded config, or an override is bad.
    """
    path = os.path.join(workdir, RUN_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--workdir {workdir!r}: holds no {RUN_CONFIG} (written by `lhc train`); pass --config"
        )
    with open(path) as f:
        try:
            recorded = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path!r} is not valid JSON: {error}") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("config"), dict):
        raise ValueError(f"{path!r} holds no recorded config (expected a 'config' object)")
    config = ml_collections.ConfigDict(_tuples(recorded["config"]))
    apply_overrides(config, overrides)
    config.lock()
    return config


def flatten(config, prefix: str = "") -> dict:
    """``{"a.b": value}`` for every leaf of a (nested) ConfigDict or dict."""
    items = config.items() if hasattr(config, "items") else ()
    flat = {}
    for key, value in items:
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(recorded, given) -> list[str]:
    """``"key: recorded -> given"`` for every key whose values differ (or that only one
    of the two configs has), sorted by key."""
    a, b = flatten(recorded), flatten(given)
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, missing), b.get(key, missing)
        old, new = (tuple(v) if isinstance(v, list) else v for v in (old, new))
        if old != new:
            show = lambda v: "(absent)" if v is missing else repr(v)
            lines.append(f"{key}: {show(old)} -> {show(new)}")
    return lines


_COUNTS = {  # config key: the least value that makes sense
    "num_steps": 1,
    "batch_size": 1,
    "log_every": 1,
    "eval_every": 0,
    "checkpoint_every": 0,
    "eval_batches": 0,
}


def check_config(config: ml_collections.ConfigDict) -> None:
    """ValueError in one line unless ``config`` is a training config (it names a
    ``task`` and an ``optimizer``) whose counts make sense (``num_steps >= 1`` ...)."""
    missing = [key for key in ("task", "optimizer", "num_steps") if key not in config]
    if missing:
        raise ValueError(
            f"the config has no {', '.join(map(repr, missing))}: not a training config (one "
            f"that `lhc train` runs sets config.task, e.g. configs/lm_assoc_recall.py)"
        )
    for key, least in _COUNTS.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"config.{key}: expected an integer >= {least}, got {value!r}")
        if value is not None and value < least:
            raise ValueError(f"config.{key}: expected an integer >= {least}, got {value}")
    _check_profile_steps(config.get("profile_steps"))
    peak = config.get("peak_flops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))):
        raise ValueError(f"config.peak_flops: expected FLOP/s of one device or None, got {peak!r}")
    if peak is not None and not peak > 0:
        raise ValueError(f"config.peak_flops: expected FLOP/s of one device > 0, got {peak!r}")


def _check_profile_steps(value) -> None:
    """ValueError unless ``value`` is empty (None, ``()``) or two ints ``0 <= a < b``."""
    if value is None or (isinstance(value, (tuple, list)) and not value):
        return
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
        or not 0 <= value[0] < value[1]
    ):
        raise ValueError(
            f"config.profile_steps: expected () or two step indices (a, b) with "
            f"0 <= a < b, got {value!r}"
        )
