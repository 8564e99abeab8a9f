"""The shared harness of ``lhc bench``: what every benchmark of every package uses.

A benchmark is a function ``main(argv) -> dict`` in its package's ``bench.py`` or
``bench/`` folder (one measurement per file), the LM family's in ``lhc.bench.lm``
(listed in ``BENCHMARKS``; ``lhc bench --list``). It builds its command line with ``parser``
(which adds ``--json PATH``; ``add_model_source`` adds ``--checkpoint`` / ``--workdir``
/ ``--dtype`` for a language model), parses lists with ``int_list`` / ``float_list`` /
``str_list`` (``index_list`` for ints that may be 0 or negative), times with
``best_time`` / ``timed`` / ``interleaved_best``, prints ``markdown_table``\\s, and ends
with ``finish(result, args)``: the ``footer`` line (device, JAX, date) and the JSON
file. Statistics and result files are ``lhc.stats``'s.

Timing follows one rule everywhere: a first call (compilation, warm-up) that is not
timed, then the fastest of ``repeats`` calls, each waited for with
``jax.block_until_ready``; ``interleaved_best`` runs several implementations in turn in
every repeat, so that a slow spell of a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Tables of results, and (for earlier imports) the statistics and result files, are
# lhc.stats's.
from lhc.stats import append_records, markdown_table, read_records, wilson_interval  # noqa: F401

# The --checkpoint help of every command (kept off lhc.lm, which imports JAX); it names
# every model of lhc.lm.pretrained_models.MODELS (tested).
CHECKPOINT_HELP = (
    "a Hugging Face directory, a .gguf file, or smollm2-135m-instruct, gemma3-270m, "
    "qwen2.5-coder-0.5b-instruct (fetched once)"
)

# name -> "module:function"; one entry per package, sub-benchmarks as the first argument.
BENCHMARKS = {
    "dm": "lhc.dm.bench:main",
    "emloc": "lhc.emloc.bench:main",
    "gca": "lhc.gca.bench:main",
    "graphs": "lhc.graphs.bench:main",
    "icl": "lhc.icl.bench:main",
    "lm": "lhc.bench.lm:main",
    "nolima": "lhc.nolima.bench:main",
    "pencil": "lhc.pencil.bench:main",
    "quantspec": "lhc.quantspec.bench:main",
    "rapid": "lhc.rapid.bench:main",
    "recurrent": "lhc.recurrent.bench:main",
    "tabicl": "lhc.tabicl.bench:main",
}
# Earlier names, still accepted: name -> (benchmark, arguments put in front).
ALIASES = {
    "lm-decode": ("lm", ()),
    "range": ("graphs", ()),
    "icl-superposition": ("icl", ("superposition",)),
    "icl-vectors": ("icl", ("vectors",)),
}


# Command lines --------------------------------------------------------------------------


def parser(name: str, description: str | None) -> argparse.ArgumentParser:
    """``lhc bench NAME``'s parser: the description's first paragraph, and ``--json``."""
    first = (description or "").strip().split("\n\n")[0]
    result = argparse.ArgumentParser(
        prog=f"lhc bench {name}",
        description=first,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    return result


def _list_of(kind: Callable[[str], Any], what: str, positive: bool):
    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}"
            ) from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one of {what}, got {text!r}")
        if positive and min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive {what}, got {text!r}")
        return values

    parse.__name__ = f"comma-separated {what}"
    return parse


int_list = _list_of(int, "ints", positive=True)
"""An argparse type: ``"512,2048"`` -> ``[512, 2048]`` (positive ints)."""
index_list = _list_of(int, "ints", positive=False)
"""An argparse type: ``"0,5"`` -> ``[0, 5]`` (any ints: parameters, indices)."""
float_list = _list_of(float, "numbers", positive=False)
"""An argparse type: ``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``."""
str_list = _list_of(str.strip, "names", positive=False)
"""An argparse type: ``"a,b"`` -> ``["a", "b"]``."""


def add_model_source(
    parser_: argparse.ArgumentParser,
    *,
    workdir_help: str = "an lhc training run",
    required: bool = True,
) -> None:
    """``--checkpoint`` (a Hugging Face directory, a ``.gguf`` file or a name of
    ``lhc.lm.pretrained_models.MODELS``), ``--workdir`` and ``--dtype``."""
    source = parser_.add_mutually_exclusive_group(required=required)
    source.add_argument(
        "--checkpoint",
        default=None,
        help=CHECKPOINT_HELP,
    )
    source.add_argument("--workdir", default=None, help=workdir_help)
    parser_.add_argument(
        "--dtype", default=None, help="for --checkpoint: float32 on CPU, bfloat16 elsewhere"
    )


def load_model_source(args: argparse.Namespace, **overrides: Any):
    """The ``lhc.lm.Checkpoint`` of ``args.checkpoint`` or ``args.workdir``
    (``lhc.train.load_language_model``; ``overrides`` for a checkpoint only), or
    SystemExit with one line."""
    from lhc.train import load_language_model

    kwargs = dict(overrides)
    if args.checkpoint is not None and getattr(args, "dtype", None) is not None:
        kwargs["dtype"] = args.dtype
    if args.checkpoint is None:
        kwargs = {}
    try:
        return load_language_model(args.checkpoint, args.workdir, **kwargs)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        flag = "--checkpoint" if args.checkpoint is not None else "--workdir"
        raise SystemExit(f"{flag}: {error}") from None


def provenance(args: argparse.Namespace) -> dict[str, str | None]:
    """What a result row needs to be traced to what made it: ``source``, the SHA-256 of
    ``args.checkpoint``'s weights (the GGUF file, or the Hugging Face directory's
    ``*.safetensors`` files in name order) or the ``args.workdir`` path, and
    ``lhc_commit``, the commit of this lhc checkout (``-dirty`` with uncommitted changes;
    None outside a git checkout)."""
    import hashlib
    import subprocess

    from lhc.lm.checkpoints import resolve_checkpoint

    source = args.workdir
    if getattr(args, "checkpoint", None):
        path = resolve_checkpoint(args.checkpoint)
        files = (
            [path]
            if os.path.isfile(path)
            else sorted(
                os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")
            )
        )
        digest = hashlib.sha256()
        for file in files:
            with open(file, "rb") as handle:
                if len(files) == 1:
                    digest = hashlib.file_digest(handle, "sha256")
                else:
                    digest.update(hashlib.file_digest(handle, "sha256").digest())
        source = digest.hexdigest()
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *a: subprocess.run(  # noqa: E731
        ["git", *a], cwd=here, capture_output=True, text=True, check=False
    )
    commit = git("rev-parse", "--short", "HEAD").stdout.strip() or None
    if commit and git("status", "--porcelain", "--untracked-files=no").stdout.strip():
        commit += "-dirty"
    return {"source": source, "lhc_commit": commit}


def restore_run(workdir: str, *, model_type: type | tuple[type, ...] | None = None, what: str = ""):
    """``(run, params, step)`` (``lhc.train.Run``) of the latest checkpoint of an lhc run, or
    SystemExit with one line: no run there, or its model is not ``model_type`` (``what``
    names the config that trains one)."""
    from lhc.train import restore_params

    try:
        run, params, step = restore_params(None, workdir)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(str(error)) from None  # the message names the workdir
    model = run.task.model
    if model_type is not None and not isinstance(model, model_type):
        raise SystemExit(
            f"--workdir {workdir!r}: a {type(model).__name__}, not a model of {what or model_type}"
        )
    return run, params, step


# Timing -------------------------------------------------------------------------------


def timed(fn: Callable[..., Any], repeats: int, *, prepare: Callable[[], tuple] | None = None):
    """``(seconds, output)``: the fastest of ``repeats`` calls of ``fn(*prepare())``
    after a first call that is not timed; ``prepare`` (e.g. a fresh copy of a donated
    cache) runs before the clock starts."""
    import jax

    prepare = prepare or (lambda: ())
    out = jax.block_until_ready(fn(*prepare()))
    best = float("inf")
    for _ in range(repeats):
        args = jax.block_until_ready(prepare())
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best, out


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after one untimed call, seconds."""
    return timed(fn, repeats)[0]


