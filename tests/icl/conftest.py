"""A tiny random decoder shared by the icl tests."""

import pytest

from lhc import lm

from ..support import random_params

CONFIG = lm.LMConfig.tiny(num_layers=3, max_len=64, scan_layers=False)


@pytest.fixture(scope="package")
def tiny():
    """``(model, params)`` of a 3-layer random decoder (layers looped): weights of
    standard deviation 8 ** -0.5, norm scales near one."""
    return lm.Transformer(CONFIG), random_params(CONFIG, scale=8**-0.5, norms=0.2)
