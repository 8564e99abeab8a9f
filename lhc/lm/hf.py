"""Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` /
``Gemma3ForCausalLM`` checkpoints (and the language model of
``Gemma3ForConditionalGeneration`` ones), without torch.

``load(path)`` reads ``config.json`` and ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``) from a local directory and returns an ``LMConfig`` and
parameters for ``lhc.lm.Transformer``; ``save(config, params, path)`` writes the same
format back, loadable by ``transformers``.

Weight layout (HF stores ``nn.Linear`` weights as ``[out, in]``)::

    model.embed_tokens.weight          [V, D]      -> embed/embedding          [V, D]
    model.layers.i.self_attn.q_proj    [N*H, D]    -> attention/query/kernel   [D, N, H]
    model.layers.i.self_attn.{k,v}_proj [K*H, D]   -> attention/{key,value}    [D, K, H]
    model.layers.i.self_attn.{q,k,v}_proj.bias     -> .../bias                 [N|K, H]
    model.layers.i.self_attn.o_proj    [D, N*H]    -> attention/out/kernel     [N, H, D]
    model.layers.i.mlp.{gate,up}_proj  [F, D]      -> mlp/{gate,up}/kernel     [D, F]
    model.layers.i.mlp.down_proj       [D, F]      -> mlp/down/kernel          [F, D]
    model.layers.i.input_layernorm     [D]         -> attention_norm/scale
    model.layers.i.post_attention_layernorm [D]    -> mlp_norm/scale

    Gemma 3 (four norms a block, each stored as ``scale - 1``, and per-head q/k norms):
    model.layers.i.input_layernorm             -> attention_norm/scale
    model.layers.i.post_attention_layernorm    -> post_attention_norm/scale
    model.layers.i.pre_feedforward_layernorm   -> mlp_norm/scale
    model.layers.i.post_feedforward_layernorm  -> post_mlp_norm/scale
    model.layers.i.self_attn.{q,k}_norm  [H]   -> attention/{query,key}_norm/scale
    model.norm.weight                  [D]         -> final_norm/scale
    lm_head.weight                     [V, D]      -> lm_head/kernel           [D, V]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from lhc.lm.config import LMConfig
from lhc.lm.hf_config import (  # noqa: F401 (lhc.lm.hf's API)
    SUPPORTED_ARCHITECTURES,
    config_from_hf,
    config_to_hf,
)
from lhc.lm.params import param_shardings, stack_layer_params, unstack_layer_params
from lhc.parallel.mesh import LOGICAL_AXIS_RULES

# Buffers some exporters write beside the weights; they are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def _numpy_dtype(dtype: Any) -> np.dtype:
    name = jnp.dtype(dtype).name
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# Tensors -----------------------------------------------------------------------------


def _layer_norms(config: LMConfig) -> dict[str, str]:
    """A block's norms: lhc module name -> Hugging Face module name. Gemma's
    ``post_attention_layernorm`` normalises the attention output; Llama's (and Qwen2's)
    the MLP input."""
    if config.post_norms:
        return {
            "attention_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm",
        }
    return {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def text_tensor_names(names) -> dict[str, str]:
    """Hugging Face name -> the name in a text-only model, of the language model's tensors
    of a ``Gemma3ForConditionalGeneration`` checkpoint (released: ``language_model.model.*``;
    saved by transformers 5: ``model.language_model.*``); the vision tower's and the
    projector's are left out."""
    renames = (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    out = {}
    for name in names:
        for old, new in renames:
            if name.startswith(old):
                out[name] = new + name[len(old) :]
        if name.startswith("lm_head."):
            out[name] = name
    return out


def _expected_shapes(config: LMConfig) -> dict[str, tuple[int, ...]]:
    d, v, f = config.embed_dim, config.vocab_size, config.mlp_dim
    qh, kvh = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        shapes.update(
            {prefix + f"{theirs}.weight": (d,) for theirs in _layer_norms(config).values()}
        )
        if config.qk_norm:
            shapes[prefix + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes.update(
            {
                prefix + "self_attn.q_proj.weight": (qh, d),
                prefix + "self_attn.k_proj.weight": (kvh, d),
                prefix + "self_attn.v_proj.weight": (kvh, d),
                prefix + "self_attn.o_proj.weight": (d, qh),
                prefix + "mlp.gate_proj.weight": (f, d),
                prefix + "mlp.up_proj.weight": (f, d),
                prefix + "mlp.down_proj.weight": (d, f),
            }
        )
        if config.qkv_bias:
            shapes.update(
                {
                    prefix + "self_attn.q_proj.bias": (qh,),
                    prefix + "self_attn.k_proj.bias": (kvh,),
                    prefix + "self_attn.v_proj.bias": (kvh,),
                }
            )
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def _check_tensors(config: LMConfig, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    expected = _expected_shapes(config)
    names = {n for n in shapes if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_embeddings:
        names.discard("lm_head.weight")  # some exporters write the tied copy too
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: tensors do not match the config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, expected {shape} "
                f"from config.json"
            )


def _from_linear(weight: np.ndarray, in_shape, out_shape, layout: str) -> np.ndarray:
    """An lhc kernel from an ``nn.Linear`` weight ``[out, in]`` (flattened axes)."""
    if layout == "out_in":
        return weight.reshape(*out_shape, *in_shape)  # the checkpoint's own layout
    return np.ascontiguousarray(weight.T).reshape(*in_shape, *out_shape)


def _to_linear(kernel: np.ndarray, num_in: int, layout: str) -> np.ndarray:
    """The ``nn.Linear`` weight ``[out, in]`` of an lhc kernel with ``num_in`` input axes."""
    kernel = np.asarray(kernel)
    if layout == "out_in":
        out_size = int(np.prod(kernel.shape[: kernel.ndim - num_in]))
        return kernel.reshape(out_size, -1)
    in_size = int(np.prod(kernel.shape[:num_in]))
    return kernel.reshape(in_size, -1).T


def params_from_hf(config: LMConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Parameters (numpy, ``scan_layers=False`` layout, ``config.param_dtype``) from HF tensors.

    With ``config.kernel_layout == "out_in"`` the weights keep the checkpoint's
    ``[out, in]`` layout (reshaped, not transposed).
    """
    _check_tensors(config, {k: v.shape for k, v in tensors.items()}, "checkpoint")
    dtype = _numpy_dtype(config.param_dtype)
    d, n, k, h, f = (
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.mlp_dim,
    )
    layout = config.kernel_layout

    def get(name):
        return np.asarray(tensors[name]).astype(dtype)

    def linear(name, in_shape, out_shape):
        return _from_linear(get(name), in_shape, out_shape, layout)

    params: dict[str, Any] = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": {"scale": get("model.norm.weight")},
    }
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attention = {
            "query": {"kernel": linear(prefix + "self_attn.q_proj.weight", (d,), (n, h))},
            "key": {"kernel": linear(prefix + "self_attn.k_proj.weight", (d,), (k, h))},
            "value": {"kernel": linear(prefix + "self_attn.v_proj.weight", (d,), (k, h))},
            "out": {"kernel": linear(prefix + "self_attn.o_proj.weight", (n, h), (d,))},
        }
        if config.qkv_bias:
            for ours, theirs, heads in (("query", "q", n), ("key", "k", k), ("value", "v", k)):
                attention[ours]["bias"] = get(prefix + f"self_attn.{theirs}_proj.bias").reshape(
                    heads, h
                )
        if config.qk_norm:
            attention["query_norm"] = {"scale": get(prefix + "self_attn.q_norm.weight")}
            attention["key_norm"] = {"scale": get(prefix + "self_attn.k_norm.weight")}
        norms = {
            ours: {"scale": get(prefix + f"{theirs}.weight")}
            for ours, theirs in _layer_norms(config).items()
        }
        params[f"layers_{layer}"] = {
            **norms,
            "attention": attention,
            "mlp": {
                "gate": {"kernel": linear(prefix + "mlp.gate_proj.weight", (d,), (f,))},
                "up": {"kernel": linear(prefix + "mlp.up_proj.weight", (d,), (f,))},
                "down": {"kernel": linear(prefix + "mlp.down_proj.weight", (f,), (d,))},
            },
        }
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": linear("lm_head.weight", (d,), (config.vocab_size,))}
    return params


def params_to_hf(config: LMConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF tensors (numpy, in the parameters' dtype) from parameters of either layer
    layout and either kernel layout (``config.kernel_layout``)."""
    if "layers" in params:
        params = unstack_layer_params(dict(params))
    as_np = lambda x: np.asarray(x)
    layout = config.kernel_layout
    tensors = {
        "model.embed_tokens.weight": as_np(params["embed"]["embedding"]),
        "model.norm.weight": as_np(params["final_norm"]["scale"]),
    }
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        p = params[f"layers_{layer}"]
        attention = p["attention"]
        for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v")):
            tensors[prefix + f"self_attn.{theirs}_proj.weight"] = _to_linear(
                attention[ours]["kernel"], 1, layout
            )
            if config.qkv_bias:
                tensors[prefix + f"self_attn.{theirs}_proj.bias"] = as_np(
                    attention[ours]["bias"]
                ).reshape(-1)
        tensors[prefix + "self_attn.o_proj.weight"] = _to_linear(
            attention["out"]["kernel"], 2, layout
        )
        for ours, theirs in _layer_norms(config).items():
            tensors[prefix + f"{theirs}.weight"] = as_np(p[ours]["scale"])
        if config.qk_norm:
            tensors[prefix + "self_attn.q_norm.weight"] = as_np(attention["query_norm"]["scale"])
            tensors[prefix + "self_attn.k_norm.weight"] = as_np(attention["key_norm"]["scale"])
        for name in ("gate", "up", "down"):
            tensors[prefix + f"mlp.{name}_proj.weight"] = _to_linear(
                p["mlp"][name]["kernel"], 1, layout
            )
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = _to_linear(params["lm_head"]["kernel"], 1, layout)
    tensors = {name: np.ascontiguousarray(t) for name, t in tensors.items()}
    _check_tensors(config, {k: v.shape for k, v in tensors.items()}, "params")
    return tensors


# Files -------------------------------------------------------------------------------


def stop_tokens(path: str | os.PathLike) -> tuple[int, ...]:
    """End-of-sequence ids of a checkpoint, for ``generate(..., stop_tokens=...)``.

    Read from ``generation_config.json`` when present, else ``config.json``
    (``eos_token_id``, an int or a list; Llama 3.1 instruct lists three).
    """
    path = os.fspath(path)
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


def _checkpoint_files(path: str) -> list[str]:
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(path, name)):
                raise FileNotFoundError(f"{index_path} lists {name}, which is not in {path}")
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, _SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    present = sorted(os.listdir(path))
    raise FileNotFoundError(
        f"no {_SINGLE_FILE} or {_INDEX_FILE} in {path} (found {present[:10]}); only "
        "safetensors checkpoints are supported"
    )


def _read_tensors(files: list[str], rename=None) -> dict[str, np.ndarray]:
    """The tensors of ``files``; with ``rename`` (names -> {kept name: new name}) only
    those it keeps, under their new names (the others are never read)."""
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safetensors.safe_open(file, framework="numpy") as f:
            names = list(f.keys())
            kept = {name: name for name in names} if rename is None else rename(names)
            for name, new_name in kept.items():
                if new_name in tensors:
                    raise ValueError(f"tensor {name!r} appears in more than one file ({file})")
                tensors[new_name] = f.get_tensor(name)
    return tensors


def load(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    **overrides: Any,
) -> tuple[LMConfig, dict[str, Any]]:
    """Loads a local Llama, Qwen2 or Mistral safetensors checkpoint.

    Args:
        path: directory with ``config.json`` and the safetensors file(s).
        dtype: compute and storage dtype of the returned config and parameters
            (``overrides`` may set ``param_dtype`` separately).
        mesh: if given, every parameter is placed with its logical sharding under
            ``rules`` (default ``lhc.parallel.LOGICAL_AXIS_RULES``), one at a time.
        rules: logical-axis rules for ``mesh``.
        **overrides: further ``LMConfig`` fields, e.g. ``scan_layers=True``,
            ``max_len=32768``, ``attention_impl="..."``.

    Returns:
        ``(config, params)``; parameters are jax arrays in the layout of
        ``config.scan_layers``.

    Raises:
        FileNotFoundError: no ``config.json`` or no safetensors checkpoint.
        ValueError: unsupported architecture or feature, tensors missing, unexpected or
            of the wrong shape for the config.
    """
    path = os.fspath(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(config_path) as f:
        hf_config = json.load(f)
    rename = None
    if "Gemma3ForConditionalGeneration" in (hf_config.get("architectures") or []):
        rename = text_tensor_names  # the language model only
    tensors = _read_tensors(_checkpoint_files(path), rename)
    return from_hf(hf_config, tensors, dtype, mesh=mesh, rules=rules, **overrides)


def from_hf(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, Any],
    dtype: Any = jnp.float32,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    **overrides: Any,
) -> tuple[LMConfig, dict[str, Any]]:
    """``(config, params)`` from a ``config.json`` dict and tensors with Hugging Face
    names (arrays, or objects that become arrays when numpy reads them, as
    ``lhc.lm.gguf``'s dequantized tensors do), placed on the devices one parameter at a
    time (sharded over ``mesh`` when given), so that the host holds each only until it
    is placed. ``load``'s arguments otherwise."""
    dtype_name = jnp.dtype(dtype).name
    config = config_from_hf(
        hf_config, **{"dtype": dtype_name, "param_dtype": dtype_name, **overrides}
    )
    params = params_from_hf(config, tensors)
    if config.scan_layers:
        params = stack_layer_params(params, config.num_layers, config.layer_period)  # on the host
    shardings = None
    if mesh is not None:
        shardings = param_shardings(config, mesh, LOGICAL_AXIS_RULES if rules is None else rules)
    return config, _to_devices(params, shardings)


def _to_devices(host: dict[str, Any], shardings: Any = None) -> dict[str, Any]:
    """Each leaf of nested dicts on devices (with its sharding, if given), in place and
    one transfer at a time, so that each host copy is freed before the next transfer
    (peak memory: the parameters once, not twice)."""
    for key in list(host):
        sharding = None if shardings is None else shardings[key]
        if isinstance(host[key], dict):
            _to_devices(host[key], sharding)
        else:
            host[key] = jax.block_until_ready(jax.device_put(host[key], sharding))
    return host


def save(
    config: LMConfig,
    params: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Writes ``config.json`` and safetensors file(s) that ``transformers`` loads.

    Args:
        config: the model's config (Qwen2 is written when it has q/k/v biases, else Llama).
        params: parameters in either layer layout; written in their own dtype.
        path: output directory (created if needed).
        max_shard_bytes: split the weights into ``model-0000i-of-0000n.safetensors``
            files of at most about this size plus ``model.safetensors.index.json``.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = params_to_hf(config, params)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f, indent=2, sort_keys=True)
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        safetensors.numpy.save_file(tensors, os.path.join(path, _SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for name in sorted(tensors):
        size = tensors[name].nbytes
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensors[name]
        shard_bytes += size
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.numpy.save_file(shard, os.path.join(path, file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    index = {
        "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
