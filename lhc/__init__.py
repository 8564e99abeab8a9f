"""lhc: long-horizon context methods in JAX/Flax.

Subpackages are imported on first use (``lhc.train``, ``lhc.lm``, ``lhc.tabicl``, ...),
so ``import lhc`` is cheap.
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("nn", "lm", "train", "parallel", "data", "tabicl", "cli")


def __getattr__(name):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"lhc.{name}")
    raise AttributeError(f"module 'lhc' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBPACKAGES))
