"""EMLoC's settings (``EMLoCConfig``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EMLoCConfig:
    """EMLoC's settings (defaults: the official image setting).

    Attributes:
        chunk_size: demonstrations per chunk (official: 4; 20 for ImageNet).
        ratios: keep ratios tried per layer, in order (each in (0, 1]).
        delta: the bound on the mean JS divergence of an accepted layer.
        pool: average-pooling kernel over tokens (odd).
        answer_bonus: added to the importance of the chunk's answer tokens.
    """

    chunk_size: int = 4
    ratios: tuple[float, ...] = (0.1, 0.2, 0.5)
    delta: float = 0.005
    pool: int = 5
    answer_bonus: float = 100.0

    def __post_init__(self):
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size}")
        if not self.ratios or any(not 0 < r <= 1 for r in self.ratios):
            raise ValueError(f"ratios must be keep ratios in (0, 1], got {self.ratios}")
        if not self.delta >= 0:
            raise ValueError(f"delta must be >= 0, got {self.delta}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"pool must be an odd kernel size >= 1, got {self.pool}")
