"""chunk_retrieval (XLA, Pallas TPU- and GPU-style kernels) against a float64 brute force.

The Pallas kernels run in interpret mode on CPU; the TPU kernels are also compiled ahead
of time for a v5e slice through Mosaic, and the GPU kernels lowered for CUDA through
Triton, so both lowerings are checked without an accelerator.

    JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/kernels_pallas/test_chunk_retrieval.py
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

from kernels_pallas.chunk_retrieval import chunk_retrieval, chunk_retrieval_reference

# float32 against float64: sums of at most K * Sk = 28 terms of O(1) scores, so float32
# rounding only (measured <= 5e-7).
F32_TOLERANCE = dict(atol=2e-6, rtol=1e-5)
# Gradients against the float32 reference: dweights sums Sq * H * D products of O(1)
# values (measured <= 5e-6 on values up to ~10).
F32_GRAD_TOLERANCE = dict(atol=2e-5, rtol=1e-5)
# bfloat16 inputs against float32 on the same bf16-rounded inputs: the probabilities are
# rounded to bf16 before P @ V and the output to bf16 (unit roundoff 2^-8), over up to
# K = 4 slots with weights of O(1).
BF16_TOLERANCE = dict(atol=3e-2, rtol=1e-2)

# As in the flash attention tests: interpret-mode kernels are large XLA loops, compiled
# without backend optimisation (floating-point semantics do not change).
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Case:
    """Shapes and index layout of one test input.

    layout "causal": query chunk c retrieves from the strictly earlier chunks 0..c-1 as
    GCA does (chunk 0 has no history: every slot empty; chunk 1 one chunk and empty
    slots), with one duplicated index.
    layout "random": indices drawn from [-1, N), with a duplicate in one chunk and one
    memory chunk that no slot selects (its dk and dv must be exactly zero).
    """

    name: str
    layout: str
    num_chunks: int
    seq_len_q: int
    seq_len_k: int
    num_memory_chunks: int
    num_heads: int
    num_kv_heads: int
    num_slots: int
    head_dim: int = 8
    batch: int = 2

    def __str__(self):
        return self.name


CASES = (
    Case("causal_gqa", "causal", 4, 8, 8, 4, num_heads=4, num_kv_heads=2, num_slots=2),
    Case("random_mha_odd", "random", 3, 5, 6, 5, num_heads=2, num_kv_heads=2, num_slots=3),
    Case("decode_mqa", "random", 1, 1, 7, 6, num_heads=3, num_kv_heads=1, num_slots=4, head_dim=16),
)


def _indices(case: Case, rng: np.random.Generator):
    shape = (case.batch, case.num_chunks, case.num_slots)
    if case.layout == "causal":
        indices = np.full(shape, -1)
        for b in range(case.batch):
            for c in range(case.num_chunks):
                history = rng.permutation(c)[: case.num_slots]
                indices[b, c, : len(history)] = history
        indices[1, 3, 1] = indices[1, 3, 0]  # a duplicate
        return indices.astype(np.int32)
    # Chunk N - 1 is never selected; the first row's first chunk reads one chunk twice.
    indices = rng.integers(-1, case.num_memory_chunks - 1, size=shape)
    indices[0, 0, :2] = 2
    return indices.astype(np.int32)


@functools.cache
def _inputs(case: Case):
    """float32 (q, k_mem, v_mem, indices, weights, cotangent) for the case."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    q_shape = (case.batch, case.num_chunks, case.seq_len_q, case.num_heads, case.head_dim)
    memory_shape = (
        case.batch,
        case.num_memory_chunks,
        case.seq_len_k,
        case.num_kv_heads,
        case.head_dim,
    )
    q, k_mem, v_mem, cotangent = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in (q_shape, memory_shape, memory_shape, q_shape)
    )
    indices = jnp.asarray(_indices(case, rng))
    weights = jnp.asarray(rng.standard_normal(indices.shape), jnp.float32)
    return q, k_mem, v_mem, indices, weights, cotangent


