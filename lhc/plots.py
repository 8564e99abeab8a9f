"""The figures lhc draws, as PNG files: heat maps of a grid and curves of y against x.

A shared layer (it imports no method package), used by the passkey and NoLiMa heat maps
(``lhc.train.passkey``, ``lhc.nolima.scores``), the recurrent LMs' curves by position
(``lhc.recurrent.evaluation``), the range report (``lhc.graphs.report``) and a run's
training curves (``lhc.train.metrics.plot_metrics``).
matplotlib is imported on the first figure, with the Agg backend (files only, no
display), so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence

import numpy as np

DPI = 120


@functools.cache
def pyplot():
    """``matplotlib.pyplot``, with the Agg backend set once (on the first call)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: str) -> None:
    """Lays out ``figure``, writes it to ``path`` (making its directory) and closes it."""
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=DPI)
    pyplot().close(figure)


def heatmap(
    path: str,
    values,
    *,
    x_ticks: Sequence[str],
    y_ticks: Sequence[str],
    xlabel: str,
    ylabel: str,
    title: str,
    vmin: float = 0.0,
    vmax: float = 1.0,
    cmap: str = "RdYlGn",
) -> None:
    """Writes ``values [len(y_ticks), len(x_ticks)]`` as a heat map with a colour bar,
    each cell labelled with its value (``"n/a"`` where NaN, left blank in colour).

    Args:
        path: the PNG file.
        values: the grid, row ``i`` drawn at ``y_ticks[i]``, column ``j`` at ``x_ticks[j]``.
        x_ticks, y_ticks: the tick label of each column and row.
        xlabel, ylabel, title: the axis labels and the title.
        vmin, vmax, cmap: the colour scale.
    """
    values = np.asarray(values, float)
    if values.shape != (len(y_ticks), len(x_ticks)):
        raise ValueError(
            f"values must be [len(y_ticks), len(x_ticks)] = [{len(y_ticks)}, {len(x_ticks)}], "
            f"got {values.shape=}"
        )
    plt = pyplot()
    figure, axis = plt.subplots(
        figsize=(1.2 + 0.9 * len(x_ticks), max(3.2, 1.6 + 0.2 * len(y_ticks)))
    )
    image = axis.imshow(
        np.ma.masked_invalid(values), vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto"
    )
    axis.set_xticks(range(len(x_ticks)), list(x_ticks))
    axis.set_yticks(range(len(y_ticks)), list(y_ticks))
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            text = "n/a" if np.isnan(value) else f"{value:.2f}"
            axis.text(j, i, text, ha="center", va="center", fontsize=7)
    axis.set_title(title)
    figure.colorbar(image, ax=axis)
    _save(figure, path)


def length_depth_heatmap(
    path: str, accuracy, lengths: Sequence[int], depths: Sequence[float], title: str
) -> None:
    """Writes ``accuracy [len(lengths), len(depths)]`` of a needle-in-a-haystack test as
    a depth x length heat map (``heatmap``), lengths as ``4K`` where a multiple of 1024."""
    heatmap(
        path,
        np.asarray(accuracy, float).T,
        x_ticks=[_token_count(n) for n in lengths],
        y_ticks=[f"{d:g}" for d in depths],
        xlabel="context length (tokens)",
        ylabel="needle depth",
        title=title,
    )


def _token_count(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A horizontal line across the axes at ``y`` (in the legend when it has a label)."""

    y: float
    label: str | None = None
    color: str = "k"
    linestyle: str = "--"


def curves(
    path: str,
    lines: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    references: Sequence[Reference] = (),
    log_x_base: float | None = None,
    y_limits: tuple[float, float] | None = None,
    marker: str | None = None,
    legend_fontsize: float | None = None,
    figsize: tuple[float, float] = (6.0, 3.6),
) -> None:
    """Writes one labelled line per ``lines[label] = (x, y)``, then the ``references``,
    as a PNG with a legend.

    Args:
        path: the PNG file.
        lines: per label, the x and y values of its line (colours ``C0``, ``C1``, ...
            in this order).
        xlabel, ylabel, title: the axis labels and the title (none by default).
        references: horizontal lines drawn after the curves.
        log_x_base: a logarithmic x axis of this base (linear by default).
        y_limits: the y range (matplotlib's choice by default).
        marker: the marker of every point (none by default).
        legend_fontsize: the legend's font size (matplotlib's default by default).
        figsize: the figure's size in inches.
    """
    plt = pyplot()
    figure, axis = plt.subplots(figsize=figsize)
    for label, (x, y) in lines.items():
        axis.plot(x, y, marker=marker, label=label)
    for reference in references:
        axis.axhline(
            reference.y, color=reference.color, ls=reference.linestyle, label=reference.label
        )
    if log_x_base is not None:
        axis.set_xscale("log", base=log_x_base)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if y_limits is not None:
        axis.set_ylim(*y_limits)
    if title is not None:
        axis.set_title(title)
    axis.legend(fontsize=legend_fontsize)
    _save(figure, path)


def panels(
    path: str,
    series: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str,
    width: float = 6.0,
    panel_height: float = 2.2,
) -> None:
    """Writes one panel per ``series[name]``, stacked over a shared x axis, each with
    a labelled line per ``series[name][label] = (x, y)`` (points marked when few)."""
    plt = pyplot()
    figure, axes = plt.subplots(
        len(series), 1, figsize=(width, panel_height * len(series)), sharex=True, squeeze=False
    )
    for axis, (name, lines) in zip(axes[:, 0], series.items()):
        for label, (x, y) in lines.items():
            axis.plot(x, y, label=label, marker="o" if len(x) <= 30 else None, markersize=3)
        axis.set_ylabel(name)
        axis.legend(fontsize="small")
    axes[-1, 0].set_xlabel(xlabel)
    _save(figure, path)
