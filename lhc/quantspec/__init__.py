"""QuantSpec (Tiwari et al., ICML 2025): self-speculative decoding with a hierarchical
4-bit / 8-bit KV cache and 4-bit draft weights.

This package has:

* the hierarchical quantization (``quantize``, ``dequantize``: one store whose upper
  nibbles are the draft's 4-bit codes and whose two nibbles are the target's 8-bit
  codes; ``pack_nibbles``, ``unpack_nibbles``);
* the draft's group-wise INT4 weights, symmetric or with a minimum per group
  (``quantize_weight``, ``int4_matmul``, ``quantize_params`` for the MLP or every linear
  layer of an ``lhc.lm.Transformer``), rounded to nearest or with GPTQ on calibration
  text (``gptq_weight``, ``gptq_calibrate``);
* the KV cache (``QuantSpecCache``, ``init_cache``): a quantized store plus a
  full-precision ring of the recent tokens, flushed during decoding, read at 8 bits by
  the target and at 4 bits by the draft (``cache.draft()``), with a cut between the two
  that depends only on the query's slot, so that a multi-token verification reads as
  token-by-token decoding; ``kv_bytes_per_token``;
* decoding (``generate``: plain decoding on the target path; ``speculative_generate``:
  self-speculative decoding, drafts with 4-bit KV and 4-bit weights in the target's
  cache, verification at 8 bits, greedy output equal to ``generate``'s);
* ``PASSKEY_MODEL``, the small byte-level decoder of ``configs/quantspec_passkey.py``;
* the memory-traffic model (``step_bytes``, ``predicted_speedup``, ``NAMED`` sizes).
"""

from lhc.quantspec.cache import QuantSpecCache, init_cache, kv_bytes_per_token
from lhc.quantspec.decoding import (
    PASSKEY_MODEL,
    QuantSpecLM,
    default_group_size,
    default_weight_group_size,
    generate,
    quantspec_model,
    speculative_generate,
)
from lhc.quantspec.gptq import calibrate as gptq_calibrate
from lhc.quantspec.gptq import gptq_weight
from lhc.quantspec.quantize import Quantized, dequantize, pack_nibbles, quantize, unpack_nibbles
from lhc.quantspec.traffic import NAMED, ModelSize, predicted_speedup, size_of_config, step_bytes
from lhc.quantspec.weights import (
    Int4Weight,
    dequantize_params,
    dequantize_weight,
    int4_matmul,
    quantize_params,
    quantize_weight,
)

__all__ = [
    "NAMED",
    "PASSKEY_MODEL",
    "Int4Weight",
    "ModelSize",
    "QuantSpecCache",
    "QuantSpecLM",
    "Quantized",
    "default_group_size",
    "default_weight_group_size",
    "dequantize",
    "dequantize_params",
    "dequantize_weight",
    "generate",
    "gptq_calibrate",
    "gptq_weight",
    "init_cache",
    "int4_matmul",
    "kv_bytes_per_token",
    "pack_nibbles",
    "predicted_speedup",
    "quantize",
    "quantize_params",
    "quantize_weight",
    "quantspec_model",
    "size_of_config",
    "speculative_generate",
    "step_bytes",
    "unpack_nibbles",
]
