"""Decoding under a mesh and logical-axis rules: the rules as a static jit argument, the
contexts that apply them, and caches constrained to their logical axes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

from lhc.parallel.mesh import LOGICAL_AXIS_RULES


def static_rules(
    mesh: jax.sharding.Mesh | None, rules: Sequence[tuple[str, Any]] | None
) -> tuple | None:
    """Logical-axis rules as a hashable static jit argument (the defaults under a mesh).

    Mesh-axis lists (from configs) become tuples; a change of rules retraces.
    """
    if mesh is not None and rules is None:
        rules = LOGICAL_AXIS_RULES
    if rules is None:
        return None
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in rules)


def mesh_context(mesh: jax.sharding.Mesh | None):
    """``jax.set_mesh(mesh)``, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def rules_context(rules: tuple | None):
    """``nn.logical_axis_rules(rules)``, or nothing without rules."""
    return contextlib.nullcontext() if rules is None else nn.logical_axis_rules(rules)


def with_rules(fn: Callable) -> Callable:
    """``fn`` run under ``rules_context(rules)``, ``rules`` an extra keyword argument (for
    a jitted function, a static one)."""

    def wrapped(*args, rules, **kwargs):
        with rules_context(rules):
            return fn(*args, **kwargs)

    wrapped.__name__ = wrapped.__qualname__ = fn.__name__  # no __wrapped__: jit sees `rules`
    return wrapped


def constrain_cache(cache):
    """The cache with every leaf constrained to its logical axes (under active rules)."""
    return jax.tree.map(
        lambda x, spec: nn.with_logical_constraint(x, tuple(spec)), cache, cache.logical_axes()
    )


def empty_cache(model: nn.Module, batch_size: int, cache_len: int):
    """``model.init_cache``, constrained to the cache's logical axes.

    Behind an optimization barrier: attention reads the stored keys before it writes the
    new ones, and XLA would otherwise constant-fold the first chunk's scores against an
    empty cache made in the same program (seconds of compilation per layer).
    """
    return jax.lax.optimization_barrier(constrain_cache(model.init_cache(batch_size, cache_len)))
