"""Hierarchical quantization: nibble packing, codes against a direct per-group loop, the
error bounds of the 4-bit and 8-bit views as properties, and bad input."""

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

from lhc.quantspec import dequantize, pack_nibbles, quantize, unpack_nibbles


def test_packing_puts_even_elements_in_the_low_nibble():
    codes = np.array([[1, 2, 15, 0]], np.uint8)
    packed = np.asarray(pack_nibbles(codes))
    np.testing.assert_array_equal(packed, [[1 | 2 << 4, 15]])
    codes = np.random.default_rng(0).integers(0, 16, size=(3, 5, 8)).astype(np.uint8)
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(codes)), codes)


# Jitted, so that each shape compiles once (eagerly every operation would).
_quantize = jax.jit(quantize, static_argnames=("group_axis", "group_size"))
_dequantize = jax.jit(dequantize, static_argnames=("bits",))


def _groups(x, axis, size):
    """(index arrays of each group) for a direct loop over the groups."""
    moved = np.moveaxis(np.arange(x.size).reshape(x.shape), axis, -1)
    lead = moved.reshape(-1, x.shape[axis])
    for row in lead:
        for start in range(0, len(row), size):
            yield np.unravel_index(row[start : start + size], x.shape)


def _check(x, axis, size):
    q = _quantize(x, group_axis=axis, group_size=size)
    upper, lower = np.asarray(unpack_nibbles(q.upper)), np.asarray(unpack_nibbles(q.lower))
    m = np.repeat(np.asarray(q.minimum, np.float64), size, axis=axis % x.ndim)
    s = np.repeat(np.asarray(q.scale, np.float64), size, axis=axis % x.ndim)
    x64 = x.astype(np.float64)
    four, eight = (np.asarray(_dequantize(q, bits=b), np.float64) for b in (4, 8))
    for index in _groups(x, axis % x.ndim, size):
        # The stored range covers the group; the codes are the definitions, group by group.
        g, gm, gs = x64[index], m[index][0], s[index][0]
        assert gm <= g.min() and gm + 15 * gs >= g.max() * (1 - 1e-7) - 1e-30
        safe = gs if gs > 0 else 1.0
        want_u = np.clip(np.round((g - gm) / safe), 0, 15)
        np.testing.assert_array_equal(upper[index], want_u)
        want_lo = np.clip(np.round((g - gm - gs * want_u) / (safe / 16)), -8, 7) + 8
        assert np.abs(lower[index].astype(int) - want_lo).max() <= 1  # float32 rounding ties
    slack = 1e-6 * (np.abs(x64) + s) + 1e-30
    assert (np.abs(four - x64) <= s / 2 + slack).all()
    assert (np.abs(eight - x64) <= s / 16 + slack).all()
    unclipped = lower < 15
    assert (np.abs(eight - x64)[unclipped] <= s[unclipped] / 32 + slack[unclipped]).all()
    return q


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    groups=st.integers(1, 2),
    size=st.sampled_from([4, 8]),
    magnitude=st.floats(-4, 3),  # float16 scales: values well inside its range
    keys=st.booleans(),
)
def test_codes_and_error_bounds(seed, groups, size, magnitude, keys):
    r = np.random.default_rng(seed)
    if keys:  # per channel over tokens: [b, T, H], groups along T
        shape, axis = (2, groups * size, 4), 1
    else:  # per token over channels: [b, T, H], groups along H
        shape, axis = (2, 4, groups * size), -1
    x = r.standard_normal(shape) * 10.0**magnitude + r.normal() * 10.0**magnitude
    _check(x.astype(np.float32), axis, size)


def test_constant_groups_and_float32_scales_are_exact_where_they_can_be():
    x = np.full((2, 8, 4), 3.25, np.float32)
    q = quantize(x, group_axis=1, group_size=4)
    np.testing.assert_array_equal(dequantize(q, bits=4), x)
    np.testing.assert_array_equal(dequantize(q, bits=8), x)
    # Values on the 8-bit grid (m = 0, s = 1: U + j / 16, |j| <= 7) come back exactly.
    grid = np.unique([u + j / 16 for u in range(16) for j in range(-7, 8) if 0 <= u + j / 16 <= 15])
    x = np.repeat(grid.astype(np.float32)[None, :, None], 2, axis=2)
    q = quantize(x, group_axis=1, group_size=len(grid))
    assert float(q.scale[0, 0, 0]) == 1.0 and float(q.minimum[0, 0, 0]) == 0.0
    np.testing.assert_array_equal(dequantize(q, bits=8), x)


def test_float32_scales_for_values_beyond_float16():
    x = np.random.default_rng(0).normal(size=(1, 8, 4)).astype(np.float32) * 1e6
    _check_scales = quantize(x, group_axis=1, group_size=4, scale_dtype=np.float32)
    err = np.abs(np.asarray(dequantize(_check_scales, bits=8)) - x)
    assert np.isfinite(err).all() and err.max() <= float(np.max(_check_scales.scale)) / 16 * 1.001


def test_bad_input_is_a_clear_error():
    x = np.zeros((2, 8, 4), np.float32)
    with pytest.raises(
        ValueError,
        match=r"group_size must be a positive int dividing axis 1 of shape \(2, 8, 4\) \(8\), got 3",
    ):
        quantize(x, group_axis=1, group_size=3)
    with pytest.raises(ValueError, match="last axis .* must be even"):
        quantize(np.zeros((2, 8, 3)), group_axis=1, group_size=4)
    with pytest.raises(ValueError, match="group_axis must be an axis of the 3-d input, got 3"):
        quantize(x, group_axis=3, group_size=4)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 2"):
        dequantize(quantize(x, group_axis=1, group_size=4), bits=2)
