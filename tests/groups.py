"""The whole suite as a few pytest runs, each in fresh processes (what ``make test`` runs).

    python tests/groups.py [PYTEST ARGS...]      # e.g. -n 2 --durations=15

Why: with jax/jaxlib 0.10.2 on CPU, a pytest-xdist worker that has run about 350 of
this suite's tests sometimes dies of SIGSEGV inside XLA's CPU compiler
(``backend_compile_and_load``). It was seen in tests/recurrent (most often the Mamba-2
truncation test) and in tests/tabicl's parity tests, with and without the persistent
compilation cache and with and without libtpu's ahead-of-time tests in that worker;
replaying a crashed worker's tests in order in one process crashed at the same test,
while each module alone, or after a few other modules, passes. Runs of at most about
a third of the suite have not crashed. Every test file under tests/ belongs to exactly
one run: the groups below, then everything else.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

TESTS = pathlib.Path(__file__).resolve().parent
GROUPS = (
    ("tabicl",),
    ("lm", "nn", "parallel", "data"),
    ("kernels_pallas", "train", "quantspec", "rapid"),
    ("recurrent", "pencil", "gca", "nolima"),
)


def runs() -> list[list[str]]:
    """Each run's pytest path arguments: the groups, then the rest of tests/."""
    named = [name for group in GROUPS for name in group]
    missing = [name for name in named if not (TESTS / name).is_dir()]
    if missing:
        raise SystemExit(f"tests/groups.py: GROUPS names {missing}, not directories of tests/")
    rest = [f"--ignore={TESTS / name}" for name in named]
    return [[str(TESTS / name) for name in group] for group in GROUPS] + [[str(TESTS), *rest]]


def main(args: list[str]) -> int:
    env = dict(os.environ)
    cache = None
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        # One compilation cache for all the runs (tests/conftest.py otherwise makes one
        # per run).
        cache = env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lhc-tests-jax-")
    results = []
    try:
        for paths in runs():
            start = time.perf_counter()
            code = subprocess.call([sys.executable, "-m", "pytest", *args, *paths], env=env)
            results.append((paths, code, time.perf_counter() - start))
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    print("\n== tests/groups.py: exit code and seconds of each run ==")
    for paths, code, seconds in results:
        shown = " ".join(p for p in paths if not p.startswith("--"))
        label = "the rest of tests/" if any(p.startswith("--") for p in paths) else shown
        print(f"{code:3d} {seconds:7.1f}s  {label.replace(str(TESTS.parent) + os.sep, '')}")
    return max(code for _, code, _ in results)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
