"""Reading and steering the activations of an ``lhc.lm`` decoder.

``read_activations`` runs one forward pass and returns a site's activations at chosen
positions, for every layer: the residual stream after each block (``"residual"``),
the attention output before it joins the stream (``"attention"``; the output
projection's output, where Iterative Vectors act) or the stream entering each block
(``"layer_input"``). Steering is ``lhc.nn.Intervention`` (add or replace vectors at
chosen layers and tokens); ``edit_at`` builds one that edits given positions of every
row, and ``read_activations`` takes an intervention too, so a read can happen under an
edit.

Any model called like ``lhc.lm.Transformer`` works: models trained in lhc and imported
Hugging Face checkpoints (``lhc.lm.hf.load``), stacked (``scan_layers=True``) or looped
layers, or a wrapper whose decoder is a submodule. Jitted: the model is static; tokens,
positions and the intervention's vectors are traced (a new vector does not compile).

    acts, logits = read_activations(model, params, tokens, at=[[5, 9]])       # [L, 1, 2, D]
    steer = edit_at(model.config.num_layers, tokens.shape[1], [[9]], vector, layers=[3])
    logits, _ = model.apply({"params": params}, tokens, positions, intervention=steer)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lhc.nn import intervention as edits
from lhc.nn.intervention import Edit, Intervention

SITES = {"residual": "residual", "attention": "attention_out", "layer_input": "layer_input"}


def _decoder_intermediates(tree, scan_layers: bool):
    """The subtree holding the blocks' sown values (a wrapper nests the decoder)."""
    key = "layers" if scan_layers else "layers_0"
    if key in tree:
        return tree
    for value in tree.values():
        if isinstance(value, dict):
            found = _decoder_intermediates(value, scan_layers)
            if found is not None:
                return found
    return None


def layer_stack(intermediates, site: str, config) -> jax.Array:
    """``[L, B, T, D]``: ``site``'s activations of every layer, from the ``intermediates``
    collection of a pass (``model.apply(..., mutable=["intermediates"])``)."""
    inter = _decoder_intermediates(intermediates, config.scan_layers)
    name = SITES[site]
    if config.scan_layers:
        return inter["layers"][name][0]
    return jnp.stack([inter[f"layers_{i}"][name][0] for i in range(config.num_layers)])


@functools.partial(jax.jit, static_argnums=0, static_argnames=("site", "logits"))
def _read(model, params, tokens, positions, at, intervention, *, site, logits=True):
    extra = {} if intervention is None else {"intervention": intervention}
    (out, _), state = model.apply(
        {"params": params}, tokens, positions, mutable=["intermediates"], **extra
    )
    stack = layer_stack(state["intermediates"], site, model.config)
    rows = jnp.arange(tokens.shape[0])[:, None]
    # Unused logits are not computed: XLA drops the output projection.
    return stack[:, rows, at], out[rows, at] if logits else None


def check_positions(at, lengths, name: str = "at") -> np.ndarray:
    """``at`` as int32 ``[B, K]`` after checking each entry lies in ``[0, lengths[b])``.

    Args:
        at: int ``[B, K]``.
        lengths: an int (every row) or int ``[B]``.

    Raises:
        ValueError: ``at`` is not an int ``[B, K]`` array, or an entry lies outside
            its row (the message names the entry and the row's length).
    """
    at = np.asarray(at)
    if at.ndim != 2 or not np.issubdtype(at.dtype, np.integer):
        raise ValueError(f"{name} must be int [batch, positions], got {at.dtype}{list(at.shape)}")
    lengths = np.broadcast_to(np.asarray(lengths), (at.shape[0],))
    bad = (at < 0) | (at >= lengths[:, None])
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(
            f"{name}[{row}, {col}] = {at[row, col]} is not a position of the prompt "
            f"(row {row} has {lengths[row]} tokens)"
        )
    return at.astype(np.int32)


