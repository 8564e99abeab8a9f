"""A trained run back in the Hugging Face layout: ``lhc export --workdir RUN --out DIR``.

``export(workdir, out)`` writes the run's language model (``lhc.lm.Transformer``: Llama,
Qwen2, Mistral, Gemma 3 shapes) as ``config.json`` and safetensors (``lhc.lm.hf.save``)
with its tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat
template) and ``generation_config.json``, which ``transformers.AutoModelForCausalLM``
and ``AutoTokenizer`` load. A run with adapters (``config.lora``) is exported with
them merged into the weights, or with ``adapter=True`` as a PEFT LoRA directory
(``adapter_config.json``, ``adapter_model.safetensors``) to load over its base model
with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import safetensors.numpy

from lhc.lm import hf
from lhc.lm.config import LMConfig
from lhc.lm.params import unstack_layer_params
from lhc.train import init_from
from lhc.train.runs import restore_params

# lhc's module names of the adapted projections -> Hugging Face's.
HF_PROJECTIONS = {
    ("attention", "query"): "self_attn.q_proj",
    ("attention", "key"): "self_attn.k_proj",
    ("attention", "value"): "self_attn.v_proj",
    ("attention", "out"): "self_attn.o_proj",
    ("mlp", "gate"): "mlp.gate_proj",
    ("mlp", "up"): "mlp.up_proj",
    ("mlp", "down"): "mlp.down_proj",
}


def export(workdir: str, out: str, *, step: int | None = None, adapter: bool = False) -> list[str]:
    """Writes the run in ``workdir`` (checkpoint ``step``, latest when None) to ``out``.

    Returns:
        The files written.

    Raises:
        ValueError: the run's model is not an ``lhc.lm.Transformer``, or ``adapter``
            for a run without adapters.
        FileNotFoundError: no checkpoint.
    """
    run, params, step = restore_params(None, workdir, step, merge_adapters=not adapter)
    config = getattr(run.task.model, "config", None)
    if not isinstance(config, LMConfig):
        raise ValueError(
            f"--workdir {workdir!r}: its model is a {type(run.task.model).__name__}; lhc "
            f"export writes lhc.lm.Transformer models (Llama, Qwen2, Mistral, Gemma 3)"
        )
    os.makedirs(out, exist_ok=True)
    if adapter:
        if run.lora is None:
            raise ValueError(f"--adapter: the run in {workdir!r} has no adapters (config.lora)")
        written = _save_adapter(run, config, params, out, workdir)
    else:
        hf.save(config, jax.device_get(params), out)
        written = ["config.json", "model.safetensors"]
    tokenizer = getattr(run.task, "tokenizer", None)
    if hasattr(tokenizer, "save"):
        tokenizer.save(out)
        written += ["tokenizer.json", "tokenizer_config.json"]
        if tokenizer.eos_id is not None and not adapter:
            with open(os.path.join(out, "generation_config.json"), "w") as f:
                json.dump({"eos_token_id": tokenizer.eos_id}, f, indent=2)
            written.append("generation_config.json")
    return [os.path.join(out, name) for name in written]


def _save_adapter(run, config: LMConfig, adapters, out: str, workdir: str) -> list[str]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of PEFT's LoRA: per
    adapted projection ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` (lhc's ``A``
    and ``B`` transposed: PEFT adds ``alpha / r * B A`` to a ``[out, in]`` weight)."""
    adapters = jax.device_get(adapters)
    if "layers" in adapters:
        adapters = unstack_layer_params(adapters)
    tensors, modules = {}, set()
    for layer in range(config.num_layers):
        for (block, name), theirs in HF_PROJECTIONS.items():
            pair = adapters.get(f"layers_{layer}", {}).get(block, {}).get(name)
            if pair is None:
                continue
            prefix = f"base_model.model.model.layers.{layer}.{theirs}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(pair["lora_a"].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(pair["lora_b"].T)
            modules.add(theirs.split(".")[-1])
    unexported = sorted(
        key
        for key, value in adapters.items()
        if not key.startswith("layers_") and "lora_a" in str(jax.tree.structure(value))
    )
    if unexported:
        raise ValueError(
            f"--adapter: adapters outside the decoder layers ({unexported}) have no PEFT "
            f"name; export merged weights instead"
        )
    lora = run.lora
    record = os.path.join(workdir, init_from.RECORD)
    base = ""
    if os.path.isfile(record):
        with open(record) as f:
            base = json.load(f).get("path", "")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
    safetensors.numpy.save_file(
        tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"}
    )
    return ["adapter_config.json", "adapter_model.safetensors"]
