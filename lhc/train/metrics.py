"""Metric writers: JSON lines and TensorBoard event files, from process 0 only."""

from __future__ import annotations

import json
import math
import os

import jax


class MetricWriter:
    """Appends ``{"step": s, name: value, ...}`` lines to ``workdir/metrics.jsonl``.

    Also writes TensorBoard scalars under ``workdir/tensorboard`` (tensorboardX, no
    TensorFlow needed). On processes other than 0 every method is a no-op, so callers
    need no branches.
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.active:
            return
        os.makedirs(workdir, exist_ok=True)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": int(step)}
        row.update({k: _to_python(v) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, int(step))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _to_python(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(workdir: str) -> list[dict]:
    """All rows of ``workdir/metrics.jsonl`` (empty when there is none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
