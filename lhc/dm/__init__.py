"""Decision Transformer and Decision Mixer for offline RL (``lhc.dm``).

The models (``DecisionModel`` with ``DMConfig``: a Decision Transformer, or the
Decision Mixer's routed layers with ``router=True``), the offline data layer in the
D4RL layout (``OfflineDataset``, ``load_dataset``, ``SegmentSampler``,
``returns_to_go``, ``normalized_score``).

Not imported here: the SAC agent (``lhc.dm.sac``), its training in an environment
(``lhc.dm.recipe``, gymnasium from the ``dm`` extra; saved and continued by
``lhc.dm.resume``) and the D4RL-style datasets made with it (``lhc.dm.datasets``),
whose command is ``python -m lhc.dm.behaviour``.
"""

from lhc.dm.config import DMConfig
from lhc.dm.data import (
    REF_SCORES,
    OfflineDataset,
    SegmentSampler,
    Trajectory,
    load_d4rl,
    load_dataset,
    normalized_score,
    returns_to_go,
    save_d4rl,
)
from lhc.dm.model import DecisionModel, aux_loss, flops_per_action

__all__ = [
    "REF_SCORES",
    "DMConfig",
    "DecisionModel",
    "OfflineDataset",
    "SegmentSampler",
    "Trajectory",
    "aux_loss",
    "flops_per_action",
    "load_d4rl",
    "load_dataset",
    "normalized_score",
    "returns_to_go",
    "save_d4rl",
]
