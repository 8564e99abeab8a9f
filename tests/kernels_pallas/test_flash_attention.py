"""flash_attention (XLA, Pallas TPU- and GPU-style kernels) against a float64 brute force.

The Pallas kernels run in interpret mode on CPU; the TPU kernels are also compiled ahead
of time for a v5e slice through Mosaic, and the GPU kernels lowered for CUDA through
Triton, so both lowerings are checked without an accelerator.

    JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/kernels_pallas/test_flash_attention.py
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas._flash_attention_common import block_bounds as _block_bounds
from kernels_pallas._flash_attention_common import blocks_may_interact as _blocks_may_interact
from kernels_pallas._flash_attention_common import fetch_ranges as _fetch_ranges
from kernels_pallas.flash_attention import BlockSizes, flash_attention, flash_attention_reference

# float32: every implementation accumulates in float32 over at most 29 keys of O(1)
# scores, so against float64 the error is float32 rounding (measured <= 4e-7).
F32_TOLERANCE = dict(atol=2e-6, rtol=1e-5)
# Gradients against the float32 reference: three more float32 matmul chains per element
# (dP = dO V^T, then dS K and dS^T Q), on gradients up to ~4 in size (measured <= 1e-6).
F32_GRAD_TOLERANCE = dict(atol=5e-6, rtol=1e-5)
# bfloat16 against float32 on the same bf16-rounded inputs, so only the kernels' own
# rounding counts (bf16 unit roundoff u = 2^-8): the output is rounded to bf16 (relative
# u, the rtol) and the probabilities are rounded to bf16 before P @ V (at most u * max|v|
# ~ 0.004 * 3.5 in absolute terms, the atol). Measured <= 6e-3.
BF16_TOLERANCE = dict(atol=1.5e-2, rtol=4e-3)

# Small blocks: T and S (7, 19, 29) span up to four blocks and none is a multiple of 8,
# so the last block of each is padded.
TEST_BLOCKS = BlockSizes(block_q=8, block_k=8)

# Interpret-mode kernels become large XLA while loops whose LLVM optimisation dominates
# the test's time. These checks are numeric, so compile without backend optimisation
# (about half the compile time; floating-point semantics do not change, fast-math is off).
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile_and_run(fn, *args):
    """Runs jax.jit(fn)(*args), compiled with _FAST_COMPILE."""
    return jax.jit(fn).lower(*args).compile(compiler_options=_FAST_COMPILE)(*args)


@dataclasses.dataclass(frozen=True)
class Case:
    """Shapes and mask layout of one test input.

    layout "causal": S == T, positions 0..T-1 per row, rows left-padded by 0, 3 and 6.
    layout "cache": T queries at the newest positions of S shuffled cache slots; row 1 has
    empty slots, two padding queries and a valid query that sees no key; row 2 has only
    padding queries.
    """

    name: str
    layout: str
    seq_len_q: int
    seq_len_k: int
    num_heads: int
    num_kv_heads: int
    window: int | None
    head_dim: int = 8

    def __str__(self):
        return self.name


CASES = (
    Case("causal_mha", "causal", 19, 19, num_heads=2, num_kv_heads=2, window=None),
    Case("causal_mqa_window", "causal", 19, 19, num_heads=2, num_kv_heads=1, window=5),
    Case("cache_gqa", "cache", 7, 29, num_heads=4, num_kv_heads=2, window=None),
    Case("cache_gqa_window", "cache", 7, 29, num_heads=4, num_kv_heads=2, window=6, head_dim=16),
)


def _positions(case: Case, rng: np.random.Generator):
    """int32 query positions [B, T] and key positions [B, S] for the case's layout."""
    seq_len_q, seq_len_k = case.seq_len_q, case.seq_len_k
    if case.layout == "causal":
        rows = [np.array([-1] * pad + list(range(seq_len_q - pad))) for pad in (0, 3, 6)]
        return np.stack(rows).astype(np.int32), np.stack(rows).astype(np.int32)
    # Row 0: a full cache in shuffled slots; the queries are its newest tokens.
    k_pos_0 = rng.permutation(seq_len_k)
    q_pos_0 = np.arange(seq_len_k - seq_len_q, seq_len_k)
    # Row 1: positions 2..written+1 in random slots, the other slots empty (-1); two
    # padding queries, then a query at position 1, which sees no key (0 and 1 are absent).
    written = seq_len_k - 5
    k_pos_1 = np.full(seq_len_k, -1)
    k_pos_1[rng.permutation(seq_len_k)[:written]] = np.arange(2, written + 2)
    q_pos_1 = np.concatenate([[-1, -1, 1], np.arange(written + 2 - (seq_len_q - 3), written + 2)])
    # Row 2: nothing but padding queries.
    k_pos_2 = rng.permutation(seq_len_k)
    q_pos_2 = np.full(seq_len_q, -1)
    q_pos = np.stack([q_pos_0, q_pos_1, q_pos_2]).astype(np.int32)
    k_pos = np.stack([k_pos_0, k_pos_1, k_pos_2]).astype(np.int32)
    assert not np.array_equal(np.sort(k_pos_0), k_pos_0)  # slot order != position order
    return q_pos, k_pos


