"""Model factories for ``lhc.train`` (``config.model_factory``): a recurrent LM from a
ConfigDict of its config's fields."""

from __future__ import annotations

import dataclasses

from lhc.recurrent.gla_lm import GLALM, GLAConfig
from lhc.recurrent.mamba2 import Mamba2Config, Mamba2LM


def _fields(config_class, model_config) -> dict:
    fields = dict(model_config)
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"config.model: {unknown} are not fields of {config_class.__name__} "
            f"(known: {sorted(known)})"
        )
    return fields


def mamba2_from_config(model_config) -> Mamba2LM:
    """``config.model_factory = "lhc.recurrent.factories:mamba2_from_config"``."""
    return Mamba2LM(Mamba2Config(**_fields(Mamba2Config, model_config)))


def gla_from_config(model_config) -> GLALM:
    """``config.model_factory = "lhc.recurrent.factories:gla_from_config"``."""
    return GLALM(GLAConfig(**_fields(GLAConfig, model_config)))