def read_activations(
    model,
    params,
    tokens,
    at,
    *,
    site: str = "residual",
    positions=None,
    lengths=None,
    intervention: Intervention | None = None,
    logits: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """One site's activations at positions ``at`` of every row, for every layer.

    Args:
        model: an ``lhc.lm.Transformer`` or a model called like one, with ``config``.
        params: its parameters.
        tokens: int ``[B, T]``.
        at: int ``[B, K]``: the columns to read in each row.
        site: ``"residual"``, ``"attention"`` or ``"layer_input"``.
        positions: int ``[B, T]`` (default ``arange(T)`` in every row).
        lengths: int ``[B]`` or an int: the real tokens of each row (right padding
            follows; default ``T``); ``at`` must lie inside.
        intervention: edits applied during the pass.
        logits: False: the activations only (the logits come back ``None``).

    Returns:
        ``(activations, logits)``: float ``[L, B, K, D]``, and the logits ``[B, K, V]``
        at the same columns.

    Raises:
        ValueError: an unknown site, tokens not ``[B, T]``, or a position outside its
            row.
    """
    if site not in SITES:
        raise ValueError(f"site must be one of {sorted(SITES)}, got {site!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int [batch, length], got shape {tokens.shape}")
    batch, width = tokens.shape
    at = check_positions(at, width if lengths is None else lengths)
    if at.shape[0] != batch:
        raise ValueError(f"at has {at.shape[0]} rows, tokens has {batch}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    return _read(
        model,
        params,
        tokens,
        jnp.asarray(positions),
        jnp.asarray(at),
        intervention,
        site=site,
        logits=logits,
    )


def edit_at(
    num_layers: int,
    width: int,
    at,
    values,
    *,
    layers=None,
    per_layer: bool = False,
    site: str = "residual",
    mode: str = "add",
) -> Intervention:
    """An intervention that edits the columns ``at`` of every row at ``layers``.

    Args:
        num_layers: the model's layer count.
        width: ``T``, the length of the sequences it will edit.
        at: int ``[B, K]``: the columns to edit in each row (distinct within a row).
        values: ``[D]`` (everywhere), ``[K, D]`` (one per column) or ``[B, K, D]``;
            with ``per_layer``, a leading axis of ``len(layers)``.
        layers: the layers to edit (default every layer).
        per_layer: ``values`` has one entry per layer of ``layers``.
        site: ``"residual"`` or ``"attention"``.
        mode: ``"add"`` or ``"replace"``.

    Raises:
        ValueError: a layer outside the model, a column outside ``[0, width)``, or
            values of another shape.
    """
    at = check_positions(at, width)
    batch, count = at.shape
    layers = list(range(num_layers)) if layers is None else [int(i) for i in layers]
    values = jnp.asarray(values)
    given = values.shape
    if not per_layer:
        values = jnp.broadcast_to(values, (len(layers), *values.shape))
    if values.shape[0] != len(layers) or not 2 <= values.ndim <= 4:
        raise ValueError(
            f"values must be [D], [K, D] or [B, K, D]{' after a leading [layers]' * per_layer}"
            f" with {len(layers)} layers; got {given}"
        )
    dim = values.shape[-1]
    body = values.shape[1:-1]
    if body not in ((), (count,), (batch, count)):
        raise ValueError(
            f"values must be per column ([{count}, D]) or per row and column "
            f"([{batch}, {count}, D]); got {given}"
        )
    values = values.reshape(len(layers), *((1,) * (2 - len(body))), *body, dim)
    values = jnp.broadcast_to(values, (len(layers), batch, count, dim))
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad or site not in edits.SITES or mode not in edits.MODES:
        # The same checks and messages as Intervention.at's.
        Intervention.at(num_layers, layers=layers, values=jnp.zeros(dim), site=site, mode=mode)
    # One scatter into the [L, B, T, D] edit (not a copy per layer).
    index = (np.asarray(layers)[:, None, None], np.arange(batch)[None, :, None], at[None])
    dtype = jnp.result_type(values.dtype, jnp.float32)
    dense = jnp.zeros((num_layers, batch, width, dim), dtype).at[index].set(values.astype(dtype))
    mask = np.zeros((num_layers, batch, width), bool)
    mask[index] = True
    edit = Edit(
        values=dense, mask=jnp.asarray(mask), replace=jnp.full((num_layers,), mode == "replace")
    )
    return Intervention(**{site: edit})
