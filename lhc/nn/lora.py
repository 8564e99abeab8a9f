"""Low-rank adapters (LoRA, Hu et al. 2021) on any ``lhc.nn.Einsum`` of a model, chosen
by parameter path, without changing the model's code.

    lora = LoRA(rank=8, alpha=16, targets=("attention/(query|value)",))
    with lora.applied():
        variables = model.init(rng, tokens, positions)    # adds lora_a / lora_b
        logits, _ = model.apply(variables, tokens, positions)
    base, adapters = split(variables["params"])
    merged = merge(combine(base, adapters), lora, kernel_layout)   # a plain model again

Inside ``applied()`` every ``Einsum`` whose path (``"layers/attention/query"``: the
module names from the model's root, joined by ``/``) matches one of ``targets`` (regular
expressions, ``re.search``) adds ``alpha / rank * dropout(x) @ A @ B`` to its output:
``A`` ``[in, rank]`` drawn as PEFT draws it (uniform in ``±1/sqrt(in)``), ``B``
``[rank, out]`` zero, so a fresh adapter leaves the model unchanged. ``in`` and ``out``
are the products of the weight's input and output axes. The adapters are parameters of
the adapted module (``lora_a``, ``lora_b`` beside its ``kernel``), so stacked (scanned)
layers get stacked adapters. Dropout acts on the adapter's input only, in calls given an
rng stream ``"train"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lhc.nn.linear import Einsum

ADAPTERS = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Which projections get adapters, and their shape.

    Attributes:
        rank: r >= 1.
        alpha: the update is scaled by ``alpha / rank``.
        dropout: dropout rate on the adapter's input, in ``[0, 1)``.
        targets: regular expressions matched against module paths.
    """

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention/(query|value)",)

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank: expected an int >= 1, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: expected a rate in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str) or not self.targets:
            raise ValueError(
                f"lora.targets: expected a tuple of path patterns, got {self.targets!r}"
            )
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"lora.targets: {pattern!r} is not a regular expression: {error}"
                ) from None
        object.__setattr__(self, "targets", tuple(self.targets))

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> LoRA | None:
        """From a config section with ``rank`` (0: no adapters), ``alpha``, ``dropout``,
        ``targets``; None when absent or ``rank`` is 0."""
        if not section or not section.get("rank"):
            return None
        return cls(
            rank=section["rank"],
            alpha=float(section.get("alpha", 16.0)),
            dropout=float(section.get("dropout", 0.0)),
            targets=tuple(section.get("targets", cls.targets)),
        )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def matches(self, path: str) -> bool:
        return any(re.search(pattern, path) for pattern in self.targets)

    @contextlib.contextmanager
    def applied(self):
        """Within this context, models add the adapters to their matching projections."""
        with nn.intercept_methods(self._intercept):
            yield

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if (
            not isinstance(module, Einsum)
            or context.method_name != "__call__"
            or not self.matches("/".join(module.path))
        ):
            return next_fun(*args, **kwargs)
        y = next_fun(*args, **kwargs)
        x = args[1] if len(args) > 1 else kwargs["x"]
        shape = tuple(module.shape)
        size_in = math.prod(shape[: module.in_dims])
        size_out = math.prod(shape[module.in_dims :])
        bound = size_in**-0.5
        a = module.param(
            "lora_a",
            lambda key, s, d: jax.random.uniform(key, s, d, -bound, bound),
            (size_in, self.rank),
            module.param_dtype,
        )
        b = module.param("lora_b", nn.initializers.zeros, (self.rank, size_out), module.param_dtype)
        lead = y.shape[: y.ndim - (len(shape) - module.in_dims)]
        h = x.reshape(*lead, size_in).astype(module.dtype)
        if self.dropout and module.has_rng("train"):
            keep = jax.random.bernoulli(module.make_rng("train"), 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), 0.0).astype(h.dtype)
        delta = (h @ a.astype(module.dtype)) @ b.astype(module.dtype)
        return y + (self.scale * delta).reshape(y.shape).astype(y.dtype)


def _is_adapter(path) -> bool:
    return getattr(path[-1], "key", None) in ADAPTERS


def _leaves(tree):
    """``(path, leaf)`` pairs, a logically partitioned box counting as one leaf."""
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=boxed)[0]


def split(params: Any) -> tuple[Any, Any]:
    """``(base, adapters)``: the parameters without the adapters, and the adapters alone
    (nested dicts of the same structure)."""
    flat = _leaves(params)
    base, adapters = {}, {}
    for path, leaf in flat:
        _put(adapters if _is_adapter(path) else base, path, leaf)
    return base, adapters


def combine(base: Any, adapters: Any) -> Any:
    """The parameter tree of a model inside ``applied()``: ``base`` and ``adapters``
    nested together (``split``'s inverse)."""
    merged: dict = {}
    for tree in (base, adapters):
        for path, leaf in _leaves(tree):
            _put(merged, path, leaf)
    return merged


def _put(tree: dict, path, leaf) -> None:
    keys = [p.key for p in path]
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = leaf


def merge(params: Any, lora: LoRA, kernel_layout: str = "in_out") -> Any:
    """Parameters with every adapter folded into its kernel: ``W + alpha / rank * A B``
    in the kernel's stored layout (``kernel_layout`` of the model), the adapters
    removed. ``params`` holds both (``combine``); stacked layers merge layer by layer."""
    if isinstance(params, Mapping):
        if "lora_a" in params:
            kernel = params["kernel"]
            a, b = params["lora_a"], params["lora_b"]
            delta = lora.scale * jnp.einsum("...ir,...ro->...io", a, b, precision="highest")
            if kernel_layout == "out_in":
                delta = jnp.swapaxes(delta, -1, -2)
            rest = {k: v for k, v in params.items() if k not in ADAPTERS}
            rest["kernel"] = (kernel + delta.reshape(kernel.shape)).astype(kernel.dtype)
            return rest
        return {key: merge(value, lora, kernel_layout) for key, value in params.items()}
    return params
