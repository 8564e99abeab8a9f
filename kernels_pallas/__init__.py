"""Pallas kernels, one op per file, each with its plain-jnp reference at the bottom.

* ``flash_attention``: memory-efficient attention under lhc's position mask (causal by
  position, sliding window, padding), as chunked XLA and as Pallas kernels for TPU
  (Mosaic) and GPU (Triton), forward and backward.
"""

from kernels_pallas.flash_attention import BlockSizes, flash_attention, flash_attention_reference

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference"]
