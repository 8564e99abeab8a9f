"""What every model config of lhc shares: a frozen dataclass validated on construction,
``replace``, ``to_dict`` and ``from_dict`` with a did-you-mean for unknown keys.

A config subclasses ``ModelConfig`` (as a frozen dataclass) and names its checks::

    @dataclasses.dataclass(frozen=True)
    class MyConfig(ModelConfig):
        POSITIVE = ("vocab_size", "num_layers")        # ints >= 1
        NON_NEGATIVE = ("rollback",)                    # ints >= 0
        CHOICES = {"norm_type": ("rmsnorm", "layernorm")}
        DTYPES = ("dtype", "param_dtype")               # stored as names: "bfloat16"
        TUPLES = ("upper_layers",)                      # lists become tuples
        MULTIPLES = (("num_heads", "num_kv_heads"),)    # the first a multiple of the second
        EVEN = ("head_dim",)                            # even ints (RoPE's pairs)

        vocab_size: int
        ...

        def __post_init__(self):
            super().__post_init__()   # the checks above, naming MyConfig.<field>
            ...                       # what only this model needs

Errors are ``ValueError``\\s that name ``Class.field``, what was expected and what came.

``from_dict`` is the one place unknown keys are checked. A model built from its config
alone registers under a name, and ``lhc.train`` (``config.model_factory``) builds it
from the ``ml_collections.ConfigDict`` of ``config.model`` as it is::

    @register_model("my_model", MyConfig)
    class MyModel(nn.Module):
        config: MyConfig

    build_model("my_model", config.model)   # MyModel(MyConfig.from_dict(config.model))

The name is known once the model's module is imported (``registered_models()``); the
model class itself serves as well, so ``config.model_factory = "my_package:MyModel"``
needs no import beforehand.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, ClassVar

import jax.numpy as jnp

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def float_dtype_name(value: Any, field: str) -> str:
    """The canonical name of a float dtype (a name or a dtype object), or a ValueError
    naming ``field``."""
    try:
        name = jnp.dtype(value).name
    except TypeError as error:
        raise ValueError(f"{field} must be one of {FLOAT_DTYPES}, got {value!r}") from error
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{field} must be one of {FLOAT_DTYPES}, got {value!r}")
    return name


def unknown_keys_error(owner: str, unknown: list[str], known: list[str]) -> ValueError:
    """``ValueError`` for unknown keys, each with its closest known key when there is one."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(
        f"unknown {owner} keys: {', '.join(hints)}; known: {', '.join(sorted(known))}"
    )


class ModelConfig:
    """The shared behaviour of lhc's model configs (see the module docstring)."""

    POSITIVE: ClassVar[tuple[str, ...]] = ()
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ()
    CHOICES: ClassVar[Mapping[str, tuple]] = {}
    DTYPES: ClassVar[tuple[str, ...]] = ()
    TUPLES: ClassVar[tuple[str, ...]] = ()
    MULTIPLES: ClassVar[tuple[tuple[str, str], ...]] = ()
    EVEN: ClassVar[tuple[str, ...]] = ()
    # What errors about unknown or missing keys call the config (default: the class name).
    KEYS_NAME: ClassVar[str | None] = None

    def __post_init__(self):
        name = type(self).__name__
        for field in self.POSITIVE:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
        for field in self.NON_NEGATIVE:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}.{field} must be an int >= 0, got {value!r}")
        for field, options in self.CHOICES.items():
            if getattr(self, field) not in options:
                raise ValueError(
                    f"{name}.{field} must be one of {options}, got {getattr(self, field)!r}"
                )
        for field in self.DTYPES:
            object.__setattr__(
                self, field, float_dtype_name(getattr(self, field), f"{name}.{field}")
            )
        for field in self.TUPLES:
            value = getattr(self, field)
            if isinstance(value, list):
                object.__setattr__(self, field, tuple(value))
        for field, divisor in self.MULTIPLES:
            if getattr(self, field) % getattr(self, divisor):
                raise ValueError(
                    f"{name}.{field} ({getattr(self, field)}) must be a multiple of {divisor} "
                    f"({getattr(self, divisor)})"
                )
        for field in self.EVEN:
            if getattr(self, field) % 2:
                raise ValueError(f"{name}.{field} must be even, got {getattr(self, field)}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def replace(self, **changes: Any):
        """A copy with ``changes`` applied (validated again)."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise unknown_keys_error(
                self.KEYS_NAME or type(self).__name__, unknown, self.field_names()
            )
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (tuples as lists, mappings as dicts) that ``from_dict``
        turns back into this config."""

        def plain(value):
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            if isinstance(value, Mapping):
                return {k: plain(v) for k, v in value.items()}
            return value

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """The config of a mapping (``to_dict``'s, a ``config.json``'s model section) or
        an ``ml_collections.ConfigDict`` (``config.model``); unknown keys raise
        ``ValueError`` naming the closest known ones, and so do missing required ones."""
        if not isinstance(values, Mapping) and callable(getattr(values, "to_dict", None)):
            values = values.to_dict()  # a ConfigDict, nested ones included
        if not isinstance(values, Mapping):
            raise ValueError(
                f"{cls.__name__}.from_dict needs a mapping of its fields, got "
                f"{type(values).__name__}"
            )
        owner = cls.KEYS_NAME or cls.__name__
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise unknown_keys_error(owner, unknown, cls.field_names())
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"missing {owner} keys: {', '.join(map(repr, missing))}")
        return cls(**dict(values))


# name -> (model class, config class); filled by @register_model as modules are imported.
_MODELS: dict[str, tuple[type, type[ModelConfig]]] = {}


def register_model(name: str, config_class: type[ModelConfig]):
    """Class decorator: the model ``cls(config_class.from_dict(fields))`` is built by
    ``build_model(name, fields)`` (and by ``config.model_factory = name`` in
    ``lhc.train``)."""

    def decorator(cls):
        known = _MODELS.get(name)
        if known is not None and known[0].__qualname__ != cls.__qualname__:
            raise ValueError(f"model name {name!r} is already registered to {known[0].__name__}")
        _MODELS[name] = (cls, config_class)
        return cls

    return decorator


def registered_models() -> dict[str, type]:
    """The registered models by name (of the modules imported so far)."""
    return {name: cls for name, (cls, _) in sorted(_MODELS.items())}


def registered_name(model_class: Any) -> str | None:
    """The name ``model_class`` is registered under, or ``None``."""
    for name, (cls, _) in _MODELS.items():
        if cls is model_class:
            return name
    return None


def build_model(model: str | type, fields: Any, *, what: str = "config.model"):
    """The registered model ``model`` (its name or its class) of ``fields``: a mapping
    or ``ConfigDict`` of its config's fields (unset ones take their defaults).

    Raises:
        ValueError: an unregistered model (naming the registered ones), or naming
            ``what`` for an unknown, missing or bad field.
    """
    name = model if isinstance(model, str) else registered_name(model)
    if name not in _MODELS:
        raise ValueError(
            f"unknown model {model!r}; registered (once their modules are imported): "
            f"{', '.join(sorted(_MODELS))}"
        )
    cls, config_class = _MODELS[name]
    try:
        return cls(config_class.from_dict(fields))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what}: {error}") from error
