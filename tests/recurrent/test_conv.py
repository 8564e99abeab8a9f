"""causal_conv against a direct computation on each row's real inputs."""

import numpy as np
import pytest

from lhc.recurrent.conv import causal_conv


def direct(x, weight, bias, real, state):
    """Row by row: the real inputs behind the state, convolved, put back in place."""
    k = weight.shape[0]
    y = np.zeros_like(x, dtype=np.float64)
    new_state = np.zeros_like(state, dtype=np.float64)
    for b in range(x.shape[0]):
        seq = list(state[b]) + [x[b, i] for i in range(x.shape[1]) if real[b, i]]
        out = [
            bias + sum(weight[j] * seq[n - k + 1 + j] for j in range(k))
            for n in range(k - 1, len(seq))
        ]
        y[b, real[b]] = np.array(out).reshape(-1, x.shape[2])
        new_state[b] = np.array(seq[len(seq) - (k - 1) :]).reshape(k - 1, x.shape[2])
    return y, new_state


@pytest.mark.parametrize("k", [1, 2, 4])
def test_padding_anywhere_and_state(k):
    r = np.random.default_rng(k)
    b, t, c = 3, 9, 5
    x = r.normal(size=(b, t, c)).astype(np.float32)
    weight, bias = r.normal(size=(k, c)).astype(np.float32), r.normal(size=c).astype(np.float32)
    state = r.normal(size=(b, k - 1, c)).astype(np.float32)
    real = r.random((b, t)) < 0.6
    real[0] = True  # no padding
    real[1, :4] = False  # left padding and holes
    real[2] = False  # only padding: the state passes through
    y, new_state = causal_conv(x, weight, bias, real=real, state=state)
    y_ref, state_ref = direct(x, weight, bias, real, state)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_state, state_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_state[2], state[2])


def test_one_call_equals_token_by_token():
    r = np.random.default_rng(0)
    x = r.normal(size=(2, 7, 3)).astype(np.float32)
    weight = r.normal(size=(4, 3)).astype(np.float32)
    y, final = causal_conv(x, weight)
    state, ys = None, []
    for i in range(7):
        step, state = causal_conv(x[:, i : i + 1], weight, state=state)
        ys.append(step)
    np.testing.assert_allclose(np.concatenate(ys, 1), y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, final)


def test_bad_input_is_a_clear_error():
    x = np.zeros((2, 5, 3), np.float32)
    with pytest.raises(ValueError, match=r"weight must be \[K, C=3\]"):
        causal_conv(x, np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"state must be \[b, K - 1, C\] = \(2, 3, 3\)"):
        causal_conv(x, np.zeros((4, 3)), state=np.zeros((2, 4, 3)))
