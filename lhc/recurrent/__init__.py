"""Recurrent-state models (Buitrago Ruiz & Gu, ICML 2025: length generalization of
recurrent models).

This package has:

* Mamba-2 and gated-linear-attention language models on the causal-LM protocol whose
  cache is the recurrent state (``Mamba2LM``, ``GLALM``, ``RecurrentCache``: memory
  independent of the context, exact rollback of the latest call's last tokens for
  speculative decoding), their configs (``lhc.recurrent.config``; trained through
  ``config.model_factory = "lhc.recurrent:Mamba2LM"``, ``configs/recurrent_passkey.py``)
  and the paper's interventions as switches of the training task (``lhc.recurrent.task``): Random Noise,
  Fitted Noise, State Passing and truncated backpropagation through time;
* the recurrences, each as a chunked parallel form over a sequence and a single step,
  both taking an initial state and returning the final one: Mamba-2's SSD (``ssd``,
  ``ssd_step``) and gated linear attention (``gla``, ``gla_step``); Mamba-2's short
  causal convolution with its state, skipping padding anywhere (``causal_conv``);
* for any causal LM of the protocol, Effective Remembrance (``effective_remembrance``)
  and the loss by position read through its cache (``loss_by_position``,
  ``bucket_means``, ``plot_curves``);
* ``lhc bench recurrent``: the chunked forms' training pass against a sequential scan,
  and the decode step's time and memory by position.
"""

from lhc.recurrent.cache import RecurrentCache
from lhc.recurrent.config import GLAConfig, Mamba2Config
from lhc.recurrent.conv import causal_conv
from lhc.recurrent.evaluation import (
    bucket_means,
    effective_remembrance,
    loss_by_position,
    plot_curves,
    total_variation,
)
from lhc.recurrent.gla_lm import GLALM
from lhc.recurrent.mamba2 import Mamba2LM
from lhc.recurrent.scan import gla, gla_step, ssd, ssd_step

__all__ = [
    "GLAConfig",
    "GLALM",
    "Mamba2Config",
    "Mamba2LM",
    "RecurrentCache",
    "bucket_means",
    "causal_conv",
    "effective_remembrance",
    "gla",
    "gla_step",
    "loss_by_position",
    "plot_curves",
    "ssd",
    "ssd_step",
    "total_variation",
]