def _brute_force(q, k_mem, v_mem, indices, weights):
    """Loops over batch, chunk, slot and head in numpy float64."""
    q, k_mem, v_mem, weights = (np.asarray(x, np.float64) for x in (q, k_mem, v_mem, weights))
    indices = np.asarray(indices)
    batch, num_chunks, _, num_heads, head_dim = q.shape
    group = num_heads // k_mem.shape[3]
    out = np.zeros(q.shape)
    for b in range(batch):
        for c in range(num_chunks):
            for slot, index in enumerate(indices[b, c]):
                if index < 0:
                    continue
                for h in range(num_heads):
                    keys, values = k_mem[b, index, :, h // group], v_mem[b, index, :, h // group]
                    scores = q[b, c, :, h] @ keys.T / np.sqrt(head_dim)
                    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
                    probs /= probs.sum(axis=1, keepdims=True)
                    out[b, c, :, h] += weights[b, c, slot] * probs @ values
    return out


@functools.cache
def _output_and_gradients(
    case: Case, impl: str, backend: str | None = None, interpret: Any = False
):
    """Output and (dq, dk, dv, dweights) of sum(cotangent * output), one compiled vjp."""
    q, k_mem, v_mem, indices, weights, cotangent = _inputs(case)
    if impl == "reference":
        retrieval = chunk_retrieval_reference
    else:
        retrieval = functools.partial(
            chunk_retrieval, impl=impl, backend=backend, interpret=interpret
        )

    def forward_and_vjp(q, k_mem, v_mem, indices, weights, cotangent):
        out, pullback = jax.vjp(
            lambda q, k, v, w: retrieval(q, k, v, indices, w), q, k_mem, v_mem, weights
        )
        return out, pullback(cotangent)

    args = (q, k_mem, v_mem, indices, weights, cotangent)
    return jax.jit(forward_and_vjp).lower(*args).compile(compiler_options=_FAST_COMPILE)(*args)


def _unselected_chunks(case: Case):
    """bool [B, N]: memory chunks no slot selects."""
    indices = np.asarray(_inputs(case)[3])
    selected = np.zeros((case.batch, case.num_memory_chunks), bool)
    for b in range(case.batch):
        selected[b, indices[b][indices[b] >= 0]] = True
    return ~selected


def _check_forward(case: Case, out):
    q, k_mem, v_mem, indices, weights, _ = _inputs(case)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(
        np.asarray(out), _brute_force(q, k_mem, v_mem, indices, weights), **F32_TOLERANCE
    )
    # A chunk whose slots are all empty outputs exactly zero.
    empty = np.all(np.asarray(indices) < 0, axis=-1)
    assert np.all(np.asarray(out)[empty] == 0)


def _check_gradients(case: Case, gradients):
    _, expected = _output_and_gradients(case, "reference")
    for name, got, want in zip(("dq", "dk", "dv", "dweights"), gradients, expected):
        assert np.all(np.isfinite(got)), name
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), **F32_GRAD_TOLERANCE, err_msg=name
        )
    indices = np.asarray(_inputs(case)[3])
    dq, dk, dv, d_weights = (np.asarray(g) for g in gradients)
    assert np.all(d_weights[indices < 0] == 0)  # an empty slot's weight gets no gradient
    assert np.all(dq[np.all(indices < 0, axis=-1)] == 0)
    unselected = _unselected_chunks(case)
    assert np.all(dk[unselected] == 0) and np.all(dv[unselected] == 0)


# --------------------------------------------------------------------------------------
# Reference and impl="xla".
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_brute_force(case):
    out, gradients = _output_and_gradients(case, "reference")
    _check_forward(case, out)
    assert all(np.all(np.isfinite(g)) for g in gradients)


def test_cases_cover_what_they_claim():
    causal = _inputs(CASES[0])[3]
    assert np.all(np.asarray(causal)[:, 0] == -1)  # a chunk with no history
    assert np.any(_unselected_chunks(CASES[1]))  # a chunk no slot reads
    for case in CASES:  # a duplicated index in some chunk
        indices = np.asarray(_inputs(case)[3])
        assert any(
            len(set(row[row >= 0])) < np.sum(row >= 0)
            for row in indices.reshape(-1, case.num_slots)
        ), case


@pytest.mark.parametrize("case", CASES, ids=str)
def test_xla_matches_brute_force_and_reference_gradients(case):
    out, gradients = _output_and_gradients(case, "xla")
    _check_forward(case, out)
    _check_gradients(case, gradients)


def test_reference_gradients_match_finite_differences():
    # The reference's gradients are the oracle for the kernels; check them once
    # independently of autodiff, along random directions, in float64 numpy.
    case = CASES[1]
    q, k_mem, v_mem, indices, weights, cotangent = (np.asarray(x) for x in _inputs(case))
    _, (dq, dk, dv, d_weights) = _output_and_gradients(case, "reference")
    rng = np.random.default_rng(0)
    eps = 1e-4
    loss = lambda *xs: np.sum(cotangent * _brute_force(*xs[:3], indices, xs[3]))
    for position, gradient in enumerate((dq, dk, dv, d_weights)):
        args = [np.asarray(x, np.float64) for x in (q, k_mem, v_mem, weights)]
        direction = rng.standard_normal(args[position].shape)
        plus, minus = list(args), list(args)
        plus[position] = args[position] + eps * direction
        minus[position] = args[position] - eps * direction
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(np.sum(np.asarray(gradient) * direction), numeric, rtol=1e-4)


