"""Test-wide settings: CPU only, float32 matmuls at full precision."""

import os

# libtpu is installed for ahead-of-time TPU compilation; never try to open a TPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
