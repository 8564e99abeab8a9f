"""Model factories for ``lhc.train`` (``config.model_factory``): a recurrent LM from
``config.model``, the fields of its config (unset ones take the config's defaults)."""

from __future__ import annotations

from lhc.nn.config import ModelConfig
from lhc.recurrent.gla_lm import GLALM, GLAConfig
from lhc.recurrent.mamba2 import Mamba2Config, Mamba2LM


def _config(config_class: type[ModelConfig], model_config):
    try:
        return config_class.from_dict(model_config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"config.model: {error}") from error


def mamba2_from_config(model_config) -> Mamba2LM:
    """``config.model_factory = "lhc.recurrent.factories:mamba2_from_config"``."""
    return Mamba2LM(_config(Mamba2Config, model_config))


def gla_from_config(model_config) -> GLALM:
    """``config.model_factory = "lhc.recurrent.factories:gla_from_config"``."""
    return GLALM(_config(GLAConfig, model_config))
