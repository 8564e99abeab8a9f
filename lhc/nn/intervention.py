"""Interventions: edits of a model's activations at chosen layers and tokens.

An ``Intervention`` holds, for each of two sites of every layer, an ``Edit``:

* ``residual``: the residual stream after the block (what ``intermediates/residual``
  records);
* ``attention``: the attention output, before it is added to the residual stream
  (what ``intermediates/attention_out`` records).

At layer ``l`` an edit changes the activation ``x [B, T, D]`` where its mask is set:
``x + values[l]`` (``mode="add"``) or ``values[l]`` (``mode="replace"``). Every field is
an array with a leading ``[L]`` axis, so the same pytree is sliced by ``nn.scan`` over
stacked layers or indexed by a loop over layers, and is traced (a new vector does not
compile again). Layers an edit does not touch have an all-false mask.

    steer = Intervention.at(config.num_layers, layers=[6], values=vector)   # add at layer 6
    logits, _ = model.apply(variables, tokens, positions, intervention=steer)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

SITES = ("residual", "attention")
MODES = ("add", "replace")


@struct.dataclass
class Edit:
    """One site's edit, per layer.

    Attributes:
        values: float ``[L, B | 1, T | 1, D]``.
        mask: bool ``[L, B | 1, T | 1]``; where false the activation is unchanged.
        replace: bool ``[L]``; true replaces the activation, false adds ``values``.
    """

    values: jax.Array
    mask: jax.Array
    replace: jax.Array

    def apply(self, x: jax.Array) -> jax.Array:
        """Edits ``x [B, T, D]`` with this edit's slice for one layer (leading axis gone)."""
        values = self.values.astype(x.dtype)
        edited = jnp.where(self.replace, values, x + values)
        return jnp.where(self.mask[..., None], edited, x)

    def layer(self, index: int) -> Edit:
        return jax.tree.map(lambda leaf: leaf[index], self)


@struct.dataclass
class Intervention:
    """Edits of the residual stream and of the attention output (either may be ``None``)."""

    residual: Edit | None = None
    attention: Edit | None = None

    @classmethod
    def at(
        cls,
        num_layers: int,
        *,
        layers: Sequence[int] | Mapping[int, jax.Array],
        values: jax.Array | None = None,
        mask: jax.Array | None = None,
        site: str = "residual",
        mode: str = "add",
    ) -> Intervention:
        """An intervention at one site of the given layers.

        Args:
            num_layers: L, the model's layer count.
            layers: layer indices that all get ``values``, or a mapping from layer index
                to that layer's values.
            values: float ``[D]``, ``[T, D]`` or ``[B, T, D]`` (with ``layers`` a sequence).
            mask: bool ``[B, T]``, ``[T]`` or ``None`` (every token).
            site: ``"residual"`` or ``"attention"``.
            mode: ``"add"`` or ``"replace"``.

        Raises:
            ValueError: an unknown site or mode, a layer outside ``[0, L)``, values of
                different shapes, or values given both ways.
        """
        if site not in SITES:
            raise ValueError(f"site must be one of {SITES}, got {site!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(layers, Mapping):
            if values is not None:
                raise ValueError("give values either in the layers mapping or as values=")
            per_layer = {int(k): jnp.asarray(v) for k, v in layers.items()}
        else:
            if values is None:
                raise ValueError("values= is required when layers is a sequence")
            per_layer = {int(k): jnp.asarray(values) for k in layers}
        if not per_layer:
            raise ValueError("layers must name at least one layer")
        bad = sorted(k for k in per_layer if not 0 <= k < num_layers)
        if bad:
            raise ValueError(f"layers {bad} lie outside [0, num_layers={num_layers})")
        shapes = {v.shape for v in per_layer.values()}
        if len(shapes) != 1:
            raise ValueError(f"every layer's values must have one shape, got {sorted(shapes)}")
        (shape,) = shapes
        if not 1 <= len(shape) <= 3:
            raise ValueError(f"values must be [D], [T, D] or [B, T, D]; got shape {shape}")
        values_shape = (1,) * (3 - len(shape)) + shape
        dtype = jnp.result_type(*per_layer.values(), jnp.float32)
        stacked = jnp.zeros((num_layers, *values_shape), dtype)
        chosen = np.zeros((num_layers,), bool)
        for k, v in per_layer.items():
            stacked = stacked.at[k].set(v.reshape(values_shape).astype(dtype))
            chosen[k] = True
        if mask is None:
            token_mask = jnp.ones((1, 1), bool)
        else:
            mask = jnp.asarray(mask, bool)
            if mask.ndim not in (1, 2):
                raise ValueError(f"mask must be [B, T] or [T], got {mask.shape=}")
            token_mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
        layer_mask = jnp.asarray(chosen)[:, None, None] & token_mask[None]
        edit = Edit(
            values=stacked,
            mask=layer_mask,
            replace=jnp.full((num_layers,), mode == "replace"),
        )
        return cls(**{site: edit})

    def merge(self, other: Intervention) -> Intervention:
        """Both interventions; each site may be set by only one of them."""
        fields = {}
        for site in SITES:
            mine, theirs = getattr(self, site), getattr(other, site)
            if mine is not None and theirs is not None:
                raise ValueError(f"both interventions edit the {site} site; combine them first")
            fields[site] = mine if theirs is None else theirs
        return Intervention(**fields)

    @property
    def num_layers(self) -> int:
        edits = [e for e in (self.residual, self.attention) if e is not None]
        return edits[0].replace.shape[0] if edits else 0

    def layer(self, index: int) -> Intervention:
        """This intervention's slice for one layer (the leading ``[L]`` axis removed)."""
        return jax.tree.map(lambda leaf: leaf[index], self)


def apply_edit(edit: Edit | None, x: jax.Array) -> jax.Array:
    """``edit.apply(x)``, or ``x`` without an edit."""
    return x if edit is None else edit.apply(x)
