"""TabICL (ICML 2025): tabular in-context learning in JAX/Flax.

The network (``TabICL``, ``TabICLConfig``), official checkpoints (``load_checkpoint``,
Orbax conversion), memory-bounded inference (``predict_logits`` in ``inference``, driving
the jitted stages of ``chunked``), the scikit-learn classifier (``TabICLClassifier``),
and the synthetic prior (``PriorConfig``, ``sample_batch``, the curriculum) that the
pretraining task (``lhc.tabicl.task``) trains on.
"""

from lhc.tabicl import _extra  # noqa: F401  (scikit-learn, or an error naming the extra)
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
from lhc.tabicl.config import TabICLConfig
from lhc.tabicl.inference import plan_chunks, predict_logits
from lhc.tabicl.model import TabICL, abstract_params, init_params
from lhc.tabicl.prior import (
    LABEL_PAD,
    CurriculumStage,
    PriorConfig,
    curriculum_stage,
    iterate_batches,
    sample_batch,
)

__all__ = [
    "LABEL_PAD",
    "CurriculumStage",
    "PriorConfig",
    "TabICL",
    "TabICLClassifier",
    "TabICLConfig",
    "abstract_params",
    "convert_to_orbax",
    "curriculum_stage",
    "init_params",
    "iterate_batches",
    "load_checkpoint",
    "load_model",
    "load_orbax",
    "params_to_state_dict",
    "plan_chunks",
    "predict_logits",
    "sample_batch",
    "save_orbax",
    "state_dict_to_params",
]
