"""The model registry of ``lhc.nn.config``: names and classes build the model of a
config's fields, bad names and fields fail with one line naming them."""

import dataclasses

import flax.linen as nn
import pytest

from lhc import lm
from lhc.nn.config import ModelConfig, build_model, register_model, registered_models


@dataclasses.dataclass(frozen=True)
class _TinyConfig(ModelConfig):
    POSITIVE = ("width",)
    width: int = 4


@register_model("test_tiny", _TinyConfig)
class _Tiny(nn.Module):
    config: _TinyConfig


def test_a_name_and_its_class_build_the_same_model_from_a_mapping():
    assert registered_models()["test_tiny"] is _Tiny
    assert registered_models()["transformer"] is lm.Transformer
    for key in ("test_tiny", _Tiny):
        model = build_model(key, {"width": 3})
        assert type(model) is _Tiny and model.config == _TinyConfig(width=3)
    fields = dict(vocab_size=11, num_layers=1, embed_dim=8, num_heads=2, num_kv_heads=1)
    fields.update(head_dim=4, mlp_dim=8, max_len=32)
    assert build_model("transformer", fields).config == lm.LMConfig(**fields)


def test_bad_names_and_fields_fail_naming_them():
    with pytest.raises(ValueError, match=r"unknown model 'tiny'; registered .*test_tiny"):
        build_model("tiny", {})
    with pytest.raises(ValueError, match=r"config.model: unknown _TinyConfig keys: 'widht'"):
        build_model("test_tiny", {"widht": 3})
    with pytest.raises(ValueError, match=r"cfg: _TinyConfig.width must be a positive int"):
        build_model(_Tiny, {"width": 0}, what="cfg")
    with pytest.raises(ValueError, match="'test_tiny' is already registered to _Tiny"):
        register_model("test_tiny", _TinyConfig)(type("Other", (), {}))
