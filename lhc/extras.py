"""lhc's optional dependencies: what each method needs beyond the core install, as the
extras of ``pyproject.toml`` (``pip install 'lhc[dm]'``), and the one clear error a
missing one gives."""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the modules it provides (pyproject.toml lists the distributions).
EXTRAS = {
    "dm": ("gymnasium", "h5py"),
    "rapid": ("bm25s",),
    "tabicl": ("sklearn",),
    "prior": ("xgboost",),
}


def require(module: str, extra: str) -> ModuleType:
    """``import module``, or an ImportError that names the extra to install.

    Raises:
        ImportError: ``module`` is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{module} is not installed; it comes with lhc's {extra!r} extra: "
            f"pip install 'lhc[{extra}]' (or pip install -e '.[{extra}]' in a checkout)"
        ) from error