def interleaved_best(
    fns: Mapping[str, Callable[[], Any]], repeats: int, *, between: Callable[[], Any] | None = None
) -> dict[str, float]:
    """The fastest of ``repeats`` calls of each function, the functions called in turn
    in every repeat (after one untimed call each), so that a slow spell of a shared
    machine hits all of them alike; ``between`` runs after each call (e.g. a bandwidth
    probe)."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - start)
            if between is not None:
                between()
    return best


def streaming_read(num_bytes: int = 2**30) -> Callable[[], float]:
    """A timed jitted streaming read (a sum) of a ``num_bytes`` array: each call returns
    the bytes per second of one read."""
    import jax
    import jax.numpy as jnp

    data = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()

    def read() -> float:
        start = time.perf_counter()
        total(data).block_until_ready()
        return data.nbytes / (time.perf_counter() - start)

    return read


def matmul_rate(size: int = 2048, repeats: int = 5) -> float:
    """This device's float32 matmul rate, FLOP/s: the best of ``repeats`` jitted
    ``size x size`` products (the ceiling a compute-bound prefill can reach)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    product = jax.jit(jnp.matmul)
    product(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


@contextlib.contextmanager
def compile_clock():
    """``{"seconds": ...}``: what JAX spends tracing, lowering and compiling in the block
    (from its monitoring events)."""
    import jax

    spent = {"seconds": 0.0}

    def record(event, duration, **_):
        if event in COMPILE_EVENTS:
            spent["seconds"] += duration

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        yield spent
    finally:
        jax.monitoring.unregister_event_duration_listener(record)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _release_free_memory() -> None:
    """Returns freed heap pages to the kernel (glibc's ``malloc_trim``), so that memory an
    earlier computation freed is not counted as resident, nor reused unseen."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def peak_memory():
    """``{"bytes": ...}``: how far the block raises this process's resident memory at its
    peak above where it started (Linux's high-water mark ``VmHWM``, reset on entry by
    writing 5 to ``/proc/self/clear_refs``, after freed heap pages are returned to the
    kernel); ``None`` where the kernel offers neither."""
    held: dict[str, int | None] = {"bytes": None}
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = _status_bytes("VmRSS")
    except OSError:
        before = None
    try:
        yield held
    finally:
        peak = _status_bytes("VmHWM")
        if before is not None and peak is not None:
            held["bytes"] = peak - before


# Output -------------------------------------------------------------------------------


def footer() -> str:
    """One line: the device, JAX's version and the date (UTC)."""
    import jax

    device = jax.devices()[0]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"device: {device.device_kind} ({device.platform}, {jax.device_count()} devices, "
        f"{os.cpu_count()} host CPUs); jax {jax.__version__}; {now}"
    )


