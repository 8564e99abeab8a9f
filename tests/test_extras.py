"""Each method's optional dependencies come with its extra; without one, the module that
needs it says which extra to install."""

import subprocess
import sys

import pytest

from lhc import extras


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bm25s", None)  # as if not installed
    with pytest.raises(ImportError, match=r"bm25s is not installed.*pip install 'lhc\[rapid\]'"):
        extras.require("bm25s", "rapid")
    assert extras.require("numpy", "core").__name__ == "numpy"


@pytest.mark.parametrize(
    "blocked, statement, extra",
    [("sklearn", "import lhc.tabicl", "tabicl"), ("gymnasium", "import lhc.dm.rollout", "dm")],
)
def test_importing_a_method_without_its_extra_is_one_clear_error(blocked, statement, extra):
    code = f"import sys; sys.modules[{blocked!r}] = None; {statement}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"pip install 'lhc[{extra}]'" in proc.stderr.strip().splitlines()[-1]


def test_every_extra_is_in_pyproject():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    optional = pyproject["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(optional)
    assert optional["all"] == ["lhc[dm,rapid,tabicl]"]
