"""TabICL (ICML 2025): tabular in-context learning in JAX/Flax.

The network (``TabICL``, ``TabICLConfig``), official checkpoints (``load_checkpoint``,
Orbax conversion), memory-bounded inference (``predict_logits``) and the scikit-learn
classifier (``TabICLClassifier``).
"""

from lhc.tabicl.checkpoint import (
    convert_to_orbax,
    load_checkpoint,
    load_model,
    load_orbax,
    params_to_state_dict,
    save_orbax,
    state_dict_to_params,
)
from lhc.tabicl.classifier import TabICLClassifier
from lhc.tabicl.inference import plan_chunks, predict_logits
from lhc.tabicl.model import TabICL, TabICLConfig, abstract_params, init_params

__all__ = [
    "TabICL",
    "TabICLClassifier",
    "TabICLConfig",
    "abstract_params",
    "convert_to_orbax",
    "init_params",
    "load_checkpoint",
    "load_model",
    "load_orbax",
    "params_to_state_dict",
    "plan_chunks",
    "predict_logits",
    "save_orbax",
    "state_dict_to_params",
]
