"""Model factories for ``lhc.train`` (``config.model_factory``): the ``Transformer`` from
``config.model``, the fields of ``LMConfig`` (unset ones take its defaults).

``config.model_factory = "lhc.lm.factories:transformer_from_config"`` is the causal-LM
task's default; other methods name their own factories the same way
(``"lhc.gca:gca_from_config"``, ``"lhc.recurrent.factories:mamba2_from_config"``).
"""

from __future__ import annotations

from lhc.lm.config import LMConfig
from lhc.lm.model import Transformer


def lm_config_from(model_config) -> LMConfig:
    """``LMConfig`` from ``config.model`` (a ConfigDict or a mapping of its fields).

    Raises:
      ValueError: naming ``config.model``, for an unknown or missing field (with the
        closest known one) or a bad value.
    """
    try:
        return LMConfig.from_dict(model_config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"config.model: {error}") from error


def transformer_from_config(model_config) -> Transformer:
    """The causal-LM task's default model factory: ``lhc.lm.Transformer`` of
    ``lm_config_from(model_config)``."""
    return Transformer(lm_config_from(model_config))
