"""The factory paths of the ``Transformer`` that runs recorded before the model registry
(``lhc.nn.config.register_model``) name in their ``config.json``:
``"lhc.lm.factories:transformer_from_config"`` (and ``lhc.train.causal_lm``'s). A config
names the model now: ``config.model_factory = "transformer"``.
"""

from __future__ import annotations

from lhc.lm.config import LMConfig
from lhc.lm.model import Transformer
from lhc.nn.config import build_model


def lm_config_from(model_config) -> LMConfig:
    """``LMConfig`` from ``config.model`` (a ConfigDict or a mapping of its fields).

    Raises:
      ValueError: naming ``config.model``, for an unknown or missing field (with the
        closest known one) or a bad value.
    """
    return build_model(Transformer, model_config).config


def transformer_from_config(model_config) -> Transformer:
    """``build_model("transformer", model_config)``: ``lhc.lm.Transformer`` of
    ``lm_config_from(model_config)``."""
    return build_model(Transformer, model_config)
