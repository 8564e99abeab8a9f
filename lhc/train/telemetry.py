"""Throughput telemetry of ``lhc train``: step time, tokens per second, MFU, profiles.

Every train log row carries

* ``train/step_time_s``: mean wall seconds per step since the previous row, measured on
  the host. The device is synchronised only where the loop already waits for it (the
  log point, an evaluation, the finite check before a checkpoint), so steps keep
  being dispatched asynchronously; the seconds spent evaluating or saving are left out.
* ``train/tokens_per_s``: tokens per step over the step time. Tokens per step are those
  of the global batch: ``B * T`` of the task's ``batch_spec`` ``"tokens"`` entry (its
  leading two dims), or the batch size for a task without one (then it is examples/s).
* ``train/mfu``: model FLOP utilisation, when the peak FLOP/s of the device is known
  (``config.peak_flops``, else ``PEAK_FLOPS`` by ``device_kind``): the compiled step's
  FLOPs (XLA's ``cost_analysis`` of the program one device runs, times the devices;
  rematerialised and replicated work included) over the step time and the peak of all
  devices. The step is compiled for it once, before its first run, which reuses it.
* ``train/compile_s``: once after each (re)start, on the first row: the wall seconds of
  the first step (compiling it included), which no step time counts.

``config.profile_steps = (a, b)`` writes a ``jax.profiler`` trace of the steps whose
0-based index ``i`` has ``a <= i < b`` (the state's step counter going from ``a`` to
``b``: the metric rows of steps ``a+1 .. b``) to ``WORKDIR/profile``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

# Peak dense bf16 FLOP/s per device (one chip), from the vendors' spec sheets:
# Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e,
# "peak compute per chip (bf16)"); NVIDIA H100 and H200 datasheets (BF16 Tensor Core,
# which they give "with sparsity": the dense peak is half). Matched in order against
# the normalised ``device_kind`` (lower case, words split by single spaces).
PEAK_FLOPS: tuple[tuple[str, str, float], ...] = (
    (r"^tpu v4$", "TPU v4", 275e12),  # not "TPU v4 lite" (v4i)
    (r"^tpu v5 ?(lite|e)\b", "TPU v5e", 197e12),  # device_kind "TPU v5 lite"
    (r"^tpu v5 ?p?$", "TPU v5p", 459e12),  # device_kind "TPU v5"
    (r"^tpu v6 ?(lite|e)\b", "TPU v6e (Trillium)", 918e12),  # device_kind "TPU v6 lite"
    (r"\bh100\b.*\bpcie\b", "NVIDIA H100 PCIe", 756e12),  # 1,513 sparse
    (r"\bh100\b.*\bnvl\b", "NVIDIA H100 NVL", 835e12),  # 1,671 sparse
    (r"\bh100\b", "NVIDIA H100 SXM", 989e12),  # "NVIDIA H100 80GB HBM3"; 1,979 sparse
    (r"\bh200\b.*\bnvl\b", "NVIDIA H200 NVL", 835e12),  # 1,671 sparse
    (r"\bh200\b", "NVIDIA H200 SXM", 989e12),  # "NVIDIA H200"; 1,979 sparse
)

PROFILE_DIR = "profile"
# The columns a train row may get here: wall-clock measurements, which differ between
# two runs of the same steps (compare rows without them).
COLUMNS = ("train/step_time_s", "train/tokens_per_s", "train/mfu", "train/compile_s")


def table_peak_flops(device_kind: str) -> tuple[str, float] | None:
    """``(name, peak bf16 dense FLOP/s)`` of a ``device_kind`` in ``PEAK_FLOPS``, or
    None for another device (a CPU, an unlisted accelerator)."""
    kind = " ".join(re.sub(r"[^a-z0-9]+", " ", device_kind.lower()).split())
    for pattern, name, flops in PEAK_FLOPS:
        if re.search(pattern, kind):
            return name, flops
    return None


def peak_flops(config, device=None) -> tuple[float | None, str]:
    """Peak FLOP/s of one device and where it came from: ``config.peak_flops`` when
    set, else the table entry of ``device`` (default the first device)."""
    configured = config.get("peak_flops")
    if configured is not None:
        return float(configured), "config.peak_flops"
    kind = (device or jax.devices()[0]).device_kind
    found = table_peak_flops(kind)
    if found is None:
        return None, f"device kind {kind!r} has no known peak FLOP/s"
    return found[1], f"{found[0]} bf16 dense peak"


def tokens_per_step(batch_spec: dict, batch_size: int) -> tuple[int, str]:
    """Tokens of one global batch and what they count: the product of the leading two
    dims of ``batch_spec["tokens"]`` (``B x T``), else ``batch_size`` (examples)."""
    tokens = batch_spec.get("tokens")
    if tokens is not None and len(tokens.shape) >= 1:
        count = int(np.prod(tokens.shape[:2]))
        return count, f"batch_spec 'tokens' {' x '.join(map(str, tokens.shape[:2]))}"
    return int(batch_size), "examples (the task's batch has no 'tokens')"


def cost_flops(compiled) -> float | None:
    """The ``"flops"`` of a compiled program's ``cost_analysis()`` (per device: XLA
    counts the partitioned program one device runs), or None when XLA gives none."""
    try:
        cost = compiled.cost_analysis()
    except Exception as error:  # noqa: BLE001 - some backends implement no cost model
        log.info("no cost analysis of the train step: %s", error)
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and flops > 0 else None


class StepClock:
    """Host wall time of the train steps, for the throughput columns of the log rows.

    The loop calls ``first_step`` around its first step after a (re)start (timed apart,
    ``train/compile_s``), ``count`` after every later step, ``row`` at a log point once
    the device is synchronised, and ``restart`` once it has waited for the device after
    other work (evaluation, a checkpoint), which the next window leaves out.

    Args:
      tokens: tokens (or examples) per step, ``tokens_per_step``.
      peak: peak FLOP/s of one device, or None (no ``train/mfu``).
      num_devices: the devices a step runs on.
    """

    def __init__(self, tokens: int, peak: float | None, num_devices: int):
        self.tokens, self.peak, self.num_devices = tokens, peak, num_devices
        self.flops: float | None = None  # FLOPs per step of all devices, once compiled
        self.compile_s: float | None = None
        self._start = time.perf_counter()
        self._steps = 0
        self._excluded = 0.0

    def first_step(self, train_step, state, batch, frozen: tuple):
        """Compiles ``train_step`` for these arguments (reading its FLOPs when a peak is
        known), runs it once and waits for it; returns its ``(state, metrics)``."""
        start = time.perf_counter()
        if self.peak is not None:
            compiled = train_step.lower(state, batch, *frozen).compile()  # jit reuses it
            per_device = cost_flops(compiled)
            self.flops = None if per_device is None else per_device * self.num_devices
            if self.flops is None:
                log.info("XLA reports no FLOPs for the train step: no train/mfu column")
        state, metrics = train_step(state, batch, *frozen)
        jax.block_until_ready(metrics)
        self.compile_s = time.perf_counter() - start
        self.restart()
        return state, metrics

    def count(self) -> None:
        self._steps += 1

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` of host work that is no step (starting a trace) out."""
        self._excluded += seconds

    def restart(self) -> None:
        """The device is synchronised: the next window starts now."""
        self._start = time.perf_counter()
        self._steps = 0
        self._excluded = 0.0

    def row(self) -> dict[str, float]:
        """The throughput columns of a log row (the device synchronised just before):
        ``train/compile_s`` on the first row after a (re)start, and the step time,
        tokens/s and MFU of the steps since the window started (none on a row whose
        window holds no step: ``log_every=1`` right after the first step)."""
        now = time.perf_counter()
        row: dict[str, float] = {}
        if self.compile_s is not None:
            row["train/compile_s"] = self.compile_s
            self.compile_s = None
        if self._steps:
            step_time = (now - self._start - self._excluded) / self._steps
            row["train/step_time_s"] = step_time
            row["train/tokens_per_s"] = self.tokens / step_time
            if self.flops is not None and self.peak is not None:
                row["train/mfu"] = self.flops / step_time / (self.peak * self.num_devices)
        return row


