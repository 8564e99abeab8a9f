"""The icl package's configs: how Iterative Vectors are extracted (``ExtractConfig``,
used by ``lhc.icl.iterative``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ExtractConfig:
    """``ext_shot`` demonstrations per class, ``ext_strength``, ``episodes`` (200 in the
    paper's code), ``ext_batch`` (10), ``negative_shift`` (1 as released: the zero-shot
    read is one token before the separator; 0 reads at it), ``seed``."""

    ext_shot: int = 1
    ext_strength: float = 0.5
    episodes: int = 200
    ext_batch: int = 10
    negative_shift: int = 1
    seed: int = 0