def finish(result: dict, args: argparse.Namespace) -> dict:
    """Prints the footer, writes ``result`` (with the footer and the command line) to
    ``args.json`` when given, and returns it."""
    line = footer()
    print(f"\n{line}")
    if getattr(args, "json", None):
        record = {**result, "footer": line, "argv": sys.argv}
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1, default=_json_value)
    return result


def _json_value(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# The registry --------------------------------------------------------------------------


def resolve(name: str, argv: Sequence[str]) -> tuple[Callable[[list[str]], Any], list[str]]:
    """The ``main`` of benchmark ``name`` (or an alias) and its arguments.

    Raises:
        SystemExit: an unknown name, with the list.
    """
    import importlib

    argv = list(argv)
    if name in ALIASES:
        name, front = ALIASES[name]
        argv = [*front, *argv]
    if name not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        raise SystemExit(
            f"lhc bench: unknown benchmark {name!r}; known: {known} (lhc bench --list)"
        )
    module, function = BENCHMARKS[name].split(":")
    return getattr(importlib.import_module(module), function), argv


def listing() -> str:
    """``lhc bench --list``: each benchmark's first docstring line, and the aliases."""
    import importlib

    lines = []
    for name, target in sorted(BENCHMARKS.items()):
        module = importlib.import_module(target.split(":")[0])
        summary = (module.__doc__ or "").strip().split("\n")[0]
        lines.append(f"{name:<10} {summary}")
    aliases = ", ".join(
        f"{old} = {new} {' '.join(front)}".rstrip() for old, (new, front) in ALIASES.items()
    )
    lines.append(f"\naliases: {aliases}")
    return "\n".join(lines)
