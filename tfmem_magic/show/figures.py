"""Charts of a report as PNG bytes (matplotlib's object API, no pyplot state, Agg canvas).

Colours are chosen to read on light and dark notebook themes: a transparent background, mid-grey text and axes,
saturated series colours. Pure Report → bytes functions: the panel and the static HTML embed the same images.
"""

from __future__ import annotations

import gc
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from tfmem_magic.core.report import LiveGroup, Report
from tfmem_magic.core.sizes import format_bytes

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn, not with this module
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INK = "#8a8a8a"  # text and axes: legible on white and on dark grey
TF_COLOR = "#3d7be0"
RSS_COLOR = "#e0833d"
BUDGET_COLOR = "#d64545"
# the trace's other allocators (a GPU trace's pinned host memory, the other GPUs), drawn thinner next to the main one
ALLOCATOR_COLORS = ("#2ea67a", "#8e5bd8", "#c9a227", "#6d8fb3", "#9e9e9e")
PHASE_COLORS = {
    "forward": "#3d7be0",
    "backward": "#8e5bd8",
    "optimizer": "#e0833d",
    "workspace": "#d6568c",
    "input": "#2ea67a",
    "weights": "#c9a227",
    "pre-existing": "#9e9e9e",
    "untraced": "#bdbdbd",
    "other": "#6d8fb3",
}


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return scale, name
    return 1, "B"


