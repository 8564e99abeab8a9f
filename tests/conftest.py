"""Test-wide settings: CPU only, float32 matmuls at full precision.

``hypothesis`` is imported here, at collection, because its pytest plugin otherwise
imports it in the terminal summary, after the whole suite. On CPython 3.11.7 pytest's
assertion rewriting of it then failed there with "SystemError: AST constructor
recursion depth mismatch", a bug of ``ast.parse`` in that Python (probably set off by
the recursion-limit changes earlier in the suite: the reference TabICL raises the limit
around its Latin-square feature shuffles).
"""

import os

# libtpu is installed for ahead-of-time TPU compilation; never try to open a TPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite runs in parallel workers (pytest-xdist); libtpu otherwise takes a lock file
# that lets only one process per machine compile for TPU topologies.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import hypothesis  # noqa: E402, F401
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
