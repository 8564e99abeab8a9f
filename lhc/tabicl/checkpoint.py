"""Official TabICL checkpoints (``.ckpt``) and their Orbax conversion.

An official checkpoint is a torch pickle ``{"config": dict, "state_dict": {...}}`` of a
``tabicl.TabICL`` (0.1.4). ``load_checkpoint`` reads it into ``(TabICLConfig, params)``
for any config it contains; torch is imported only inside that function. A one-time
``convert_to_orbax`` writes the same ``(config, params)`` as an Orbax checkpoint that
``load_orbax`` reads back without torch.

Conversion (torch ``nn.Linear`` stores ``W: [out, in]``):

- a Dense kernel is ``W.T``;
- the packed ``in_proj_weight: [3E, E]`` splits into q, k, v along dim 0 and each becomes
  ``W.T.reshape(E, n, h)`` (heads are head-major); ``out_proj`` becomes
  ``W.T.reshape(n, h, E)``;
- LayerNorm ``weight`` is ``scale``;
- ``row_interactor.tf_row.rope.freqs`` is a frozen buffer that lhc recomputes from
  ``row_rope_base``; it is checked, not stored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from lhc.tabicl.config import TabICLConfig
from lhc.tabicl.model import abstract_params

ORBAX_CONFIG_FILE = "tabicl_config.json"
ORBAX_PARAMS_DIR = "params"
_FORMAT = "lhc.tabicl/v1"


# ----------------------------------------------------------------------------- layout


def expected_state_dict_shapes(config: TabICLConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the reference state dict of ``config`` and its shape."""
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(prefix: str, out_dim: int, in_dim: int):
        shapes[f"{prefix}.weight"] = (out_dim, in_dim)
        shapes[f"{prefix}.bias"] = (out_dim,)

    def layer_norm(prefix: str, width: int):
        shapes[f"{prefix}.weight"] = (width,)
        shapes[f"{prefix}.bias"] = (width,)

    def block(prefix: str, width: int):
        shapes[f"{prefix}.attn.in_proj_weight"] = (3 * width, width)
        shapes[f"{prefix}.attn.in_proj_bias"] = (3 * width,)
        linear(f"{prefix}.attn.out_proj", width, width)
        linear(f"{prefix}.linear1", width * config.ff_factor, width)
        linear(f"{prefix}.linear2", width, width * config.ff_factor)
        layer_norm(f"{prefix}.norm1", width)
        layer_norm(f"{prefix}.norm2", width)

    width, icl_width = config.embed_dim, config.icl_dim
    linear("col_embedder.in_linear", width, 1)
    for i in range(config.col_num_blocks):
        prefix = f"col_embedder.tf_col.blocks.{i}"
        shapes[f"{prefix}.ind_vectors"] = (config.col_num_inds, width)
        block(f"{prefix}.multihead_attn1", width)
        block(f"{prefix}.multihead_attn2", width)
    linear("col_embedder.out_w", width, width)
    linear("col_embedder.out_b", width, width)
    if config.norm_first:
        layer_norm("col_embedder.ln_w", width)
        layer_norm("col_embedder.ln_b", width)

    shapes["row_interactor.cls_tokens"] = (config.row_num_cls, width)
    for i in range(config.row_num_blocks):
        block(f"row_interactor.tf_row.blocks.{i}", width)
    shapes["row_interactor.tf_row.rope.freqs"] = (width // config.row_nhead // 2,)
    if config.norm_first:
        layer_norm("row_interactor.out_ln", width)

    for i in range(config.icl_num_blocks):
        block(f"icl_predictor.tf_icl.blocks.{i}", icl_width)
    if config.norm_first:
        layer_norm("icl_predictor.ln", icl_width)
    linear("icl_predictor.y_encoder", icl_width, config.max_classes)
    linear("icl_predictor.decoder.0", 2 * icl_width, icl_width)
    linear("icl_predictor.decoder.2", config.max_classes, 2 * icl_width)
    return shapes


def _rope_inverse_frequencies(config: TabICLConfig) -> np.ndarray:
    head_dim = config.embed_dim // config.row_nhead
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return np.float32(1.0) / (np.float32(config.row_rope_base) ** exponents)


def _refuse_keys(keys: list[str], shapes: Mapping, what: str, shape_name: str, label: str):
    """A ValueError when there are ``keys``: ``what`` is wrong with the state dict, the
    first key with its shape (``shapes``), and up to 8 of them as ``label``."""
    if keys:
        raise ValueError(
            f"checkpoint state_dict {what}, first {keys[0]!r} ({shape_name} "
            f"{shapes[keys[0]]}); {label}: {keys[:8]}"
        )


def state_dict_to_params(config: TabICLConfig, state_dict: Mapping[str, Any]) -> dict:
    """Converts a reference state dict (numpy or torch tensors) to lhc's parameter tree.

    Raises:
        ValueError: a missing or unexpected key, a shape that differs from the one the
            config implies (the message names the key, the expected and the found
            shape), a non-finite value, or rope frequencies that do not follow
            ``row_rope_base``.
    """
    expected = expected_state_dict_shapes(config)
    found = {key: _to_numpy(key, value) for key, value in state_dict.items()}
    missing = [key for key in expected if key not in found]
    what = f"is missing {len(missing)} tensor(s) the config needs"
    _refuse_keys(missing, expected, what, "expected shape", "missing")
    unexpected = [key for key in found if key not in expected]
    what = f"has {len(unexpected)} tensor(s) the config does not define"
    found_shapes = {key: value.shape for key, value in found.items()}
    _refuse_keys(unexpected, found_shapes, what, "shape", "unexpected")
    for key, shape in expected.items():
        if found[key].shape != shape:
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {found[key].shape}, expected {shape} "
                f"for the config in the checkpoint"
            )
        if not np.all(np.isfinite(found[key])):
            raise ValueError(f"checkpoint tensor {key!r} contains NaN or inf values")
    freqs = found["row_interactor.tf_row.rope.freqs"]
    want = _rope_inverse_frequencies(config)
    if not np.allclose(freqs, want, rtol=1e-5, atol=0.0):
        raise ValueError(
            "checkpoint tensor 'row_interactor.tf_row.rope.freqs' does not match "
            f"row_rope_base={config.row_rope_base}: expected {want}, found {freqs}"
        )

    def dense(prefix: str) -> dict:
        return {"kernel": found[f"{prefix}.weight"].T, "bias": found[f"{prefix}.bias"]}

    def layer_norm(prefix: str) -> dict:
        return {"scale": found[f"{prefix}.weight"], "bias": found[f"{prefix}.bias"]}

    def block(prefix: str, num_heads: int) -> dict:
        in_weight = found[f"{prefix}.attn.in_proj_weight"]
        in_bias = found[f"{prefix}.attn.in_proj_bias"]
        width = in_weight.shape[1]
        head_dim = width // num_heads
        attn = {}
        for index, name in enumerate(("query", "key", "value")):
            weight = in_weight[index * width : (index + 1) * width]
            bias = in_bias[index * width : (index + 1) * width]
            attn[name] = {
                "kernel": weight.T.reshape(width, num_heads, head_dim),
                "bias": bias.reshape(num_heads, head_dim),
            }
        attn["out"] = {
            "kernel": found[f"{prefix}.attn.out_proj.weight"].T.reshape(num_heads, head_dim, width),
            "bias": found[f"{prefix}.attn.out_proj.bias"],
        }
        return {
            "attn": attn,
            "norm1": layer_norm(f"{prefix}.norm1"),
            "norm2": layer_norm(f"{prefix}.norm2"),
            "linear1": dense(f"{prefix}.linear1"),
            "linear2": dense(f"{prefix}.linear2"),
        }

    col: dict[str, Any] = {
        "in_linear": dense("col_embedder.in_linear"),
        "out_w": dense("col_embedder.out_w"),
        "out_b": dense("col_embedder.out_b"),
    }
    for i in range(config.col_num_blocks):
        prefix = f"col_embedder.tf_col.blocks.{i}"
        col[f"blocks_{i}"] = {
            "ind_vectors": found[f"{prefix}.ind_vectors"],
            "multihead_attn1": block(f"{prefix}.multihead_attn1", config.col_nhead),
            "multihead_attn2": block(f"{prefix}.multihead_attn2", config.col_nhead),
        }
    row: dict[str, Any] = {"cls_tokens": found["row_interactor.cls_tokens"]}
    for i in range(config.row_num_blocks):
        row[f"blocks_{i}"] = block(f"row_interactor.tf_row.blocks.{i}", config.row_nhead)
    icl: dict[str, Any] = {
        "y_encoder": {
            "kernel": found["icl_predictor.y_encoder.weight"].T,
            "bias": found["icl_predictor.y_encoder.bias"],
        },
        "decoder_hidden": dense("icl_predictor.decoder.0"),
        "decoder_out": dense("icl_predictor.decoder.2"),
    }
    for i in range(config.icl_num_blocks):
        icl[f"blocks_{i}"] = block(f"icl_predictor.tf_icl.blocks.{i}", config.icl_nhead)
    if config.norm_first:
        col["ln_w"] = layer_norm("col_embedder.ln_w")
        col["ln_b"] = layer_norm("col_embedder.ln_b")
        row["out_ln"] = layer_norm("row_interactor.out_ln")
        icl["ln"] = layer_norm("icl_predictor.ln")
    params = {"col_embedder": col, "row_interactor": row, "icl_predictor": icl}
    params = jax.tree.map(lambda x: np.ascontiguousarray(x, dtype=np.float32), params)
    _check_against_model(config, params)
    return params


