"""In-context learning tools on any ``lhc.lm`` decoder: reading and steering
activations, teacher-forced answer probabilities (task superposition; several answers
of one prompt scored from one prefill, ``score_answers``), task vectors and Iterative
Vectors."""

from lhc.icl.activations import SITES, edit_at, read_activations
from lhc.icl.scoring import (
    Patch,
    answer_probabilities,
    continuation_logprobs,
    kl_to_proportions,
    with_other,
)
from lhc.icl.shared_prefix import AnswerScores, score_answers
from lhc.icl.taskvectors import best_layer, compose, patched_probabilities, task_vector

__all__ = [
    "SITES",
    "AnswerScores",
    "Patch",
    "answer_probabilities",
    "best_layer",
    "compose",
    "continuation_logprobs",
    "edit_at",
    "kl_to_proportions",
    "patched_probabilities",
    "read_activations",
    "score_answers",
    "task_vector",
    "with_other",
]
