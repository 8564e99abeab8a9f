"""Test-wide settings: CPU only, float32 matmuls at full precision.

``hypothesis`` is imported here, at collection, because its pytest plugin otherwise
imports it in the terminal summary, after the whole suite. On CPython 3.11.7 pytest's
assertion rewriting of it then failed there with "SystemError: AST constructor
recursion depth mismatch", a bug of ``ast.parse`` in that Python (probably set off by
the recursion-limit changes earlier in the suite: the reference TabICL raises the limit
around its Latin-square feature shuffles).
"""

import atexit
import os
import shutil
import tempfile

# libtpu is installed for ahead-of-time TPU compilation; never try to open a TPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite runs in parallel workers (pytest-xdist); libtpu otherwise takes a lock file
# that lets only one process per machine compile for TPU topologies.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# A program compiled more than once in a run (one model in several tests, or again in a
# test's subprocess) is compiled once: a compilation cache for this run only, made by
# the first process (the xdist controller) and inherited by the workers and the
# subprocesses they start. It is removed when that process exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="lhc-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# Most tests spend their time in XLA's CPU compiler, not in what it compiles: LLVM's
# optimisation passes off. XLA's own graph passes (fusion, simplification) still run and
# LLVM keeps IEEE float semantics without fast-math, so this changes how fast the code
# runs, not what it computes; tests/gca + tests/emloc took 269 s instead of 433 s on 2
# cores. The suite's subprocesses inherit it (they append their own flags).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import hypothesis  # noqa: E402, F401
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """The heavier tests (marked ``slow`` or ``multidevice``) run first, in collection
    order otherwise: the parallel workers then share them out from the start instead
    of one worker finishing a long test alone at the end of the run."""
    heavy = lambda item: any(item.get_closest_marker(name) for name in ("slow", "multidevice"))
    items.sort(key=lambda item: not heavy(item))
