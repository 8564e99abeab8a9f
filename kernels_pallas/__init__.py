"""Pallas kernels, each with its plain-jnp reference at the bottom of the op's file.

An op's file holds its public function, custom_vjp, XLA path and reference; an op with
kernels for both accelerators keeps them beside it, by backend: ``<op>_tpu.py`` (Mosaic)
and ``<op>_gpu.py`` (Triton), with what its implementations share in
``_<op>_common.py``. ``quant_kv_attention`` is one file: its kernels are shared by
both lowerings.

* ``flash_attention``: memory-efficient attention under lhc's position mask (causal by
  position, sliding window, padding), as chunked XLA and as Pallas kernels for TPU
  (Mosaic) and GPU (Triton), forward and backward.
* ``chunk_retrieval``: Grouped Cross Attention's read of retrieved memory chunks (each
  chunk its own softmax, fused by weights), as XLA and as Pallas kernels for TPU and GPU
  that read only the selected chunks, forward and backward.
"""

from kernels_pallas.chunk_retrieval import chunk_retrieval, chunk_retrieval_reference
from kernels_pallas.flash_attention import BlockSizes, flash_attention, flash_attention_reference

__all__ = [
    "BlockSizes",
    "chunk_retrieval",
    "chunk_retrieval_reference",
    "flash_attention",
    "flash_attention_reference",
]
