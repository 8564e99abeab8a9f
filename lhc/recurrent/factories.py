"""The factory paths of the recurrent LMs that runs recorded before the model registry
(``lhc.nn.config.register_model``) name in their ``config.json``. A config names the
model class now: ``config.model_factory = "lhc.recurrent:Mamba2LM"`` (or ``GLALM``).
"""

from __future__ import annotations

from lhc.nn.config import build_model
from lhc.recurrent.gla_lm import GLALM
from lhc.recurrent.mamba2 import Mamba2LM


def mamba2_from_config(model_config) -> Mamba2LM:
    """``build_model("mamba2", model_config)``."""
    return build_model(Mamba2LM, model_config)


def gla_from_config(model_config) -> GLALM:
    """``build_model("gla", model_config)``."""
    return build_model(GLALM, model_config)
