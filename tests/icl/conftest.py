"""A tiny random decoder shared by the icl tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm

CONFIG = lm.LMConfig.tiny(num_layers=3, max_len=64, scan_layers=False)


def random_params(config=CONFIG, seed=0):
    """Parameters drawn in numpy (no initialiser to compile)."""
    abstract = nn.meta.unbox(lm.abstract_params(config))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.asarray(1 + 0.2 * rng.normal(size=leaf.shape), leaf.dtype)
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(8), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="package")
def tiny():
    """``(model, params)`` of a 3-layer random decoder (layers looped)."""
    return lm.Transformer(CONFIG), random_params()
