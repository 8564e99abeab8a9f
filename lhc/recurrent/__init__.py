"""Recurrent-state models (Buitrago Ruiz & Gu, ICML 2025: length generalization of
recurrent models).

This package has, so far, the recurrences the models are built from, each as a chunked
parallel form over a sequence and a single step, both taking an initial state and
returning the final one: Mamba-2's SSD (``ssd``, ``ssd_step``) and gated linear
attention (``gla``, ``gla_step``); Effective Remembrance of any causal LM of the
protocol (``effective_remembrance``); ``lhc bench recurrent`` (the chunked forms'
training pass against a sequential scan).
"""

from lhc.recurrent.evaluation import effective_remembrance, total_variation
from lhc.recurrent.scan import gla, gla_step, ssd, ssd_step

__all__ = [
    "effective_remembrance",
    "gla",
    "gla_step",
    "ssd",
    "ssd_step",
    "total_variation",
]
