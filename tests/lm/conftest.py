"""Fixtures of the lm tests."""

import types

import pytest

from ..support import forward, inv_frequencies


@pytest.fixture(scope="session")
def numpy_lm():
    """The numpy reference (``tests/support.py``): ``forward(config, params, tokens)``,
    ``inv_frequencies``."""
    return types.SimpleNamespace(forward=forward, inv_frequencies=inv_frequencies)