@functools.cache
def _inputs(case: Case):
    """float32 (query, key, value, query_positions, key_positions, cotangent) for the case."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    q_pos, k_pos = _positions(case, rng)
    batch = q_pos.shape[0]
    q_shape = (batch, case.seq_len_q, case.num_heads, case.head_dim)
    kv_shape = (batch, case.seq_len_k, case.num_kv_heads, case.head_dim)
    query, key, value, cotangent = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in (q_shape, kv_shape, kv_shape, q_shape)
    )
    return query, key, value, jnp.asarray(q_pos), jnp.asarray(k_pos), cotangent


def _brute_force_attention(query, key, value, q_pos, k_pos, window):
    """Loops over batch, query and head in numpy float64; zero rows for unseeing queries."""
    query, key, value = (np.asarray(x, np.float64) for x in (query, key, value))
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    batch, seq_len_q, num_heads, head_dim = query.shape
    group = num_heads // key.shape[2]
    out = np.zeros(query.shape)
    for b in range(batch):
        for t in range(seq_len_q):
            p = q_pos[b, t]
            visible = [
                s
                for s in range(key.shape[1])
                if p >= 0 and 0 <= k_pos[b, s] <= p and (window is None or p - k_pos[b, s] < window)
            ]
            if not visible:
                continue
            for n in range(num_heads):
                keys, values = key[b, visible, n // group], value[b, visible, n // group]
                scores = keys @ query[b, t, n] / np.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                out[b, t, n] = weights @ values / weights.sum()
    return out


def _sees_nothing(case: Case):
    """bool [B, T]: queries with no visible key (their output and dq must be zero)."""
    q_pos, k_pos = (np.asarray(x) for x in _inputs(case)[3:5])
    visible = (
        (q_pos[:, :, None] >= 0)
        & (k_pos[:, None, :] >= 0)
        & (k_pos[:, None, :] <= q_pos[:, :, None])
    )
    if case.window is not None:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < case.window
    return ~visible.any(axis=-1)


@functools.cache
def _output_and_gradients(
    case: Case, impl: str, backend: str | None = None, interpret: Any = False
):
    """Output and (dq, dk, dv) of sum(cotangent * output), from one compiled jax.vjp.

    Cached so the forward and the gradient tests of one (case, implementation) share a
    compilation.
    """
    query, key, value, q_pos, k_pos, cotangent = _inputs(case)
    if impl == "reference":
        attention = functools.partial(flash_attention_reference, window=case.window)
    else:
        attention = functools.partial(
            flash_attention,
            window=case.window,
            impl=impl,
            backend=backend,
            interpret=interpret,
            block_sizes=TEST_BLOCKS,
        )

    def forward_and_vjp(query, key, value, q_pos, k_pos, cotangent):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, q_pos, k_pos), query, key, value)
        return out, pullback(cotangent)

    return _compile_and_run(forward_and_vjp, query, key, value, q_pos, k_pos, cotangent)


def _check_forward(case: Case, out):
    query, key, value, q_pos, k_pos, _ = _inputs(case)
    assert out.shape == query.shape and out.dtype == query.dtype
    expected = _brute_force_attention(query, key, value, q_pos, k_pos, case.window)
    np.testing.assert_allclose(np.asarray(out), expected, **F32_TOLERANCE)
    # Queries that see no key (padding, or a key-less valid query) give exactly zero.
    assert np.all(np.asarray(out)[_sees_nothing(case)] == 0)


def _check_gradients(case: Case, gradients):
    _, expected = _output_and_gradients(case, "reference")
    for name, got, want in zip(("dq", "dk", "dv"), gradients, expected):
        assert np.all(np.isfinite(got)), name
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), **F32_GRAD_TOLERANCE, err_msg=name
        )
    # A query that sees nothing gets no gradient.
    assert np.all(np.asarray(gradients[0])[_sees_nothing(case)] == 0)


# --------------------------------------------------------------------------------------
# Reference and impl="xla".
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_brute_force(case):
    out, gradients = _output_and_gradients(case, "reference")
    _check_forward(case, out)
    assert all(np.all(np.isfinite(g)) for g in gradients)  # no NaN from masked rows


@pytest.mark.parametrize("case", CASES, ids=str)
def test_xla_matches_brute_force(case):
    out, _ = _output_and_gradients(case, "xla")
    _check_forward(case, out)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_xla_gradients_match_reference(case):
    _, gradients = _output_and_gradients(case, "xla")
    _check_gradients(case, gradients)


def _check_bfloat16(case: Case, **kwargs):
    """bf16 inputs through flash_attention(**kwargs) against float32 on the same values."""
    query, key, value, q_pos, k_pos, _ = _inputs(case)
    bf16 = [x.astype(jnp.bfloat16) for x in (query, key, value)]
    attention = functools.partial(
        flash_attention, window=case.window, block_sizes=TEST_BLOCKS, **kwargs
    )
    got = _compile_and_run(attention, *bf16, q_pos, k_pos)
    assert got.dtype == jnp.bfloat16
    expected = _compile_and_run(
        functools.partial(flash_attention_reference, window=case.window),
        *(x.astype(jnp.float32) for x in bf16),
        q_pos,
        k_pos,
    )
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), **BF16_TOLERANCE)
    assert np.all(np.asarray(got)[_sees_nothing(case)] == 0)


def test_xla_bfloat16_close_to_float32():
    _check_bfloat16(CASES[3], impl="xla")


# --------------------------------------------------------------------------------------
# impl="pallas": TPU- and GPU-style kernels in interpret mode.
# --------------------------------------------------------------------------------------


class TestPallasFlashAttention:
    """The Pallas kernels of both lowerings, against the brute force and the reference.

    On CPU the kernels run in interpret mode, which executes the same kernel bodies, grids
    and BlockSpecs (the TPU-style ones with their VMEM scratch and scalar prefetch).
    """

    INTERPRET = True

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_forward_matches_brute_force(self, case, backend):
        out, _ = _output_and_gradients(case, "pallas", backend, self.INTERPRET)
        _check_forward(case, out)

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_gradients_match_reference(self, case, backend):
        _, gradients = _output_and_gradients(case, "pallas", backend, self.INTERPRET)
        _check_gradients(case, gradients)

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    def test_bfloat16_close_to_float32(self, backend):
        _check_bfloat16(CASES[2], impl="pallas", backend=backend, interpret=self.INTERPRET)

    def test_tpu_kernels_under_strict_interpreter(self):
        # InterpretParams fills uninitialised memory (scratch included) with NaN and raises
        # on out-of-bounds block reads: a missed scratch reset or a bad index map fails here.
        case = CASES[3]
        out, gradients = _output_and_gradients(case, "pallas", "tpu", pltpu.InterpretParams())
        _check_forward(case, out)
        _check_gradients(case, gradients)

    def test_cpu_needs_interpret(self):
        if jax.default_backend() != "cpu":
            pytest.skip("checks the CPU backend's error")
        query, key, value, q_pos, k_pos, _ = _inputs(CASES[0])
        with pytest.raises(ValueError, match="interpret=True"):
            flash_attention(query, key, value, q_pos, k_pos, impl="pallas")


# --------------------------------------------------------------------------------------
# Block skipping, memory, lowerings.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 4])
def test_block_skipping_never_drops_a_visible_pair(window):
    rng = np.random.default_rng(7)
    block = 4
    q_pos = rng.integers(-3, 40, size=(6, 32)).astype(np.int32)
    k_pos = rng.integers(-3, 40, size=(6, 32)).astype(np.int32)
    q_min, q_max = _block_bounds(jnp.asarray(q_pos), block)
    k_min, k_max = _block_bounds(jnp.asarray(k_pos), block)
    may_interact = np.asarray(
        _blocks_may_interact(
            q_min[:, :, None], q_max[:, :, None], k_min[:, None, :], k_max[:, None, :], window
        )
    )
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    visible = (qp >= 0) & (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= qp - kp < window
    visible_blocks = visible.reshape(6, 8, block, 8, block).any(axis=(2, 4))
    assert np.all(may_interact[visible_blocks])
    assert not np.all(may_interact)  # and it does skip something on these inputs


@pytest.mark.parametrize("window", [None, 3, 8, 13])
def test_skipped_blocks_are_never_copied(window):
    """The TPU kernels' index maps clamp the inner grid step into ``fetch_ranges``: for
    causal rows with left padding and windows smaller than, equal to and larger than a
    block, every block a step computes with is the one it copies, and a row of steps
    copies exactly the blocks it computes with (a pipeline copies when the index
    changes), so a skipped block is never copied."""
    block, length = 8, 64
    rows = [np.array([-1] * pad + list(range(length - pad))) for pad in (0, 5, 64)]
    positions = jnp.asarray(np.stack(rows), jnp.int32)
    bounds = _block_bounds(positions, block)
    (k_first, k_last), (q_first, q_last) = map(
        lambda pair: tuple(np.asarray(x) for x in pair), _fetch_ranges(*bounds, *bounds, window)
    )
    q_pos, k_pos = np.asarray(positions)[:, :, None], np.asarray(positions)[:, None, :]
    visible = (q_pos >= 0) & (k_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        visible &= q_pos - k_pos < window
    blocks = length // block
    computed = visible.reshape(3, blocks, block, blocks, block).any(axis=(2, 4))  # [B, i, j]
    for outer_first, outer_last, needed in (
        (k_first, k_last, computed),  # forward and dq: query block i, key steps j
        (q_first, q_last, np.swapaxes(computed, 1, 2)),  # dkv: key block i, query steps j
    ):
        for b in range(3):
            for i in range(blocks):
                copied = np.clip(np.arange(blocks), outer_first[b, i], outer_last[b, i])
                for j in np.flatnonzero(needed[b, i]):
                    assert copied[j] == j
                copies = 1 + np.count_nonzero(np.diff(copied))
                assert copies == max(1, np.count_nonzero(needed[b, i])), (b, i, copied)
    assert computed.sum() < computed.size  # something is skipped


@pytest.mark.parametrize("window", [8, 13])
def test_tpu_kernels_with_windows_of_a_block_and_more(window):
    """Interpreted TPU kernels (forward and gradients) with a window equal to and larger
    than a block of 8, over five blocks of causal rows (smaller windows: ``CASES``)."""
    case = Case(f"causal_gqa_window_{window}", "causal", 37, 37, 4, 2, window=window)
    out, gradients = _output_and_gradients(case, "pallas", "tpu", True)
    _check_forward(case, out)
    _check_gradients(case, gradients)


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_xla_memory_grows_with_blocks_not_with_scores():
    """Also as the body of a scan over layers: differentiating that scan, JAX used to
    compute the masks of every pair of blocks ahead of the layers (they depend on the
    positions alone) and keep them all, 2.8 score matrices here, until the positions
    went through an optimization barrier."""
    batch, seq_len, heads, head_dim = 1, 2048, 1, 16
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    args = (q, q, q, pos, pos)
    score_bytes = seq_len * seq_len * 4  # one materialised float32 score matrix
    blocks = BlockSizes(block_q=128, block_k=128)
    chunked = functools.partial(flash_attention, impl="xla", block_sizes=blocks)

    def gradient(attention):
        return lambda q, k, v, qp, kp: jax.grad(
            lambda q, k, v: jnp.sum(attention(q, k, v, qp, kp)), (0, 1, 2)
        )(q, k, v)

    def layers(attention):  # two layers sharing the keys, values and positions
        def loss(q, k, v, qp, kp):
            step = lambda x, _: (x + attention(x, k, v, qp, kp), None)  # noqa: E731
            return jnp.sum(jax.lax.scan(step, q, None, length=2)[0] ** 2)

        return lambda *args: jax.grad(loss, (0, 1, 2))(*args)

    rng = np.random.default_rng(0)
    small = [jnp.asarray(rng.normal(size=(1, 300, 1, 16)), jnp.float32) for _ in range(3)]
    positions = jnp.arange(300)[None]
    got = jax.jit(layers(chunked))(*small, positions, positions)
    want = layers(flash_attention_reference)(*small, positions, positions)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.abs(b).max()))

    for fn, reference in (
        (chunked, flash_attention_reference),
        (gradient(chunked), gradient(flash_attention_reference)),
        (layers(chunked), layers(flash_attention_reference)),
    ):
        temp, reference_temp = _temp_bytes(fn, *args), _temp_bytes(reference, *args)
        assert reference_temp >= score_bytes  # the reference does hold [T, S] scores
        assert temp < score_bytes / 8, (temp, score_bytes)
        assert temp < reference_temp / 16, (temp, reference_temp)


def test_tpu_kernels_compile_for_v5e_ahead_of_time():
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (len(topology.devices),), ("data",))
    batch, seq_len, num_heads, num_kv_heads, head_dim = 4, 512, 8, 2, 128
    blocks = BlockSizes(block_q=128, block_k=128)
    sharded = NamedSharding(mesh, P("data"))
    q = jax.ShapeDtypeStruct((batch, seq_len, num_heads, head_dim), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct(
        (batch, seq_len, num_kv_heads, head_dim), jnp.bfloat16, sharding=sharded
    )
    pos = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sharded)

    def per_device(q, k, v, qp, kp):
        return flash_attention(
            q, k, v, qp, kp, window=200, impl="pallas", backend="tpu", block_sizes=blocks
        )

    # Mosaic kernels cannot be partitioned automatically: run them per device, batch-sharded.
    attention = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=P("data"), check_vma=False
    )

    def loss(q, k, v, qp, kp):
        return jnp.sum(attention(q, k, v, qp, kp).astype(jnp.float32))

    for fn, kernels in (
        (attention, ["flash_attention_fwd"]),
        (
            jax.grad(loss, (0, 1, 2)),
            ["flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv"],
        ),
    ):
        lowered = jax.jit(fn).lower(q, kv, kv, pos, pos)
        text = lowered.as_text()
        assert text.count("@tpu_custom_call") == len(kernels)
        assert re.findall(r'kernel_name = "(\w+)"', text) == kernels
        compiled = lowered.compile()  # Mosaic compiles the kernels for v5e here
        # The TPU executable still calls the kernels (nothing fell back to XLA).
        assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == len(kernels)


# 64 queries span two 32-query blocks; a single decode query is padded up to one
# 16-query block (Triton's smallest dot) by the block clipping.
@pytest.mark.parametrize("seq_len_q", [64, 1])
def test_gpu_kernels_lower_to_triton_for_cuda(seq_len_q):
    batch, seq_len_k, num_heads, num_kv_heads, head_dim = 2, 96, 4, 2, 64
    blocks = BlockSizes(block_q=32, block_k=32)
    q = jax.ShapeDtypeStruct((batch, seq_len_q, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq_len_k, num_kv_heads, head_dim), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((batch, seq_len_q), jnp.int32)
    k_pos = jax.ShapeDtypeStruct((batch, seq_len_k), jnp.int32)

    def attention(q, k, v, qp, kp):
        return flash_attention(
            q, k, v, qp, kp, window=16, impl="pallas", backend="gpu", block_sizes=blocks
        )

    def vjp(q, k, v, qp, kp, cotangent):
        return jax.vjp(lambda q, k, v: attention(q, k, v, qp, kp), q, k, v)[1](cotangent)

    # The Triton custom call has no serialisation-compatibility guarantee; export still
    # produces the module, which is what this test inspects.
    triton_call = "__gpu$xla.gpu.triton"
    unchecked = [export.DisabledSafetyCheck.custom_call(triton_call)]
    for fn, args, kernels in (
        (attention, (q, kv, kv, q_pos, k_pos), ["flash_attention_fwd"]),
        (
            vjp,
            (q, kv, kv, q_pos, k_pos, q),
            ["flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv"],
        ),
    ):
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=unchecked)(*args)
        text = exported.mlir_module()
        assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {triton_call}  # not Mosaic GPU
        assert re.findall(r'name = "(flash_attention_\w+)"', text) == kernels


# --------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------


def _small_inputs(**overrides):
    inputs = dict(
        query=jnp.zeros((2, 5, 4, 8)),
        key=jnp.zeros((2, 6, 2, 8)),
        value=jnp.zeros((2, 6, 2, 8)),
        query_positions=jnp.zeros((2, 5), jnp.int32),
        key_positions=jnp.zeros((2, 6), jnp.int32),
    )
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize(
    "overrides,kwargs,match",
    [
        (
            dict(query=jnp.zeros((2, 5, 32))),
            {},
            r"query must have rank 4.*query.shape=\(2, 5, 32\)",
        ),
        (
            dict(query=jnp.zeros((2, 5, 3, 8))),
            {},
            r"multiple of kv heads K.*query.shape=\(2, 5, 3, 8\)",
        ),
        (
            dict(key=jnp.zeros((2, 6, 2, 4)), value=jnp.zeros((2, 6, 2, 4))),
            {},
            r"match query in batch and head_dim.*key.shape=\(2, 6, 2, 4\)",
        ),
        (dict(value=jnp.zeros((2, 7, 2, 8))), {}, r"same shape.*value.shape=\(2, 7, 2, 8\)"),
        (
            dict(query_positions=jnp.zeros((2, 6), jnp.int32)),
            {},
            r"query_positions must have shape \(2, 5\).*\(2, 6\)",
        ),
        (
            dict(key_positions=jnp.zeros((2, 6), jnp.float32)),
            {},
            r"key_positions must have an integer dtype",
        ),
        (dict(query=jnp.zeros((2, 5, 4, 8), jnp.int32)), {}, r"query must be float32 or bfloat16"),
        (
            dict(key=jnp.zeros((2, 6, 2, 8), jnp.bfloat16)),
            {},
            r"share a dtype.*key.dtype=dtype\(bfloat16\)",
        ),
        ({}, dict(window=0), r"window must be None or an int >= 1, got window=0"),
        ({}, dict(impl="cuda"), r"impl must be one of \('xla', 'pallas'\), got impl='cuda'"),
        ({}, dict(impl="pallas", backend="mosaic"), r"backend must be None or one of"),
        ({}, dict(block_sizes=(8, 8)), r"block_sizes must be a BlockSizes"),
        # Triton tiles are powers of two; Mosaic tiles need block_k % 128 across blocks.
        (
            {},
            dict(impl="pallas", backend="gpu", block_sizes=BlockSizes(6, 8)),
            r"power-of-two blocks.*block_q=6",
        ),
        (
            dict(
                key=jnp.zeros((2, 300, 2, 8)),
                value=jnp.zeros((2, 300, 2, 8)),
                key_positions=jnp.zeros((2, 300), jnp.int32),
            ),
            dict(impl="pallas", backend="tpu", block_sizes=BlockSizes(8, 64)),
            r"block_k a multiple of 128.*block_k=64",
        ),
    ],
)
def test_invalid_arguments_raise(overrides, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(**_small_inputs(**overrides), **kwargs)


def test_block_sizes_must_be_positive_ints():
    with pytest.raises(ValueError, match=r"BlockSizes.block_k must be a positive int, got 0"):
        BlockSizes(block_q=8, block_k=0)
