"""``import lhc`` is cheap and exposes every package and top-level module on first use."""

import json
import pathlib
import subprocess
import sys

import pytest

import lhc

LHC = pathlib.Path(lhc.__file__).parent


def test_the_lazy_names_are_the_packages_and_top_level_modules():
    packages = {path.parent.name for path in LHC.glob("*/__init__.py")}
    modules = {path.stem for path in LHC.glob("*.py") if not path.stem.startswith("_")}
    assert len(set(lhc._SUBMODULES)) == len(lhc._SUBMODULES)
    assert sorted(lhc._SUBMODULES) == sorted(packages | modules)


def test_import_lhc_imports_nothing_else_and_each_name_then_works():
    code = (
        "import json, sys, lhc\n"
        "before = sorted(m for m in sys.modules if m.startswith('lhc.'))\n"
        "names = {n: getattr(lhc, n).__name__ for n in lhc._SUBMODULES}\n"
        "print(json.dumps({'before': before, 'names': names}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == []
    assert got["names"] == {name: f"lhc.{name}" for name in lhc._SUBMODULES}


@pytest.mark.parametrize("name", ["gca", "plots", "nolima"])
def test_dir_lists_the_names(name):
    assert name in dir(lhc)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'lhc' has no attribute 'config'"):
        lhc.config  # noqa: B018
