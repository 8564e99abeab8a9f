"""Metric writers: JSON lines and TensorBoard event files, from process 0 only.

A resumed run first drops the rows of the steps after its checkpoint (they are trained
again), in ``metrics.jsonl`` and in the TensorBoard event files alike, so every step
appears once however often the run was interrupted.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import time

import jax


class MetricWriter:
    """Appends ``{"step": s, name: value, ...}`` lines to ``workdir/metrics.jsonl``.

    Also writes TensorBoard scalars under ``workdir/tensorboard`` (tensorboardX's event
    files, no TensorFlow needed); ``flush`` puts every row written so far on disk. On processes other than 0 every method is a no-op, so callers
    need no branches.

    Args:
      workdir: the run's directory.
      tensorboard: also write TensorBoard events.
      resume_step: the step the run continues from: rows of later steps, left by an
        interrupted run, are removed first (None keeps everything).
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, resume_step: int | None = None):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.active:
            return
        os.makedirs(workdir, exist_ok=True)
        events = os.path.join(workdir, "tensorboard")
        if resume_step is not None:
            truncate_metrics(workdir, resume_step)
            truncate_events(events, resume_step)
        if tensorboard:
            # tensorboardX's record writer, called in this thread (its SummaryWriter
            # queues events for a background thread, so a flush could miss some); the
            # pid keeps runs that start within one second in separate files.
            from tensorboardX.event_file_writer import EventsWriter

            os.makedirs(events, exist_ok=True)
            self._tb = EventsWriter(os.path.join(events, "events"), f".{os.getpid()}")

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": int(step)}
        row.update({k: _to_python(v) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            from tensorboardX.proto import event_pb2, summary_pb2

            values = [
                summary_pb2.Summary.Value(tag=key, simple_value=float(value))
                for key, value in row.items()
                if key != "step" and isinstance(value, (int, float))
            ]
            summary = summary_pb2.Summary(value=values)
            self._tb.write_event(
                event_pb2.Event(wall_time=time.time(), step=row["step"], summary=summary)
            )

    def flush(self) -> None:
        """Writes buffered TensorBoard events to disk (the JSONL file is never buffered)."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def _to_python(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _parse_rows(path: str) -> list[dict]:
    """The complete rows of a JSONL file (a last line cut off by a kill is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise ValueError(f"{path!r}: malformed metrics row {line[:200]!r}") from None
    return rows


def read_metrics(workdir: str) -> list[dict]:
    """All rows of ``workdir/metrics.jsonl`` (empty when there is none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return _parse_rows(path)


# Throughput columns (lhc.train.telemetry) that get no panel of their own: the step time
# and MFU are the tokens/s curve scaled, compile_s one point per (re)start.
_NOT_PLOTTED = ("chance_loss", "step_time_s", "compile_s", "mfu")
_THROUGHPUT = {"tokens_per_s": "tokens/s"}


def plot_metrics(workdir: str, path: str | None = None) -> str:
    """Draws the curves of ``workdir/metrics.jsonl`` to ``path`` (default
    ``workdir/metrics.png``): a panel per metric (the loss first), train and eval rows as
    two lines against the step, and a last panel of the training throughput (tokens/s)
    when the rows have it; returns the path.

    Raises:
      FileNotFoundError: no metrics rows in ``workdir``.
    """
    from lhc import plots

    series: dict[str, dict[str, tuple[list, list]]] = {}
    for row in read_metrics(workdir):
        for key, value in row.items():
            split, _, name = key.partition("/")
            if name and name not in _NOT_PLOTTED and isinstance(value, (int, float)):
                name = _THROUGHPUT.get(name, name)
                x, y = series.setdefault(name, {}).setdefault(split, ([], []))
                x.append(row["step"])
                y.append(value)
    if not series:
        raise FileNotFoundError(
            f"--workdir {workdir!r}: no metrics to plot (metrics.jsonl is written by `lhc train`)"
        )
    last = set(_THROUGHPUT.values())
    names = sorted(series, key=lambda name: (name in last, name != "loss", name))
    path = path or os.path.join(workdir, "metrics.png")
    plots.panels(path, {name: series[name] for name in names}, xlabel="step")
    return path


def _replace(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (a kill leaves the old or the new file)."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def truncate_metrics(workdir: str, step: int) -> int:
    """Drops the rows of ``workdir/metrics.jsonl`` after ``step``; returns how many."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    rows = _parse_rows(path)
    kept = [row for row in rows if row["step"] <= step]
    with open(path, "rb") as f:
        complete = f.read().endswith(b"\n") or not rows
    if len(kept) < len(rows) or not complete:
        _replace(path, "".join(json.dumps(row) + "\n" for row in kept).encode())
    return len(rows) - len(kept)


def read_event_records(path: str) -> list[bytes]:
    """The complete framed records of a TensorBoard event file, in order.

    A record is ``uint64 length, uint32 crc, data, uint32 crc``; one cut off by a kill
    ends the list.
    """
    with open(path, "rb") as f:
        data = f.read()
    records, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        end = offset + 12 + length + 4
        if end > len(data):
            break
        records.append(data[offset:end])
        offset = end
    return records


def event_of(record: bytes):
    """The ``Event`` proto of one framed record."""
    from tensorboardX.proto import event_pb2

    event = event_pb2.Event()
    event.ParseFromString(record[12:-4])
    return event


def truncate_events(directory: str, step: int) -> int:
    """Drops the TensorBoard events after ``step`` from every event file in
    ``directory`` (records are copied unchanged, checksums included); returns how many.
    """
    dropped = 0
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        records = read_event_records(path)
        kept = [record for record in records if event_of(record).step <= step]
        if len(kept) < len(records) or sum(map(len, records)) != os.path.getsize(path):
            _replace(path, b"".join(kept))
        dropped += len(records) - len(kept)
    return dropped