# --------------------------------------------------------------------------------------
# impl="pallas": TPU- and GPU-style kernels in interpret mode.
# --------------------------------------------------------------------------------------


class TestPallasChunkRetrieval:
    INTERPRET = True

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_brute_force_and_reference_gradients(self, case, backend):
        out, gradients = _output_and_gradients(case, "pallas", backend, self.INTERPRET)
        _check_forward(case, out)
        _check_gradients(case, gradients)

    def test_tpu_kernels_under_strict_interpreter(self):
        # InterpretParams fills uninitialised memory (scratch and unwritten outputs) with
        # NaN and raises on out-of-bounds block reads: a missed reset, a bad index map or
        # an unvisited dk/dv block that is not the aliased zeros fails here.
        case = CASES[1]
        out, gradients = _output_and_gradients(case, "pallas", "tpu", pltpu.InterpretParams())
        _check_forward(case, out)
        _check_gradients(case, gradients)

    @pytest.mark.parametrize("backend", ["tpu", "gpu"])
    def test_bfloat16_close_to_float32(self, backend):
        q, k_mem, v_mem, indices, weights, _ = _inputs(CASES[0])
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k_mem, v_mem)]
        run = lambda *xs: chunk_retrieval(
            *xs, indices, weights, backend=backend, interpret=self.INTERPRET
        )
        out = run(*bf16)
        assert out.dtype == jnp.bfloat16
        expected = chunk_retrieval_reference(
            *[x.astype(jnp.float32) for x in bf16], indices, weights
        )
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(expected), **BF16_TOLERANCE
        )

    def test_interpret_defaults_to_cpu(self):
        if jax.default_backend() != "cpu":
            pytest.skip("checks the CPU default")
        q, k_mem, v_mem, indices, weights, _ = _inputs(CASES[2])
        out = chunk_retrieval(q, k_mem, v_mem, indices, weights)  # interpret=None
        np.testing.assert_allclose(
            np.asarray(out), _brute_force(q, k_mem, v_mem, indices, weights), **F32_TOLERANCE
        )
        with pytest.raises(ValueError, match="interpret=True"):
            chunk_retrieval(q, k_mem, v_mem, indices, weights, interpret=False)


# --------------------------------------------------------------------------------------
# Lowerings.
# --------------------------------------------------------------------------------------


def _paper_shapes(batch, num_chunks, seq_len_q, dtype=jnp.bfloat16, sharding=None):
    """GCA-like abstract inputs: 64-token chunks, head dim 128, 8 heads over 2 kv heads."""
    num_memory_chunks, seq_len_k, num_heads, num_kv_heads, head_dim, slots = 8, 64, 8, 2, 128, 4
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    q = spec((batch, num_chunks, seq_len_q, num_heads, head_dim), dtype)
    memory = spec((batch, num_memory_chunks, seq_len_k, num_kv_heads, head_dim), dtype)
    indices = spec((batch, num_chunks, slots), jnp.int32)
    weights = spec((batch, num_chunks, slots), jnp.float32)
    return q, memory, memory, indices, weights


def test_tpu_kernels_compile_for_v5e_ahead_of_time():
    pytest.importorskip("libtpu", reason="libtpu (the tpu extra) is needed to compile for TPU")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (len(topology.devices),), ("data",))
    args = _paper_shapes(4, 4, 64, sharding=NamedSharding(mesh, P("data")))

    def per_device(q, k, v, i, w):
        return chunk_retrieval(q, k, v, i, w, backend="tpu")

    # Mosaic kernels cannot be partitioned automatically: run them per device.
    retrieval = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=P("data"), check_vma=False
    )

    def loss(q, k, v, i, w):
        return jnp.sum(retrieval(q, k, v, i, w).astype(jnp.float32))

    # The gradient's residuals are the inputs, so its program needs no forward kernel.
    for fn, kernels in (
        (retrieval, ["chunk_retrieval_fwd"]),
        (jax.grad(loss, (0, 1, 2, 4)), ["chunk_retrieval_bwd_dq", "chunk_retrieval_bwd_dkv"]),
    ):
        lowered = jax.jit(fn).lower(*args)
        assert set(kernels) <= set(re.findall(r'kernel_name = "(\w+)"', lowered.as_text()))
        compiled = lowered.compile()  # Mosaic compiles the kernels for v5e here
        assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == len(kernels)


