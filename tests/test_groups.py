"""tests/groups.py runs every test file exactly once."""

import importlib.util
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def load_groups():
    spec = importlib.util.spec_from_file_location("lhc_test_groups", TESTS / "groups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def files_of(arguments: list[str]) -> set[pathlib.Path]:
    """The test files a pytest run with these path arguments collects."""
    ignored = [pathlib.Path(a.removeprefix("--ignore=")) for a in arguments if a.startswith("--")]
    found = set()
    for path in (pathlib.Path(a) for a in arguments if not a.startswith("--")):
        found |= {
            f for f in path.rglob("test_*.py") if not any(f.is_relative_to(i) for i in ignored)
        }
    return found


def test_every_test_file_runs_exactly_once():
    runs = [files_of(arguments) for arguments in load_groups().runs()]
    everything = set(TESTS.rglob("test_*.py"))
    assert set().union(*runs) == everything
    assert sum(len(run) for run in runs) == len(everything)
    assert all(runs), "a run with no test files"
