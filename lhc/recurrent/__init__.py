"""Recurrent-state models (Buitrago Ruiz & Gu, ICML 2025: length generalization of
recurrent models).

This package has, so far, the recurrences the models are built from, each as a chunked
parallel form over a sequence and a single step, both taking an initial state and
returning the final one: Mamba-2's SSD (``ssd``, ``ssd_step``) and gated linear
attention (``gla``, ``gla_step``).
"""

from lhc.recurrent.scan import gla, gla_step, ssd, ssd_step

__all__ = ["gla", "gla_step", "ssd", "ssd_step"]
