"""Fixtures of the lm tests."""

import types

import pytest

from ..support import forward, inv_frequencies


@pytest.fixture(scope="session")
def numpy_lm():
    """The numpy reference (``tests/support.py``): ``forward(config, params, tokens)``,
    ``inv_frequencies``."""
    return types.SimpleNamespace(forward=forward, inv_frequencies=inv_frequencies)


@pytest.fixture(params=[None, 4], ids=["dense_held_keys", "held_keys_in_blocks_of_4"])
def held_block(request, monkeypatch):
    """Runs a test as is, and with the held keys of several-token calls read in blocks of
    4 slots (``lhc.nn.attention.HELD_BLOCK``), so that tiny caches take the blocked path
    of long ones. Compiled programs are dropped around it: they were traced under the
    other setting."""
    import jax

    from lhc.nn import attention

    if request.param is None:
        yield None
        return
    jax.clear_caches()
    monkeypatch.setattr(attention, "HELD_BLOCK", request.param)
    yield request.param
    jax.clear_caches()
