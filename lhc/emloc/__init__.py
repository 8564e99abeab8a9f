"""EMLoC (Ma et al., ICML 2025): many-shot demonstrations compressed chunk by chunk, each
layer pruned as far as a Jensen-Shannon bound on the answers allows.

* ``compress``: the compression (``EMLoCConfig``; ``Example`` is one demonstration,
  tokens and optional input embeddings such as image patches);
* ``LayerwiseMemory``: the compressed context as a cache of the ``lhc.lm`` protocol
  (every layer and key/value head keeps its own tokens), so that ``lhc.lm.generate``
  answers queries on it;
* ``baselines``: uniform pruning and SnapKV-style attention-score pruning into the same
  memory;
* ``manyshot``: generated many-shot classification (text, and images as patch
  embeddings from ``PatchLM``'s encoder) and its training task (``task``,
  ``configs/emloc_manyshot.py``); ``lhc bench emloc`` (``bench``) compares the methods.
"""

from lhc.emloc import baselines
from lhc.emloc.compress import Compression, LayerDecision, compress, importance, js_divergence
from lhc.emloc.config import EMLoCConfig
from lhc.emloc.examples import Example, join_examples, top_tokens
from lhc.emloc.memory import LayerwiseMemory, append_kept, empty_memory

__all__ = [
    "Compression",
    "EMLoCConfig",
    "Example",
    "LayerDecision",
    "LayerwiseMemory",
    "append_kept",
    "baselines",
    "compress",
    "empty_memory",
    "importance",
    "join_examples",
    "js_divergence",
    "top_tokens",
]
