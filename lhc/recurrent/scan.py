"""The two recurrences of lhc's recurrent LMs, in a chunked parallel form and one step.

* SSD (Mamba-2's state-space dual), a scalar decay per head::

      h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        h: [P, N] per head
      y_t = h_t C_t

* GLA (gated linear attention), a decay per key channel::

      S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t          S: [Dk, Dv] per head
      o_t = q_t S_t

The chunked forms split the sequence into chunks of ``chunk_size`` tokens: inside a
chunk, outputs are a masked, decayed attention over the chunk's own tokens; across
chunks, one state per chunk is carried by a ``lax.scan``. Every decay factor is formed
as ``exp`` of a non-positive difference of cumulative log-decays *within one chunk*, so
no factor exceeds 1 and nothing overflows at any length or decay strength (the
``q exp(b), k exp(-b)`` factorisation does overflow for strong decays). Memory is
linear in the length: ``[T / L, L, L]`` decay matrices per head (SSD), for GLA (whose
decays differ per channel) ``[T / l, l, l, Dk]`` within sub-chunks of l = 16 tokens and
decayed queries ``[T, L / l, Dk]`` across them, and one state per chunk.

Shapes follow the Mamba-2 and flash-linear-attention conventions: batch first, then
time, then heads. Inputs may be any float dtype; the recurrences run in float32, outputs
come back in the dtype of ``x`` (SSD) or ``v`` (GLA) and states in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# GLA's pair-by-pair decays are formed within sub-chunks of this many tokens (the
# greatest common divisor with the chunk size); across sub-chunks the scores are matmuls.
GLA_SUB_CHUNK = 16


def _check_rank(name: str, array, rank: int, layout: str) -> None:
    if jnp.ndim(array) != rank:
        raise ValueError(f"{name} must be {layout}, got shape {jnp.shape(array)}")


def _check_chunk_size(chunk_size) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _check_shape(name: str, array, expected: tuple[int, ...], layout: str) -> None:
    if tuple(jnp.shape(array)) != tuple(expected):
        raise ValueError(f"{name} must be {layout} = {tuple(expected)}, got {jnp.shape(array)}")


def _chunked(array: jax.Array, chunk_size: int) -> jax.Array:
    """``[b, T, ...]`` zero-padded to whole chunks and split: ``[b, T / L, L, ...]``."""
    b, t = array.shape[:2]
    pad = -t % chunk_size
    array = jnp.pad(array, [(0, 0), (0, pad)] + [(0, 0)] * (array.ndim - 2))
    return array.reshape(b, (t + pad) // chunk_size, chunk_size, *array.shape[2:])


def _carry_states(decay: jax.Array, increments: jax.Array, initial: jax.Array):
    """``h_c = decay_c * h_{c-1} + increments_c`` over the chunk axis (1) by ``lax.scan``.

    Returns the state *entering* each chunk, ``[b, C, ...]``, and the final state.
    """

    def step(h, inputs):
        d, inc = inputs
        return d * h + inc, h

    final, entering = jax.lax.scan(
        step, initial, (jnp.moveaxis(decay, 1, 0), jnp.moveaxis(increments, 1, 0))
    )
    return jnp.moveaxis(entering, 0, 1), final


def _ssd_shapes(x, dt, A, B, C, initial_state, *, single_step: bool):
    t_axis = () if single_step else ("T",)
    _check_rank("x", x, 3 if single_step else 4, f"[b, {'T, ' * (not single_step)}H, P]")
    b = x.shape[0]
    h, p = x.shape[-2:]
    lead = (b,) + (() if single_step else (x.shape[1],))
    _check_shape("dt", dt, lead + (h,), f"[b, {'T, ' * bool(t_axis)}H]")
    _check_shape("A", A, (h,), "[H]")
    _check_rank("B", B, len(lead) + 2, f"[b, {'T, ' * bool(t_axis)}G, N]")
    g, n = B.shape[-2:]
    _check_shape("B", B, lead + (g, n), f"[b, {'T, ' * bool(t_axis)}G, N]")
    _check_shape("C", C, lead + (g, n), f"[b, {'T, ' * bool(t_axis)}G, N] (the shape of B)")
    if h % g:
        raise ValueError(f"the heads of x ({h}) must be a multiple of the groups of B, C ({g})")
    if initial_state is not None:
        _check_shape("initial_state", initial_state, (b, h, p, n), "[b, H, P, N]")
    return b, h, p, g, n


def _heads(array: jax.Array, heads: int) -> jax.Array:
    """``[..., G, N]`` repeated over the heads of each group: ``[..., H, N]``."""
    return jnp.repeat(array, heads // array.shape[-2], axis=-2)


def ssd(x, dt, A, B, C, *, chunk_size: int, initial_state=None):
    """Mamba-2's SSD recurrence over a sequence, chunked.

    Args:
        x: ``[b, T, H, P]`` inputs.
        dt: ``[b, T, H]`` positive step sizes (already through softplus and bias).
        A: ``[H]`` negative decay rates; the decay of step t is ``exp(dt_t A)``.
        B: ``[b, T, G, N]`` input projections, G groups shared by ``H / G`` heads each.
        C: ``[b, T, G, N]`` output projections.
        chunk_size: L, tokens per chunk (T need not be a multiple).
        initial_state: ``[b, H, P, N]`` state before the first token; zeros if None.

    Returns:
        ``(y, final_state)``: ``y [b, T, H, P]`` in the dtype of ``x`` and the state after
        the last token, ``[b, H, P, N]`` float32.
    """
    chunk_size = _check_chunk_size(chunk_size)
    b, h, p, _, n = _ssd_shapes(x, dt, A, B, C, initial_state, single_step=False)
    t = x.shape[1]
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((b, h, p, n), f32)
    # Padded tokens have dt = 0: no decay and no input, so they leave the state alone.
    xs = _chunked(x.astype(f32), chunk_size)  # [b, c, L, H, P]
    dts = _chunked(dt.astype(f32), chunk_size)  # [b, c, L, H]
    Bs = _chunked(_heads(B.astype(f32), h), chunk_size)  # [b, c, L, H, N]
    Cs = _chunked(_heads(C.astype(f32), h), chunk_size)
    log_decay = dts * A.astype(f32)  # [b, c, L, H], <= 0
    cum = jnp.cumsum(log_decay, axis=2)  # within each chunk
    # decay from token s to token t of one chunk (t >= s): exp(cum_t - cum_s) <= 1.
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, c, t, s, H]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))[None, None, :, :, None]
    decay_ts = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    u = xs * dts[..., None]  # dt_s x_s
    scores = jnp.einsum("bctHn,bcsHn->bctsH", Cs, Bs) * decay_ts
    y_intra = jnp.einsum("bctsH,bcsHp->bctHp", scores, u)
    # Each chunk's own contribution to the state at its end, and its total decay.
    to_end = jnp.exp(cum[:, :, -1:, :] - cum)  # [b, c, L, H], <= 1
    increments = jnp.einsum("bcsH,bcsHp,bcsHn->bcHpn", to_end, u, Bs)
    chunk_decay = jnp.exp(cum[:, :, -1, :])[..., None, None]  # [b, c, H, 1, 1]
    entering, final = _carry_states(chunk_decay, increments, initial_state.astype(f32))
    y_inter = jnp.einsum("bctH,bcHpn,bctHn->bctHp", jnp.exp(cum), entering, Cs)
    y = (y_intra + y_inter).reshape(b, -1, h, p)[:, :t]
    return y.astype(x.dtype), final


def ssd_step(x, dt, A, B, C, state):
    """One token of SSD: ``x [b, H, P]``, ``dt [b, H]``, ``A [H]``, ``B, C [b, G, N]``,
    ``state [b, H, P, N]``. Returns ``(y [b, H, P], new_state)``."""
    _, h, *_ = _ssd_shapes(x, dt, A, B, C, state, single_step=True)
    f32 = jnp.float32
    dt = dt.astype(f32)
    decay = jnp.exp(dt * A.astype(f32))[..., None, None]
    Bh, Ch = _heads(B.astype(f32), h), _heads(C.astype(f32), h)
    new = decay * state.astype(f32) + jnp.einsum("bhp,bhn->bhpn", x.astype(f32) * dt[..., None], Bh)
    y = jnp.einsum("bhpn,bhn->bhp", new, Ch)
    return y.astype(x.dtype), new


def _gla_shapes(q, k, v, log_gates, initial_state, *, single_step: bool):
    layout = "[b, H, D]" if single_step else "[b, T, H, D]"
    _check_rank("q", q, 3 if single_step else 4, layout.replace("D", "Dk"))
    _check_shape("k", k, q.shape, layout.replace("D", "Dk") + " (the shape of q)")
    _check_shape("log_gates", log_gates, q.shape, layout.replace("D", "Dk") + " (the shape of q)")
    _check_rank("v", v, q.ndim, layout.replace("D", "Dv"))
    _check_shape("v", v, q.shape[:-1] + v.shape[-1:], layout.replace("D", "Dv"))
    b, h, dk, dv = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    if initial_state is not None:
        _check_shape("initial_state", initial_state, (b, h, dk, dv), "[b, H, Dk, Dv]")
    return b, h, dk, dv


def _gla_intra_chunk(qs, ks, vs, cum, sub: int) -> jax.Array:
    """The part of each chunk's outputs that its own tokens make, ``[b, c, L, H, Dv]``.

    Token s decays to token t by ``exp(cum_t - cum_s)`` per channel. Within a sub-chunk
    of ``sub`` tokens that factor is formed pair by pair (``[sub, sub, Dk]``); between
    sub-chunks it splits at the end ``e`` of the earlier one, ``exp(cum_t - cum_e)
    exp(cum_e - cum_s)``, both factors at most 1, so the scores are matmuls of decayed
    queries and keys.
    """
    b, c, length, h, dk = qs.shape
    n = length // sub
    split = lambda a: a.reshape(b, c, n, sub, *a.shape[3:])  # noqa: E731
    q_sub, k_sub, v_sub, cum_sub = split(qs), split(ks), split(vs), split(cum)
    # Within sub-chunks: [b, c, n, t, s, H, Dk].
    diff = cum_sub[:, :, :, :, None] - cum_sub[:, :, :, None, :]
    causal = jnp.tril(jnp.ones((sub, sub), bool))[:, :, None, None]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    scores = jnp.einsum("bcntHd,bcnsHd,bcntsHd->bcntsH", q_sub, k_sub, decay)
    o = jnp.einsum("bcntsH,bcnsHv->bcntHv", scores, v_sub).reshape(b, c, length, h, -1)
    if n == 1:
        return o
    # Between sub-chunks: query t against the keys of every earlier sub-chunk j.
    end = cum_sub[:, :, :, -1]  # [b, c, n, H, Dk]
    earlier = (jnp.arange(n)[None, :] < (jnp.arange(length) // sub)[:, None])[:, :, None, None]
    to_t = cum[:, :, :, None] - end[:, :, None]  # [b, c, L, n, H, Dk], <= 0 where earlier
    q_dec = jnp.where(earlier, qs[:, :, :, None] * jnp.exp(jnp.where(earlier, to_t, 0.0)), 0.0)
    k_dec = k_sub * jnp.exp(end[:, :, :, None] - cum_sub)  # [b, c, n, sub, H, Dk]
    between = jnp.einsum("bctjHd,bcjsHd->bctjsH", q_dec, k_dec)
    return o + jnp.einsum("bctjsH,bcjsHv->bctHv", between, v_sub)


def gla(q, k, v, log_gates, *, chunk_size: int, initial_state=None):
    """Gated linear attention over a sequence, chunked.

    Args:
        q, k: ``[b, T, H, Dk]``.
        v: ``[b, T, H, Dv]``.
        log_gates: ``[b, T, H, Dk]``, the log of the per-channel forget gates (<= 0).
        chunk_size: L, tokens per chunk (T need not be a multiple); a multiple of 16
            (``GLA_SUB_CHUNK``) keeps the pair-by-pair decays to ``[16, 16, Dk]`` blocks.
        initial_state: ``[b, H, Dk, Dv]`` state before the first token; zeros if None.

    Returns:
        ``(o, final_state)``: ``o [b, T, H, Dv]`` in the dtype of ``v`` and the state
        after the last token, ``[b, H, Dk, Dv]`` float32.
    """
    chunk_size = _check_chunk_size(chunk_size)
    b, h, dk, dv = _gla_shapes(q, k, v, log_gates, initial_state, single_step=False)
    t = q.shape[1]
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, dv), f32)
    # Padded tokens have k = 0 and log-gate 0: they leave the state alone.
    qs, ks, vs = (_chunked(a.astype(f32), chunk_size) for a in (q, k, v))
    cum = jnp.cumsum(_chunked(log_gates.astype(f32), chunk_size), axis=2)  # [b, c, L, H, Dk]
    o_intra = _gla_intra_chunk(qs, ks, vs, cum, math.gcd(chunk_size, GLA_SUB_CHUNK))
    to_end = jnp.exp(cum[:, :, -1:] - cum)  # [b, c, L, H, Dk], <= 1
    increments = jnp.einsum("bcsHd,bcsHv->bcHdv", ks * to_end, vs)
    chunk_decay = jnp.exp(cum[:, :, -1])[..., None]  # [b, c, H, Dk, 1]
    entering, final = _carry_states(chunk_decay, increments, initial_state.astype(f32))
    o_inter = jnp.einsum("bctHd,bcHdv->bctHv", qs * jnp.exp(cum), entering)
    o = (o_intra + o_inter).reshape(b, -1, h, dv)[:, :t]
    return o.astype(v.dtype), final


def gla_step(q, k, v, log_gates, state):
    """One token of GLA: ``q, k, log_gates [b, H, Dk]``, ``v [b, H, Dv]``,
    ``state [b, H, Dk, Dv]``. Returns ``(o [b, H, Dv], new_state)``."""
    _gla_shapes(q, k, v, log_gates, state, single_step=True)
    f32 = jnp.float32
    new = jnp.exp(log_gates.astype(f32))[..., None] * state.astype(f32) + jnp.einsum(
        "bhd,bhv->bhdv", k.astype(f32), v.astype(f32)
    )
    o = jnp.einsum("bhd,bhdv->bhv", q.astype(f32), new)
    return o.astype(v.dtype), new
