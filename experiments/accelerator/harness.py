"""What every section of the accelerator run shares: the environment check, the row
sink with its time budget, timing, and errors against a reference."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIN_JAX = (0, 10)


def check_environment() -> dict[str, Any]:
    """The versions and device of this run, or SystemExit with one clear line when JAX
    is too old or lacks an API the sections use."""
    try:
        import jax
    except ImportError:
        raise SystemExit("accelerator: JAX is not installed in this Python") from None
    version = tuple(int(part) for part in jax.__version__.split(".")[:2])
    if version < MIN_JAX:
        raise SystemExit(
            f"accelerator: needs jax >= {'.'.join(map(str, MIN_JAX))}, got {jax.__version__}"
        )
    import inspect

    missing = []
    if "implementation" not in inspect.signature(jax.nn.dot_product_attention).parameters:
        missing.append("jax.nn.dot_product_attention(implementation=...)")
    try:
        from jax.experimental.pallas import triton as plgpu

        plgpu.CompilerParams  # noqa: B018
    except (ImportError, AttributeError):
        missing.append("jax.experimental.pallas.triton.CompilerParams")
    if not hasattr(jax.Device, "memory_stats"):
        missing.append("jax.Device.memory_stats")
    if missing:
        raise SystemExit(f"accelerator: jax {jax.__version__} lacks {', '.join(missing)}")
    device = jax.devices()[0]
    environment = dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(), jax=jax.__version__, platform=device.platform,
        device=device.device_kind, device_count=jax.device_count(), host_cpus=os.cpu_count(),
    )  # fmt: skip
    for name in ("jaxlib", "flax", "torch", "tabicl", "triton"):
        try:
            environment[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            environment[name] = None
    return environment


def read_rows(out: Path) -> list[dict]:
    """The rows written so far to ``out/rows.jsonl`` (a line cut by a kill is dropped)."""
    path = out / "rows.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def append_row(out: Path, row: dict) -> None:
    with open(out / "rows.jsonl", "a") as handle:
        handle.write(json.dumps(row, default=json_default) + "\n")


def json_default(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    return str(value)


class Section:
    """What the measurements of one section share: the mode, the time budget, where the
    rows go, the ceilings measured earlier in the run, and how kernels are lowered.

    Attributes:
        name: the section.
        out: the run's folder.
        smoke: tiny shapes (and kernels interpreted when there is no accelerator).
        deadline: ``time.time()`` after which rows are skipped.
        platform: JAX's platform (``"gpu"``, ``"tpu"``, ``"cpu"``).
        backend: the Pallas lowering to use, ``"gpu"`` (Triton) or ``"tpu"`` (Mosaic);
            on CPU the GPU kernels are the ones interpreted, as they are what a GPU runs.
        interpret: whether the Pallas kernels are interpreted.
        ceilings: the ``ceilings`` row (``copy_gbps``, ``matmul_tflops``), if measured.
    """

    def __init__(self, name: str, out: Path, smoke: bool, deadline: float, platform: str):
        self.name, self.out, self.smoke, self.deadline = name, out, smoke, deadline
        self.platform = platform
        self.backend = "tpu" if platform == "tpu" else "gpu"
        self.interpret = platform not in ("gpu", "tpu")
        self.ceilings = next((row for row in read_rows(out) if row.get("table") == "ceilings"), {})

    def time_left(self) -> float:
        return self.deadline - time.time()

    def emit(self, table: str, **row) -> None:
        row = dict(section=self.name, table=table, **row)
        append_row(self.out, row)
        shown = {k: v for k, v in row.items() if k not in ("section", "table", "traceback")}
        print(f"[{self.name}/{table}] {json.dumps(shown, default=json_default)}", flush=True)

    def run(self, table: str, label: dict, measure: Callable[[], dict]) -> dict | None:
        """Emits ``label`` with what ``measure()`` returns, or with the error it raised
        (one failing row does not stop the section), or as skipped once the budget is
        spent. Returns the measurement, or None."""
        if self.time_left() <= 0:
            self.emit(table, **label, skipped="time budget spent")
            return None
        try:
            result = measure()
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0]
            self.emit(
                table, **label, error=f"{type(error).__name__}: {first}"[:400],
                traceback=traceback.format_exc()[-3000:],
            )  # fmt: skip
            return None
        self.emit(table, **label, **result)
        return result

    def fraction(self, rate: float, ceiling: str) -> float | None:
        """``rate`` over the ceiling ``copy_gbps`` or ``matmul_tflops`` of this run."""
        value = self.ceilings.get(ceiling)
        return rate / value if value else None


def timed(fn: Callable, *args, smoke: bool, target_s: float = 0.05, repeats: int = 5):
    """``(timing, output)`` of ``fn(*args)``: the first call (compile included), then
    the median over ``repeats`` batches of back-to-back calls of about ``target_s``
    each (``target_s=0``: one call per batch). ``timing`` has ``ms``, ``spread``
    (max - min over the median) and ``first_call_s``."""
    import jax
    import numpy as np

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    if smoke:
        repeats, target_s = 1, 0.0
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    calls = int(min(max(target_s / max(once, 1e-6), 1), 200))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        samples.append((time.perf_counter() - start) / calls)
    median = float(np.median(samples))
    timing = dict(ms=1e3 * median, spread=float((max(samples) - min(samples)) / median),
                  first_call_s=first)  # fmt: skip
    return timing, out


def errors(outputs, references) -> dict[str, float]:
    """The largest absolute error and the largest relative L2 error ``|out - ref| /
    |ref|`` over matching leaves of two pytrees, in float32 (a NaN anywhere gives NaN)."""
    import jax
    import jax.numpy as jnp

    max_abs, relative = 0.0, 0.0
    for out, ref in zip(jax.tree.leaves(outputs), jax.tree.leaves(references), strict=True):
        out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
        if out.shape != ref.shape:
            raise ValueError(f"output shape {out.shape} differs from the reference's {ref.shape}")
        diff = out - ref
        leaf_abs = float(jnp.max(jnp.abs(diff)))
        leaf_relative = float(jnp.linalg.norm(diff)) / max(float(jnp.linalg.norm(ref)), 1e-30)
        if math.isnan(leaf_abs) or math.isnan(leaf_relative):  # max() would drop a NaN
            return dict(max_abs_err=math.nan, rel_err=math.nan)
        max_abs, relative = max(max_abs, leaf_abs), max(relative, leaf_relative)
    return dict(max_abs_err=max_abs, rel_err=relative)


def per_second(amount: float, timing: dict, unit: float) -> float:
    """``amount`` per second of ``timing['ms']``, in ``unit`` (1e9: GB/s, 1e12: TFLOP/s)."""
    return amount / (timing["ms"] / 1e3) / unit
