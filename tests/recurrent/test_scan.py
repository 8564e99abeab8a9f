"""The chunked SSD and GLA recurrences against the step-by-step recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.recurrent import gla, gla_step, ssd, ssd_step


def ssd_reference(x, dt, A, B, C, h0):
    """The SSD recurrence token by token, in float64 numpy."""
    x, dt, A, B, C, h = (np.asarray(a, np.float64) for a in (x, dt, A, B, C, h0))
    heads_per_group = x.shape[2] // B.shape[2]
    B, C = (np.repeat(a, heads_per_group, axis=2) for a in (B, C))
    ys = []
    for t in range(x.shape[1]):
        decay = np.exp(dt[:, t] * A)[:, :, None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(np.einsum("bhpn,bhn->bhp", h, C[:, t]))
    return np.stack(ys, 1), h


def gla_reference(q, k, v, g, s0):
    """The GLA recurrence token by token, in float64 numpy."""
    q, k, v, g, s = (np.asarray(a, np.float64) for a in (q, k, v, g, s0))
    outs = []
    for t in range(q.shape[1]):
        s = np.exp(g[:, t])[..., None] * s + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(np.einsum("bhd,bhdv->bhv", q[:, t], s))
    return np.stack(outs, 1), s


def ssd_inputs(seed, b=2, t=13, h=4, p=3, g=2, n=5, log_dt=0.0):
    r = np.random.default_rng(seed)
    f = np.float32
    return dict(
        x=r.normal(size=(b, t, h, p)).astype(f),
        dt=np.exp(r.normal(log_dt, 0.5, size=(b, t, h))).astype(f),
        A=-np.exp(r.normal(size=h)).astype(f),
        B=r.normal(size=(b, t, g, n)).astype(f),
        C=r.normal(size=(b, t, g, n)).astype(f),
        h0=r.normal(size=(b, h, p, n)).astype(f),
    )


def gla_inputs(seed, b=2, t=13, h=3, dk=4, dv=5, gate_scale=1.0):
    r = np.random.default_rng(seed)
    f = np.float32
    return dict(
        q=r.normal(size=(b, t, h, dk)).astype(f),
        k=r.normal(size=(b, t, h, dk)).astype(f),
        v=r.normal(size=(b, t, h, dv)).astype(f),
        g=(-gate_scale * np.exp(r.normal(-1, 1, size=(b, t, h, dk)))).astype(f),
        s0=r.normal(size=(b, h, dk, dv)).astype(f),
    )


def run_ssd(a, chunk_size, **kw):
    return ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk_size=chunk_size, **kw)


def run_gla(a, chunk_size, **kw):
    return gla(a["q"], a["k"], a["v"], a["g"], chunk_size=chunk_size, **kw)


@pytest.mark.parametrize("chunk_size, t", [(1, 7), (4, 13), (5, 10), (16, 13)])
def test_ssd_equals_the_recurrence(chunk_size, t):
    a = ssd_inputs(chunk_size, t=t)
    y, final = run_ssd(a, chunk_size, initial_state=a["h0"])
    y_ref, final_ref = ssd_reference(a["x"], a["dt"], a["A"], a["B"], a["C"], a["h0"])
    np.testing.assert_allclose(y, y_ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(final, final_ref, rtol=2e-4, atol=2e-4)
    y0, _ = run_ssd(a, chunk_size)  # no initial state: zeros
    y0_ref, _ = ssd_reference(a["x"], a["dt"], a["A"], a["B"], a["C"], 0 * a["h0"])
    np.testing.assert_allclose(y0, y0_ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("chunk_size, t", [(1, 7), (4, 13), (5, 10), (16, 13), (32, 45), (48, 50)])
def test_gla_equals_the_recurrence(chunk_size, t):
    """Chunks of one sub-chunk (1, 4, 16), and of several: 5 = 5 x 1, 32 = 2 x 16,
    48 = 3 x 16 (decays formed pair by pair within sub-chunks, matmuls across)."""
    a = gla_inputs(chunk_size, t=t)
    o, final = run_gla(a, chunk_size, initial_state=a["s0"])
    o_ref, final_ref = gla_reference(a["q"], a["k"], a["v"], a["g"], a["s0"])
    np.testing.assert_allclose(o, o_ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(final, final_ref, rtol=2e-4, atol=2e-4)


def scan_with(step, xs, state):
    """A sequence through a one-token step function by ``lax.scan`` (time on axis 1)."""

    def body(s, inputs):
        out, s = step(*inputs, s)
        return s, out

    final, outs = jax.lax.scan(body, state, tuple(jnp.moveaxis(x, 1, 0) for x in xs))
    return jnp.moveaxis(outs, 0, 1), final


def test_steps_equal_the_recurrence():
    a = ssd_inputs(1)
    y, final = scan_with(
        lambda x, dt, B, C, s: ssd_step(x, dt, a["A"], B, C, s),
        (a["x"], a["dt"], a["B"], a["C"]),
        a["h0"],
    )
    y_ref, final_ref = ssd_reference(a["x"], a["dt"], a["A"], a["B"], a["C"], a["h0"])
    np.testing.assert_allclose(y, y_ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(final, final_ref, rtol=2e-4, atol=2e-4)
    a = gla_inputs(2)
    o, final = scan_with(gla_step, (a["q"], a["k"], a["v"], a["g"]), a["s0"])
    o_ref, final_ref = gla_reference(a["q"], a["k"], a["v"], a["g"], a["s0"])
    np.testing.assert_allclose(o, o_ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(final, final_ref, rtol=2e-4, atol=2e-4)


def test_gradients_of_every_input_equal_the_sequential_scan():
    """Gradients of a random projection of the outputs and final state, chunked (L = 4,
    T = 11) against a ``lax.scan`` of the steps written here from the formulas."""

    def ssd_scan(x, dt, A, B, C, h0):
        hpg = x.shape[2] // B.shape[2]

        def step(x, dt, B, C, h):
            B, C = jnp.repeat(B, hpg, 1), jnp.repeat(C, hpg, 1)
            h = (
                jnp.exp(dt * A)[..., None, None] * h
                + (dt[..., None] * x)[..., None] * B[:, :, None]
            )
            return jnp.einsum("bhpn,bhn->bhp", h, C), h

        return scan_with(step, (x, dt, B, C), h0)

    def gla_scan(q, k, v, g, s0):
        def step(q, k, v, g, s):
            s = jnp.exp(g)[..., None] * s + k[..., None] * v[..., None, :]
            return jnp.einsum("bhd,bhdv->bhv", q, s), s

        return scan_with(step, (q, k, v, g), s0)

    def projected(fn, seed):
        def loss(*args):
            out, final = fn(*args)
            r = np.random.default_rng(seed)
            return jnp.sum(out * r.normal(size=out.shape)) + jnp.sum(
                final * r.normal(size=final.shape)
            )

        return loss

    a = ssd_inputs(3, t=11)
    args = (a["x"], a["dt"], a["A"], a["B"], a["C"], a["h0"])
    chunked = lambda x, dt, A, B, C, h0: ssd(x, dt, A, B, C, chunk_size=4, initial_state=h0)  # noqa: E731
    got = jax.grad(projected(chunked, 0), argnums=range(6))(*args)
    want = jax.grad(projected(ssd_scan, 0), argnums=range(6))(*args)
    for name, g1, g2 in zip(("x", "dt", "A", "B", "C", "h0"), got, want):
        np.testing.assert_allclose(g1, g2, rtol=1e-3, atol=1e-3, err_msg=name)

    a = gla_inputs(4, t=11)
    args = (a["q"], a["k"], a["v"], a["g"], a["s0"])
    # chunk 6 = 3 sub-chunks of 2: both the within and the across sub-chunk terms.
    chunked = lambda q, k, v, g, s0: gla(q, k, v, g, chunk_size=6, initial_state=s0)  # noqa: E731
    got = jax.grad(projected(chunked, 1), argnums=range(5))(*args)
    want = jax.grad(projected(gla_scan, 1), argnums=range(5))(*args)
    for name, g1, g2 in zip(("q", "k", "v", "log_gates", "s0"), got, want):
        np.testing.assert_allclose(g1, g2, rtol=1e-3, atol=1e-3, err_msg=name)


def test_initial_state_is_honoured():
    """Running [a; b] from zero equals running b from the state after a."""
    a = ssd_inputs(5, t=17)
    y, final = run_ssd(a, 4)
    first = {k: v[:, :9] if v.ndim > 2 and k != "h0" else v for k, v in a.items()}
    second = {k: v[:, 9:] if v.ndim > 2 and k != "h0" else v for k, v in a.items()}
    _, mid = run_ssd(first, 4)
    y2, final2 = run_ssd(second, 4, initial_state=mid)
    np.testing.assert_allclose(y2, y[:, 9:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final2, final, rtol=1e-4, atol=1e-4)

    a = gla_inputs(6, t=17)
    o, final = run_gla(a, 4)
    _, mid = run_gla({k: v[:, :9] if k != "s0" else v for k, v in a.items()}, 4)
    o2, final2 = run_gla(
        {k: v[:, 9:] if k != "s0" else v for k, v in a.items()}, 4, initial_state=mid
    )
    np.testing.assert_allclose(o2, o[:, 9:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final2, final, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strength", ["strong", "weak"])
def test_long_inputs_stay_finite(strength):
    """4,096 tokens with decays of about exp(-50) a step, or barely below 1 (exp(-1e-4)):
    finite outputs, and with weak decays equal to the recurrence."""
    t = 4096
    a = ssd_inputs(
        7,
        b=1,
        t=t,
        h=2,
        p=2,
        g=1,
        n=2,
        log_dt=np.log(50.0) if strength == "strong" else np.log(1e-4),
    )
    a["A"] = -np.ones_like(a["A"])
    y, final = run_ssd(a, 64, initial_state=a["h0"])
    assert np.isfinite(y).all() and np.isfinite(final).all()
    g = gla_inputs(8, b=1, t=t, h=1, dk=2, dv=2, gate_scale=100.0 if strength == "strong" else 1e-4)
    o, gfinal = run_gla(g, 64, initial_state=g["s0"])  # 4 sub-chunks of 16
    assert np.isfinite(o).all() and np.isfinite(gfinal).all()
    if strength == "weak":
        y_ref, _ = ssd_reference(a["x"], a["dt"], a["A"], a["B"], a["C"], a["h0"])
        np.testing.assert_allclose(y, y_ref, rtol=1e-3, atol=1e-3)
        o_ref, _ = gla_reference(g["q"], g["k"], g["v"], g["g"], g["s0"])
        np.testing.assert_allclose(o, o_ref, rtol=1e-3, atol=2e-2)


def test_bad_input_is_a_clear_error():
    a = ssd_inputs(9)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        run_ssd(a, 0)
    with pytest.raises(ValueError, match=r"dt must be \[b, T, H\]"):
        ssd(a["x"], a["dt"][:, :-1], a["A"], a["B"], a["C"], chunk_size=4)
    with pytest.raises(ValueError, match="multiple of the groups"):
        ssd(a["x"][:, :, :3], a["dt"][:, :, :3], a["A"][:3], a["B"], a["C"], chunk_size=4)
    with pytest.raises(ValueError, match=r"initial_state must be \[b, H, P, N\]"):
        run_ssd(a, 4, initial_state=a["h0"][:, :1])
    g = gla_inputs(10)
    with pytest.raises(ValueError, match=r"log_gates must be \[b, T, H, Dk\]"):
        gla(g["q"], g["k"], g["v"], g["g"][..., :1], chunk_size=4)
    with pytest.raises(ValueError, match=r"v must be \[b, T, H, Dv\]"):
        gla(g["q"], g["k"], g["v"][:, :1], g["g"], chunk_size=4)