def step_clock(exp, batch_spec: dict) -> StepClock:
    """The ``StepClock`` of an experiment: its tokens per step and peak FLOP/s, said
    once in the log (and why there is no ``train/mfu`` column, if there is none)."""
    tokens, counted = tokens_per_step(batch_spec, int(exp.config.batch_size))
    peak, source = peak_flops(exp.config)
    num_devices = int(exp.mesh.devices.size)
    log.info("throughput: %d tokens per step (%s)", tokens, counted)
    if peak is None:
        log.info("%s: no train/mfu column (set config.peak_flops to have one)", source)
    else:
        log.info("MFU against %.4g FLOP/s per device (%s) x %d", peak, source, num_devices)
    return StepClock(tokens, peak, num_devices)


class Profiler:
    """Traces the steps ``a <= i < b`` (0-based step index) of ``profile_steps = (a, b)``
    with ``jax.profiler`` into ``directory``; the device is synchronised at the start
    and the stop. A run that (re)starts after step ``a`` traces nothing."""

    def __init__(self, profile_steps, directory: str, start_step: int):
        self.window = tuple(int(s) for s in profile_steps) if profile_steps else None
        self.directory = directory
        self.active = False
        if self.window is not None and start_step > self.window[0]:
            log.info(
                "config.profile_steps %s: the run starts at step %d, after its start; no trace",
                self.window,
                start_step,
            )
            self.window = None

    def before_step(self, step: int, state: Any) -> float:
        """Starts the trace before the step of index ``a``; returns the seconds that
        starting it took (after waiting for the device), which are no step's."""
        if self.window is None or self.active or step != self.window[0]:
            return 0.0
        jax.block_until_ready(state)
        start = time.perf_counter()
        if "://" not in self.directory:
            os.makedirs(self.directory, exist_ok=True)
        jax.profiler.start_trace(self.directory)
        self.active = True
        log.info("profiling steps %d <= i < %d into %s", step, self.window[1], self.directory)
        return time.perf_counter() - start

    def after_step(self, step: int, state: Any) -> float:
        """Stops the trace once ``step`` (the count of steps done) reaches ``b``;
        returns the seconds that writing it took (after waiting for the device)."""
        if not self.active or step < self.window[1]:
            return 0.0
        jax.block_until_ready(state)
        start = time.perf_counter()
        self.stop()
        return time.perf_counter() - start

    def stop(self) -> None:
        """Stops a trace in progress (also when the run ends before step ``b``)."""
        if self.active:
            self.active = False
            self.window = None
            jax.profiler.stop_trace()
            log.info("profile written to %s", self.directory)
