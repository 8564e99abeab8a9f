"""In-context learning tools on any ``lhc.lm`` decoder: reading and steering
activations, teacher-forced answer probabilities (task superposition), task vectors
and Iterative Vectors."""

from lhc.icl.activations import SITES, edit_at, read_activations
from lhc.icl.scoring import (
    Patch,
    answer_probabilities,
    continuation_logprobs,
    kl_to_proportions,
    with_other,
)
from lhc.icl.taskvectors import best_layer, compose, patched_probabilities, task_vector

__all__ = [
    "SITES",
    "Patch",
    "answer_probabilities",
    "best_layer",
    "compose",
    "continuation_logprobs",
    "edit_at",
    "kl_to_proportions",
    "patched_probabilities",
    "read_activations",
    "task_vector",
    "with_other",
]