def params_to_state_dict(config: TabICLConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inverse of ``state_dict_to_params`` (numpy arrays; rope ``freqs`` recomputed)."""
    _check_against_model(config, params)
    params = jax.tree.map(np.asarray, params)
    state: dict[str, np.ndarray] = {}

    def dense(prefix: str, tree):
        state[f"{prefix}.weight"] = tree["kernel"].T
        state[f"{prefix}.bias"] = tree["bias"]

    def layer_norm(prefix: str, tree):
        state[f"{prefix}.weight"] = tree["scale"]
        state[f"{prefix}.bias"] = tree["bias"]

    def block(prefix: str, tree):
        attn = tree["attn"]
        width = attn["query"]["kernel"].shape[0]
        state[f"{prefix}.attn.in_proj_weight"] = np.concatenate(
            [attn[name]["kernel"].reshape(width, width).T for name in ("query", "key", "value")]
        )
        state[f"{prefix}.attn.in_proj_bias"] = np.concatenate(
            [attn[name]["bias"].reshape(width) for name in ("query", "key", "value")]
        )
        state[f"{prefix}.attn.out_proj.weight"] = attn["out"]["kernel"].reshape(width, width).T
        state[f"{prefix}.attn.out_proj.bias"] = attn["out"]["bias"]
        dense(f"{prefix}.linear1", tree["linear1"])
        dense(f"{prefix}.linear2", tree["linear2"])
        layer_norm(f"{prefix}.norm1", tree["norm1"])
        layer_norm(f"{prefix}.norm2", tree["norm2"])

    col, row, icl = params["col_embedder"], params["row_interactor"], params["icl_predictor"]
    dense("col_embedder.in_linear", col["in_linear"])
    for i in range(config.col_num_blocks):
        prefix = f"col_embedder.tf_col.blocks.{i}"
        state[f"{prefix}.ind_vectors"] = col[f"blocks_{i}"]["ind_vectors"]
        block(f"{prefix}.multihead_attn1", col[f"blocks_{i}"]["multihead_attn1"])
        block(f"{prefix}.multihead_attn2", col[f"blocks_{i}"]["multihead_attn2"])
    dense("col_embedder.out_w", col["out_w"])
    dense("col_embedder.out_b", col["out_b"])
    state["row_interactor.cls_tokens"] = row["cls_tokens"]
    for i in range(config.row_num_blocks):
        block(f"row_interactor.tf_row.blocks.{i}", row[f"blocks_{i}"])
    state["row_interactor.tf_row.rope.freqs"] = _rope_inverse_frequencies(config)
    for i in range(config.icl_num_blocks):
        block(f"icl_predictor.tf_icl.blocks.{i}", icl[f"blocks_{i}"])
    state["icl_predictor.y_encoder.weight"] = icl["y_encoder"]["kernel"].T
    state["icl_predictor.y_encoder.bias"] = icl["y_encoder"]["bias"]
    dense("icl_predictor.decoder.0", icl["decoder_hidden"])
    dense("icl_predictor.decoder.2", icl["decoder_out"])
    if config.norm_first:
        layer_norm("col_embedder.ln_w", col["ln_w"])
        layer_norm("col_embedder.ln_b", col["ln_b"])
        layer_norm("row_interactor.out_ln", row["out_ln"])
        layer_norm("icl_predictor.ln", icl["ln"])
    return {key: np.ascontiguousarray(value, np.float32) for key, value in state.items()}


def _to_numpy(key: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.float()
        value = value.numpy()
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"checkpoint tensor {key!r} has dtype {array.dtype}, expected floats")
    return array.astype(np.float32, copy=False)


def _flat_shapes(tree: Mapping[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    out = {}
    for name, value in tree.items():
        path = f"{prefix}/{name}" if prefix else name
        if isinstance(value, Mapping):
            out.update(_flat_shapes(value, path))
        else:
            out[path] = tuple(getattr(value, "shape", np.shape(value)))
    return out


def _check_shapes(want: Mapping[str, Any], got: Mapping[str, Any], source: str) -> None:
    """Raises ValueError unless the tree ``got`` has exactly the paths and shapes of ``want``.

    ``source`` names where ``got`` came from in the messages ("parameters", "Orbax
    checkpoint").
    """
    want, got = _flat_shapes(want), _flat_shapes(got)
    for path, shape in want.items():
        if path not in got:
            raise ValueError(f"{source}: parameter {path!r} is missing (expected shape {shape})")
        if got[path] != shape:
            raise ValueError(
                f"{source}: parameter {path!r} has shape {got[path]}, expected {shape}"
            )
    extra = sorted(set(got) - set(want))
    if extra:
        raise ValueError(f"{source}: parameters {extra[:8]} are not part of the model")


def _check_against_model(config: TabICLConfig, params: Mapping[str, Any]) -> None:
    """Raises ValueError unless ``params`` has exactly the tree and shapes of the model."""
    _check_shapes(nn.meta.unbox(abstract_params(config)), params, "parameters")


# ----------------------------------------------------------------------------- files


def load_checkpoint(path: str | os.PathLike) -> tuple[TabICLConfig, dict]:
    """Reads an official TabICL ``.ckpt`` into ``(config, params)``.

    Needs torch (imported here only). The file is read with ``weights_only=True``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable torch checkpoint, no ``config``/``state_dict``, an
            unknown config key, or a state dict that does not fit the config.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"TabICL checkpoint not found: {str(path)!r}")
    try:
        import torch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading an official .ckpt needs torch; convert it once with "
            "lhc.tabicl.convert_to_orbax where torch is installed"
        ) from err
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"could not read {str(path)!r} as a torch checkpoint: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(checkpoint, Mapping):
        raise ValueError(
            f"{str(path)!r} holds a {type(checkpoint).__name__}, expected a dict with "
            "'config' and 'state_dict'"
        )
    for key in ("config", "state_dict"):
        if key not in checkpoint:
            raise ValueError(
                f"{str(path)!r} has no {key!r} entry (found keys {sorted(checkpoint)})"
            )
    config = TabICLConfig.from_dict(checkpoint["config"])
    return config, state_dict_to_params(config, checkpoint["state_dict"])


