"""Pallas kernels, one op per file, each with its plain-jnp reference at the bottom.

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