@pytest.mark.parametrize("seq_len_q", [64, 1])  # chunk prefill, and one decode token
def test_gpu_kernels_lower_to_triton_for_cuda(seq_len_q):
    args = _paper_shapes(2, 3, seq_len_q)

    def retrieval(q, k, v, i, w):
        return chunk_retrieval(q, k, v, i, w, backend="gpu")

    def vjp(q, k, v, i, w, cotangent):
        return jax.vjp(lambda q, k, v, w: retrieval(q, k, v, i, w), q, k, v, w)[1](cotangent)

    triton_call = "__gpu$xla.gpu.triton"
    unchecked = [export.DisabledSafetyCheck.custom_call(triton_call)]
    for fn, fn_args, kernels in (
        (retrieval, args, ["chunk_retrieval_fwd"]),
        (vjp, (*args, args[0]), ["chunk_retrieval_bwd_dq", "chunk_retrieval_bwd_dkv"]),
    ):
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=unchecked)(
            *fn_args
        )
        text = exported.mlir_module()
        assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {triton_call}
        assert re.findall(r'name = "(chunk_retrieval_\w+)"', text) == kernels


# --------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------


def _small(**overrides):
    inputs = dict(
        q=jnp.zeros((2, 3, 4, 4, 8)),
        k_mem=jnp.zeros((2, 5, 4, 2, 8)),
        v_mem=jnp.zeros((2, 5, 4, 2, 8)),
        indices=jnp.zeros((2, 3, 2), jnp.int32),
        weights=jnp.zeros((2, 3, 2)),
    )
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize(
    "overrides, kwargs, match",
    [
        (dict(q=jnp.zeros((2, 3, 4, 8))), {}, "q must have rank 5"),
        (dict(q=jnp.zeros((2, 3, 4, 4, 8), jnp.int32)), {}, "q must be float32 or bfloat16"),
        (dict(k_mem=jnp.zeros((2, 5, 4, 2, 8), jnp.bfloat16)), {}, "share a dtype"),
        (dict(v_mem=jnp.zeros((2, 6, 4, 2, 8))), {}, "same shape"),
        (
            dict(k_mem=jnp.zeros((2, 5, 4, 3, 8)), v_mem=jnp.zeros((2, 5, 4, 3, 8))),
            {},
            "multiple of kv heads",
        ),
        (
            dict(k_mem=jnp.zeros((1, 5, 4, 2, 8)), v_mem=jnp.zeros((1, 5, 4, 2, 8))),
            {},
            "match q in batch",
        ),
        (dict(indices=jnp.zeros((2, 2, 2), jnp.int32)), {}, r"indices must have shape \[B, C, K\]"),
        (dict(indices=jnp.zeros((2, 3, 2))), {}, "integer dtype"),
        (dict(indices=jnp.full((2, 3, 2), 5, jnp.int32)), {}, r"lie in \[-1, N\) = \[-1, 5\)"),
        (dict(indices=jnp.full((2, 3, 2), -2, jnp.int32)), {}, r"lie in \[-1, N\)"),
        (dict(weights=jnp.zeros((2, 3, 3))), {}, "weights must have the shape of indices"),
        (dict(weights=jnp.zeros((2, 3, 2), jnp.int32)), {}, "float dtype"),
        ({}, dict(impl="triton"), "impl must be one of"),
        ({}, dict(backend="cuda"), "backend must be None or one of"),
        ({}, dict(scale="big"), "scale must be a number"),
    ],
)
def test_invalid_arguments_raise(overrides, kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunk_retrieval(**_small(**overrides), **kwargs)


def test_traced_out_of_range_indices_are_empty_slots():
    inputs = _small(
        q=jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4, 4, 8)), jnp.float32),
        k_mem=jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 4, 2, 8)), jnp.float32),
        v_mem=jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 4, 2, 8)), jnp.float32),
        weights=jnp.ones((2, 3, 2)),
    )
    far = jnp.array([[[0, 7]] * 3] * 2, jnp.int32)  # 7 >= N = 5
    run = jax.jit(lambda i: chunk_retrieval(**{**inputs, "indices": i}, impl="xla"))
    # One compiled program: a traced index outside [0, N) acts as -1.
    np.testing.assert_array_equal(np.asarray(run(far)), np.asarray(run(far.at[..., 1].set(-1))))
