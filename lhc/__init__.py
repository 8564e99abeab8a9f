"""lhc: long-horizon context methods in JAX/Flax.

Every package and top-level module is imported on first use (``lhc.train``, ``lhc.lm``,
``lhc.gca``, ``lhc.plots``, ...), so ``import lhc`` is cheap.
"""

import importlib

__version__ = "0.1.0"

# The shared layers, the methods, then the top-level modules.
_SUBMODULES = (
    "nn",
    "lm",
    "train",
    "parallel",
    "data",
    "bench",
    "extras",
    "plots",
    "stats",
    "report",
    "gca",
    "recurrent",
    "pencil",
    "quantspec",
    "rapid",
    "emloc",
    "icl",
    "dm",
    "graphs",
    "nolima",
    "tabicl",
    "cli",
)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"lhc.{name}")
    raise AttributeError(f"module 'lhc' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
