"""quant_kv_attention: the reference against brute force, the kernel (interpret mode)
against the reference on random stores, cuts and padding, the LSE merge, the TPU kernel
compiled ahead of time for v5e, the GPU kernel lowered for CUDA, and bad arguments."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.quant_kv_attention import (
    buffer_attention,
    buffer_attention_reference,
    merge_attention,
    quant_kv_attention,
    quant_kv_attention_reference,
)


def _store(seed, b=2, kv=2, s=64, h=16, g=16):
    """Random codes, scales and minima of a store (not from any quantizer)."""
    r = np.random.default_rng(seed)
    codes = lambda: r.integers(0, 256, size=(b, kv, s, h // 2)).astype(np.uint8)  # noqa: E731
    floats = lambda *shape: r.uniform(-1, 1, size=shape).astype(np.float16)  # noqa: E731
    return (
        codes(),
        codes(),
        np.abs(floats(b, kv, s // g, h)),
        floats(b, kv, s // g, h),
        codes(),
        codes(),
        np.abs(floats(b, kv, s, h // g)),
        floats(b, kv, s, h // g),
    )


def _brute_force(q, store, positions, cut, bits):
    """float64 numpy, one query and key at a time."""
    ku, kl, ks, km, vu, vl, vs, vm = (np.asarray(x) for x in store)
    b, t, n, h = q.shape
    kv, s = ku.shape[1], ku.shape[2]
    g = s // ks.shape[2]

    def nibble(codes, i):
        return (codes[..., i // 2] >> (4 * (i % 2))) & 15

    out = np.zeros((b, t, n, h))
    lse = np.full((b, t, n), np.nan)
    for bi in range(b):
        for head in range(n):
            k = head // (n // kv)
            keys = np.zeros((s, h))
            values = np.zeros((s, h))
            for slot in range(s):
                for c in range(h):
                    sc, mn = float(ks[bi, k, slot // g, c]), float(km[bi, k, slot // g, c])
                    keys[slot, c] = mn + sc * nibble(ku[bi, k, slot], c)
                    if bits == 8:
                        keys[slot, c] += sc / 16 * (nibble(kl[bi, k, slot], c) - 8.0)
                    sc, mn = float(vs[bi, k, slot, c // g]), float(vm[bi, k, slot, c // g])
                    values[slot, c] = mn + sc * nibble(vu[bi, k, slot], c)
                    if bits == 8:
                        values[slot, c] += sc / 16 * (nibble(vl[bi, k, slot], c) - 8.0)
            for ti in range(t):
                seen = [j for j in range(s) if j < cut[bi, ti] and positions[bi, j] >= 0]
                if not seen:
                    continue
                scores = keys[seen] @ np.asarray(q[bi, ti, head], np.float64) / np.sqrt(h)
                top = scores.max()
                w = np.exp(scores - top)
                out[bi, ti, head] = w @ values[seen] / w.sum()
                lse[bi, ti, head] = top + np.log(w.sum())
    return out, lse


def _case(seed, t, s=64, h=16, g=16, n=4, kv=2):
    r = np.random.default_rng(seed + 100)
    q = r.normal(size=(2, t, n, h)).astype(np.float32)
    positions = np.tile(np.arange(s), (2, 1))
    positions[1, :5] = -1  # left padding
    cut = r.integers(0, s + 1, size=(2, t)).astype(np.int32)
    cut[0, 0] = 0  # a row that sees nothing
    return q, _store(seed, kv=kv, s=s, h=h, g=g), positions, cut


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_matches_brute_force(bits):
    q, store, positions, cut = _case(0, 2, s=16, h=8, g=4)
    out, lse = quant_kv_attention_reference(q, *store, positions, cut, bits=bits)
    want_out, want_lse = _brute_force(q, store, positions, cut, bits)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
    seen = ~np.isnan(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], rtol=1e-4, atol=1e-4)
    assert (np.asarray(lse)[~seen] < -1e30).all() and not np.asarray(out)[~seen].any()


@pytest.mark.parametrize("bits,t,seed", [(4, 1, 1), (8, 1, 2), (4, 3, 3), (8, 5, 4)])
def test_kernel_matches_reference_in_interpret_mode(bits, t, seed):
    q, store, positions, cut = _case(seed, t)
    out, lse = quant_kv_attention(q, *store, positions, cut, bits=bits, interpret=True)
    want_out, want_lse = quant_kv_attention_reference(q, *store, positions, cut, bits=bits)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    seen = np.asarray(want_lse) > -1e30
    np.testing.assert_allclose(
        np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=1e-5, atol=1e-5
    )
    assert (np.asarray(lse)[~seen] < -1e30).all()


def test_merging_two_key_sets_is_attention_over_their_union():
    q, store, positions, cut = _case(5, 3)
    low = np.minimum(cut, 24)
    early = quant_kv_attention_reference(q, *store, positions, low)
    masked = np.where(np.arange(64)[None] < 24, -1, positions)  # the slots from 24 on
    late = quant_kv_attention_reference(q, *store, masked, cut)
    union, _ = quant_kv_attention_reference(q, *store, positions, cut)
    np.testing.assert_allclose(merge_attention([early, late]), union, rtol=1e-5, atol=1e-5)


def _paper_shapes(t, sharding=None, b=4):
    kv, n, h, g, s = 2, 8, 128, 128, 1024
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    codes = spec((b, kv, s, h // 2), jnp.uint8)
    return (
        spec((b, t, n, h), jnp.bfloat16),
        codes,
        codes,
        spec((b, kv, s // g, h), jnp.float16),
        spec((b, kv, s // g, h), jnp.float16),
        codes,
        codes,
        spec((b, kv, s, 1), jnp.float16),
        spec((b, kv, s, 1), jnp.float16),
        spec((b, s), jnp.int32),
        spec((b, t), jnp.int32),
    )


def test_tpu_kernel_compiles_for_v5e_ahead_of_time():
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (len(topology.devices),), ("data",))
    for t, bits in ((1, 4), (7, 8)):  # a draft step, a verification of gamma + 1 = 7

        def per_device(*args, bits=bits):
            return quant_kv_attention(*args, bits=bits, backend="tpu")

        attention = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P("data"),) * 11,
            out_specs=(P("data"), P("data")),
            check_vma=False,
        )
        lowered = jax.jit(attention).lower(*_paper_shapes(t, NamedSharding(mesh, P("data"))))
        assert "quant_kv_attention" in re.findall(r'kernel_name = "(\w+)"', lowered.as_text())
        compiled = lowered.compile()  # Mosaic compiles the kernel for v5e here
        assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1


@pytest.mark.parametrize("t", [1, 7])
def test_gpu_kernel_lowers_to_triton_for_cuda(t):
    triton_call = "__gpu$xla.gpu.triton"
    unchecked = [export.DisabledSafetyCheck.custom_call(triton_call)]
    exported = export.export(
        jax.jit(lambda *a: quant_kv_attention(*a, bits=8, backend="gpu")),
        platforms=["cuda"],
        disabled_checks=unchecked,
    )(*_paper_shapes(t))
    text = exported.mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {triton_call}
    assert re.findall(r'name = "(quant_kv_\w+)"', text) == ["quant_kv_attention"]


def test_bad_arguments_are_clear_errors():
    q, store, positions, cut = _case(6, 1, h=16, g=8)
    with pytest.raises(ValueError, match="needs value groups of the whole head"):
        quant_kv_attention(q, *store, positions, cut, interpret=True)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 2"):
        quant_kv_attention(q, *store, positions, cut, bits=2, impl="xla")
    with pytest.raises(ValueError, match="impl must be one of"):
        quant_kv_attention(q, *store, positions, cut, impl="triton")
    with pytest.raises(ValueError, match=r"cut \[B, T\]"):
        quant_kv_attention(q, *store, positions, cut[:, :0], impl="xla")


# The full-precision buffer ----------------------------------------------------------------


def _buffer_case(seed, t, length=24, n=4, kv=2, h=16):
    r = np.random.default_rng(seed)
    q = r.normal(size=(2, t, n, h)).astype(np.float32)
    keys, values = (r.normal(size=(2, length, kv, h)).astype(np.float32) for _ in range(2))
    slots = np.tile(np.arange(40, 40 + length), (2, 1)).astype(np.int32)
    slots[:, 3] = -1  # an empty ring entry
    positions = np.where(slots >= 0, slots, -1).astype(np.int32)
    positions[1, :4] = -1  # padding
    query_positions = (40 + length - t + np.arange(t))[None].repeat(2, 0).astype(np.int32)
    cut = r.integers(40, 40 + length, size=(2, t)).astype(np.int32)
    return q, keys, values, slots, positions, query_positions, cut


def test_buffer_reference_matches_brute_force():
    q, keys, values, slots, positions, query_positions, cut = _buffer_case(7, 3)
    out, lse = buffer_attention_reference(q, keys, values, slots, positions, query_positions, cut)
    n, kv = q.shape[2], keys.shape[2]
    for b in range(2):
        for t in range(3):
            seen = [
                j
                for j in range(keys.shape[1])
                if slots[b, j] >= cut[b, t] and 0 <= positions[b, j] <= query_positions[b, t]
            ]
            for head in range(n):
                k = head // (n // kv)
                scores = keys[b, seen, k].astype(np.float64) @ q[b, t, head] / 4.0
                w = np.exp(scores - scores.max())
                np.testing.assert_allclose(
                    out[b, t, head], w @ values[b, seen, k] / w.sum(), rtol=1e-4, atol=1e-5
                )
                np.testing.assert_allclose(
                    lse[b, t, head], scores.max() + np.log(w.sum()), rtol=1e-5
                )


@pytest.mark.parametrize("t,seed", [(1, 8), (5, 9)])
def test_buffer_kernel_matches_reference_in_interpret_mode(t, seed):
    case = _buffer_case(seed, t)
    out, lse = buffer_attention(*case, interpret=True)
    want_out, want_lse = buffer_attention_reference(*case)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def _buffer_shapes(t, sharding=None, b=4, length=269):
    kv, n, h = 2, 8, 128
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    return (
        spec((b, t, n, h), jnp.bfloat16),
        spec((b, length, kv, h), jnp.bfloat16),
        spec((b, length, kv, h), jnp.bfloat16),
        spec((b, length), jnp.int32),
        spec((b, length), jnp.int32),
        spec((b, t), jnp.int32),
        spec((b, t), jnp.int32),
    )


def test_buffer_kernel_compiles_for_v5e_and_lowers_for_cuda():
    triton_call = "__gpu$xla.gpu.triton"
    exported = export.export(
        jax.jit(lambda *a: buffer_attention(*a, backend="gpu")),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton_call)],
    )(*_buffer_shapes(7))
    assert re.findall(r'name = "(quant_kv_\w+)"', exported.mlir_module()) == [
        "quant_kv_buffer_attention"
    ]
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (len(topology.devices),), ("data",))
    attention = jax.shard_map(
        lambda *a: buffer_attention(*a, backend="tpu"),
        mesh=mesh,
        in_specs=(P("data"),) * 7,
        out_specs=(P("data"), P("data")),
        check_vma=False,
    )
    compiled = (
        jax.jit(attention).lower(*_buffer_shapes(7, NamedSharding(mesh, P("data")))).compile()
    )
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