def _figure(width_in: float, height_in: float, rows: int = 1) -> tuple[Figure, Sequence[Axes]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.set_facecolor("none")
        ax.tick_params(colors=INK, labelsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        for side in ("left", "bottom"):
            ax.spines[side].set_color(INK)
        ax.grid(True, alpha=0.2, color=INK)
    return fig, cast("Sequence[Axes]", axes)  # a 1-d object array of Axes


_renders = 0
COLLECT_EVERY = 16
# A series of fewer points (a cell of a few sampling periods: its start, its end, a sample or two) draws no line
# worth reading, and the chart was most of what a short profiled cell cost: ~109 ms with it, 3.1 ms without in quick
# mode (benchmarks/cell_cost.py, docs/overhead.md). The headline's peaks are exact without it.
MIN_POINTS = 4


def _png(fig: Figure) -> bytes:
    """Render a figure to PNG bytes and let its memory go.

    Every matplotlib artist refers to its figure and axes, so a finished figure is a web of reference cycles that
    only a full garbage collection frees. In a TensorFlow process those are rare (hundreds of thousands of long-lived
    objects) and cost ~160 ms each, so figures piled up (measured: +42 MiB RSS over 200 profiled cells). A full
    collection after every 16th figure bounds what waits to a few figures, at ~10 ms per figure.
    """
    global _renders
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", transparent=True, bbox_inches="tight")
    finally:
        fig.clear()
        del fig
        _renders += 1
        if _renders % COLLECT_EVERY == 0:
            gc.collect()
    return buffer.getvalue()


def _shade_untraced(ax: Axes, report: Report) -> bool:
    """Grey bands where the trace was paused (bounded trace): the line there joins what was recorded around it.
    True when it drew any (they carry a legend label)."""
    trace = report.trace
    if trace is None or trace.complete or not trace.windows:
        return False
    edges = [0.0] + [x for window in trace.windows for x in window] + [report.wall_s]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b - a > 0.01 * max(report.wall_s, 1e-9)]
    for i, (a, b) in enumerate(gaps):
        ax.axvspan(a, b, color=INK, alpha=0.12, linewidth=0, label="not traced" if i == 0 else None)
    return bool(gaps)


def _other_allocators(report: Report) -> list[tuple[str, list[list[float]]]]:
    """The trace's allocators other than the main one that have a series of their own: (name, [[t, bytes], ...])."""
    if report.trace is None or not report.trace.timeline:
        return []
    return [(a.name, a.timeline) for a in report.trace.allocators[1:] if len(a.timeline) >= 2]


def timeline_png(report: Report) -> bytes | None:
    """TF live bytes (top) and process RSS with the budget (bottom) over the cell's time; None without data."""
    fig = timeline_figure(report)
    return None if fig is None else _png(fig)


def timeline_figure(report: Report) -> Figure | None:
    """The timeline as a matplotlib Figure (see timeline_png); None without data. A trace's other allocators are
    thinner lines labelled with their names, and the main device's allocator limit (a GPU's budget) a dashed line.
    Without process memory samples (a saved trace) there is only the TF row."""
    tf_points = report.trace.timeline if report.trace is not None and report.trace.timeline else []
    tf_label = "TF live bytes (trace)"
    series_device = report.main_device_name
    if not tf_points:
        sampled = report.sampled_device
        tf_points = sampled[1].samples if sampled is not None else []
        tf_label = f"TF live bytes (sampled, {sampled[0]})" if sampled is not None else "TF live bytes (sampled)"
        series_device = sampled[0] if sampled is not None else None
    rss_points = report.rss.samples
    has_tf, has_rss = len(tf_points) >= MIN_POINTS, len(rss_points) >= MIN_POINTS
    if not (has_tf or has_rss):
        return None
    rows = int(has_tf) + int(has_rss)
    fig, axes = _figure(8.6, 1.9 * rows + 0.4, rows)
    if has_tf:
        ax = axes[0]
        others = _other_allocators(report)
        limit = report.device_budget  # (device, its allocator's limit): drawn when the series is that device's
        limit = limit if limit is not None and limit[0] == series_device else None
        t = [p[0] for p in tf_points]
        scale, unit = _unit(
            max(
                [p[1] for p in tf_points]
                + [p[1] for _, series in others for p in series]
                + ([limit[1]] if limit else [])
            )
        )
        y = [p[1] / scale for p in tf_points]
        ax.fill_between(t, y, step="post", color=TF_COLOR, alpha=0.18, linewidth=0)
        main_label = (
            (report.trace.allocator or report.main_device_name) if others and report.trace is not None else None
        )
        ax.step(t, y, where="post", color=TF_COLOR, linewidth=1.3, label=main_label)
        for k, (name, series) in enumerate(others):
            ax.step(
                [p[0] for p in series],
                [p[1] / scale for p in series],
                where="post",
                linewidth=0.8,
                color=ALLOCATOR_COLORS[k % len(ALLOCATOR_COLORS)],
                label=name,
            )
        if limit:
            ax.axhline(
                limit[1] / scale,
                color=BUDGET_COLOR,
                linestyle="--",
                linewidth=1,
                label=f"{limit[0]} limit {format_bytes(limit[1])}",
            )
        peak_t = (
            report.trace.peak_time_s
            if report.trace is not None and report.trace.events
            else t[max(range(len(y)), key=y.__getitem__)]
        )
        peak_y = max(y)
        ax.plot([peak_t], [peak_y], marker="v", color=BUDGET_COLOR, markersize=7)
        ax.annotate(
            f"peak {format_bytes(peak_y * scale)}",
            (peak_t, peak_y),
            textcoords="offset points",
            xytext=(6, -2),
            color=INK,
            fontsize=8,
            va="top",
        )
        ax.set_ylabel(f"{tf_label}\n{unit}", color=INK, fontsize=8)
        ax.set_ylim(bottom=0)
        if _shade_untraced(ax, report) or others or limit:  # the legend of a CPU cell's trace stays where it was
            ax.legend(loc="best" if others or limit else "upper left", fontsize=7, frameon=False, labelcolor=INK)
    ax = axes[-1]
    if has_rss:
        t = [p[0] for p in rss_points]
        top = max(max(p[1] for p in rss_points), report.rss.peak_bytes)
        budget = report.env.budget_bytes
        show_budget = budget > 0 and report.rss.peak_bytes >= 0.5 * budget
        scale, unit = _unit(max(top, budget) if show_budget else top)
        ax.plot(t, [p[1] / scale for p in rss_points], color=RSS_COLOR, linewidth=1.3)
        if show_budget:
            ax.axhline(budget / scale, color=BUDGET_COLOR, linestyle="--", linewidth=1)
            ax.annotate(
                f"budget {format_bytes(budget)}",
                (t[0], budget / scale),
                textcoords="offset points",
                xytext=(2, 3),
                color=BUDGET_COLOR,
                fontsize=8,
            )
        else:
            share = report.rss.peak_bytes / budget if budget else 0
            ax.set_title(f"budget {format_bytes(budget)}: peak used {share:.0%}", color=INK, fontsize=8, loc="right")
        ax.set_ylabel(f"process RSS\n{unit}", color=INK, fontsize=8)
    ax.set_xlabel("seconds since the cell started", color=INK, fontsize=8)
    return fig


def breakdown_png(groups: Sequence[LiveGroup], key: str, limit: int = 12) -> bytes | None:
    """Horizontal bars of the largest groups (by `key`: phase, layer or op); None when there is nothing."""
    rows = [g for g in groups if g.bytes > 0][:limit]
    if not rows:
        return None
    labels = [str(getattr(g, key) or "(none)") for g in rows][::-1]
    values = [g.bytes for g in rows][::-1]
    colors = [PHASE_COLORS.get(g.phase or "", TF_COLOR) if key == "phase" else TF_COLOR for g in rows][::-1]
    scale, unit = _unit(max(values))
    fig, (ax,) = _figure(6.4, 0.32 * len(rows) + 0.6)
    bars = ax.barh([label[:38] for label in labels], [v / scale for v in values], color=colors, height=0.62)
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(
            format_bytes(value),
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            textcoords="offset points",
            xytext=(4, 0),
            va="center",
            color=INK,
            fontsize=8,
        )
    ax.set_xlabel(unit, color=INK, fontsize=8)
    ax.grid(True, axis="x", alpha=0.2, color=INK)
    ax.grid(False, axis="y")
    ax.set_xlim(0, max(values) / scale * 1.22)
    return _png(fig)