def save_orbax(out_dir: str | os.PathLike, config: TabICLConfig, params: Mapping[str, Any]):
    """Writes ``(config, params)`` as ``out_dir/tabicl_config.json`` + Orbax ``out_dir/params``."""
    import orbax.checkpoint as ocp

    _check_against_model(config, params)
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    params_dir = out_dir / ORBAX_PARAMS_DIR
    if params_dir.exists():
        raise ValueError(f"{str(params_dir)!r} already exists; choose an empty out_dir")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(params_dir, jax.tree.map(np.asarray, dict(params)))
    checkpointer.wait_until_finished()
    with open(out_dir / ORBAX_CONFIG_FILE, "w") as f:
        json.dump({"format": _FORMAT, "config": config.to_dict()}, f, indent=2)


def convert_to_orbax(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """One-time conversion of an official ``.ckpt`` to an Orbax checkpoint directory."""
    config, params = load_checkpoint(ckpt_path)
    save_orbax(out_dir, config, params)
    return Path(out_dir).absolute()


def load_orbax(directory: str | os.PathLike, sharding=None) -> tuple[TabICLConfig, dict]:
    """Reads a checkpoint written by ``convert_to_orbax``/``save_orbax`` (no torch).

    Args:
        directory: the checkpoint directory.
        sharding: optional ``jax.sharding.Sharding`` for every parameter (e.g. replicated
            over a mesh); the default places them on the default device.

    Raises:
        FileNotFoundError: no such directory or no config/params inside.
        ValueError: a config that is not TabICL's, or stored shapes that do not fit it.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    config_file, params_dir = directory / ORBAX_CONFIG_FILE, directory / ORBAX_PARAMS_DIR
    if not config_file.is_file() or not params_dir.is_dir():
        raise FileNotFoundError(
            f"{str(directory)!r} is not an lhc TabICL Orbax checkpoint (needs "
            f"{ORBAX_CONFIG_FILE} and {ORBAX_PARAMS_DIR}/)"
        )
    try:
        with open(config_file) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"could not read {str(config_file)!r}: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or "config" not in meta:
        raise ValueError(f"{str(config_file)!r} is not an lhc TabICL config (format {_FORMAT})")
    config = TabICLConfig.from_dict(meta["config"])
    abstract = nn.meta.unbox(abstract_params(config))
    checkpointer = ocp.StandardCheckpointer()
    try:
        stored = checkpointer.metadata(params_dir).item_metadata.tree
    except Exception as err:
        raise ValueError(f"could not read Orbax metadata of {str(params_dir)!r}: {err}") from err
    _check_shapes(abstract, stored, f"Orbax checkpoint {str(params_dir)!r}")
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract
    )
    params = checkpointer.restore(params_dir, target)
    return config, params


def load_model(path: str | os.PathLike) -> tuple[TabICLConfig, dict]:
    """``load_orbax`` for a directory, ``load_checkpoint`` for a ``.ckpt`` file."""
    path = Path(path)
    if path.is_dir():
        return load_orbax(path)
    return load_checkpoint(path)
