"""Grouped Cross Attention (Hu et al., ICML 2025): a causal LM that retrieves past chunks.

``lhc.gca.GCA`` follows lhc's causal-LM protocol (``lhc.lm``): plain text tokens in,
logits out, landmarks inserted by the model, a cache whose cost per token does not grow
with the context. The chunk-retrieval attention is ``kernels_pallas.chunk_retrieval``;
``GCAConfig.offload_memory`` keeps the chunk memory in host memory; ``lhc bench gca``
(``lhc.gca.bench``) measures decode cost against context next to dense attention.
"""

from lhc.gca.cache import GCACache, init_gca_cache
from lhc.gca.config import GCAConfig
from lhc.gca.model import GCA, gca_from_config, init_params, retrieve

__all__ = [
    "GCA",
    "GCACache",
    "GCAConfig",
    "gca_from_config",
    "init_gca_cache",
    "init_params",
    "retrieve",
]
