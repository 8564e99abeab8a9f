"""In-context learning tools on any ``lhc.lm`` decoder: reading and steering
activations, task superposition, task vectors and Iterative Vectors."""

from lhc.icl.activations import SITES, edit_at, read_activations

__all__ = ["SITES", "edit_at", "read_activations"]
