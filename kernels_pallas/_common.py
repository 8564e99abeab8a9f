"""Constants and helpers shared by the Pallas kernels of this package (not by references)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# A finite stand-in for -inf in a running max: `exp(mask - real max)` underflows to 0
# without the inf - inf = NaN that a true -inf start gives for rows masked so far.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# TPU vreg tile: (8 sublanes, 128 lanes) of 32-bit values.
NUM_LANES = 128
NUM_SUBLANES = 8
# Triton's tl.dot needs every matmul dimension to be at least 16.
MIN_TRITON_DOT_DIM = 16

IMPLEMENTATIONS = ("xla", "pallas")
BACKENDS = ("tpu", "gpu")

# lax.dot_general dimension numbers for 2-D operands: "NT" contracts the last dims of
# both (q @ k.T), "TN" the first dims of both (p.T @ do), "NN" is a plain matmul.
NT = (((1,), (1,)), ((), ()))
TN = (((0,), (0,)), ((), ()))
NN = (((1,), (0,)), ((), ()))


def matmul(lhs, rhs, dimension_numbers):
    """A 2-D kernel matmul accumulating in float32.

    bfloat16 operands multiply exactly into the float32 accumulator at DEFAULT precision,
    and Mosaic rejects a float32 precision request for them (as a global
    jax_default_matmul_precision="highest" would make), so it is pinned; float32 operands
    follow the global setting.
    """
    precision = lax.Precision.DEFAULT if lhs.dtype == jnp.bfloat16 else None
    return lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=jnp.float32
    )


def target_platform() -> str:
    """The platform the program is being built for: that of the devices of the mesh set
    with ``jax.set_mesh`` when there is one (a TPU topology compiled ahead of time on a
    CPU host, for instance), else ``jax.default_backend()``."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if not mesh.empty and device is not None:
        return device.platform
    return jax.default_backend()


def resolve_backend(impl: str, backend: str | None, interpret) -> tuple[str, object]:
    """The lowering and interpret setting of one call, from the user's arguments.

    Args:
        impl: "xla" or "pallas" (validated by the caller).
        backend: None, "tpu" or "gpu".
        interpret: None (interpret exactly when the kernels would otherwise run on a
            platform without Pallas, i.e. CPU, and no backend was named; the platform
            is ``target_platform()``), a bool, or a
            ``pltpu.InterpretParams``.

    Returns:
        (backend, interpret) with backend in ("xla", "tpu", "gpu"); ("xla", False) for
        impl="xla".

    Raises:
        ValueError: if backend is not a known name, or impl="pallas" would run compiled
            kernels on a backend that has no Pallas lowering.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend=!r}.")
    if impl == "xla":
        return "xla", False
    platform = target_platform()
    has_pallas = platform in ("tpu", "gpu")
    if interpret is None:
        interpret = backend is None and not has_pallas
    if backend is None:
        if not has_pallas and not interpret:
            raise ValueError(
                f"impl='pallas' on the {platform!r} backend runs only in interpret mode: pass "
                "interpret=True (or backend='tpu'/'gpu' to lower for that accelerator ahead "
                "of time)."
            )
        # The TPU-style kernels are the default off-GPU (they are what interpret mode runs).
        backend = "gpu" if platform == "gpu" else "tpu"
    return backend, interpret


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def check_scale(scale, head_dim: int) -> float:
    """The score multiplier of a call: ``scale``, or ``head_dim ** -0.5`` for None.

    Raises:
        ValueError: if ``scale`` is not a number (a bool is not one).
    """
    if scale is None:
        scale = head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise ValueError(f"scale must be a number or None, got {scale=!r}.")
    return float(scale)


def check_impl(impl: str) -> None:
    """Raises ValueError unless ``impl`` is one of ``IMPLEMENTATIONS``."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl=!r}.")


def gpu_compiler_params(head_dim: int):
    """Triton launch settings of a kernel over tiles of ``head_dim`` features."""
    # Imported here: quant_kv_attention imports this module and guards its own import of
    # the Triton lowering, so that it loads where jax lacks it.
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)
