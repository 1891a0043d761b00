"""A report as TensorBoard reads it: scalars over the cell's time, the text report, and the trace's raw XSpace where
TensorBoard's profile plugin (xprof) finds it, so its memory_profile and trace_viewer tools open our CPU trace.

    LOGDIR/<run>/events.out.tfevents...                       scalars (TF live bytes, RSS) and the text report
    LOGDIR/<run>/plugins/profile/<session>/<host>.xplane.pb   the trace, one "host" per traced segment

`<run>` is the report's label (or "cell-N") and a timestamp, so re-runs sit side by side. TensorBoard and its
summary API are imported only here, when asked.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Report, file_stem, main_device_name
from tfmem_magic.core.sizes import format_bytes

MiB = float(2**20)


@dataclass
class Written:
    """What `write` put in the logdir."""

    run_dir: Path
    events: list[Path] = field(default_factory=list)
    xplanes: list[Path] = field(default_factory=list)
    note: str | None = None  # what could not be written, in plain words


def require_tensorboard() -> None:
    """TensorBoard's summary API is what writes scalars TensorBoard reads; without it, say how to get it."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise TfmemUsageError(
            "--tensorboard needs TensorBoard: pip install tensorboard xprof (xprof adds the "
            "Profile tab that opens the trace), or pip install 'tfmem_magic[tensorboard]'"
        ) from None


def run_name(report: Report, when: float | None = None) -> str:
    base = file_stem(report.label or (f"cell-{report.number}" if report.number else "tfmem"), "tfmem", limit=60)
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when or report.started_at or time.time()))}"


def write(
    report: Report, logdir: str | Path, xspaces: list[tuple[bytes, float]] | None = None, host: str | None = None
) -> Written:
    """Write the report's timeline and text, and the trace's XSpaces (from `Profiler.xspaces`, or a saved trace's
    bytes) if there are any. `host` names the trace in the Profile tab (default: this machine's name).

    A function over the report, as `render_text` and `predict` are, not a `Report` method: the Report is the core's
    plain data, and the core imports nothing above it (tests/unit/test_layers.py); it does not keep the raw trace
    either (up to the trace budget per report, for as long as the session keeps it), so the XSpaces are passed."""
    require_tensorboard()
    import tensorflow as tf

    base = Path(logdir).expanduser() / run_name(report)
    run_dir, n = base, 1
    while run_dir.exists():  # the same label within a second, or the same saved report written twice
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    run_dir.mkdir(parents=True)
    out = Written(run_dir)
    writer = tf.summary.create_file_writer(str(run_dir))
    try:
        with writer.as_default():
            _scalars(report)
            from tfmem_magic.show.render import render_text

            # TensorBoard's text plugin renders markdown: a code block keeps the report's columns
            tf.summary.text("tfmem/report", "```\n" + render_text(report) + "\n```", step=0)
        writer.flush()
    finally:
        writer.close()
    out.events = sorted(run_dir.glob("events.out.tfevents*"))
    if xspaces:
        session = run_dir / "plugins" / "profile" / time.strftime("%Y_%m_%d_%H_%M_%S")
        session.mkdir(parents=True, exist_ok=True)
        # no dots: the host is the file name before ".xplane.pb"
        host = file_stem(host or socket.gethostname(), "host").replace(".", "_")
        for i, (data, _start) in enumerate(xspaces, 1):
            # one XSpace per profiler session: each traced segment is its own "host" in the profile plugin
            path = session / (f"{host}.xplane.pb" if len(xspaces) == 1 else f"{host}_segment{i}.xplane.pb")
            path.write_bytes(data)
            out.xplanes.append(path)
    elif report.mode != "trace" or report.trace is None:
        out.note = "quick mode: no trace, so TensorBoard gets the scalars and the text report only"
    elif xspaces is None:
        out.note = (
            "the trace's XSpace was not kept (a saved report holds the analysis, not the raw trace): "
            "measure with --tensorboard (in Python: profile(keep_xspaces=True), then "
            "to_tensorboard(p.report, LOGDIR, p.xspaces)) to have TensorBoard's Profile tab open it"
        )
    else:
        out.note = (
            "no trace segment was kept: measure with --tensorboard (or profile(keep_xspaces=True)) to have "
            "TensorBoard's Profile tab open the trace"
        )
    return out


def _scalars(report: Report) -> None:
    """Live bytes over the cell's time (step = milliseconds from its start), in MiB: TensorBoard's time series."""
    import tensorflow as tf

    name = main_device_name(report.tf)
    device = report.tf.get(name) if name is not None else None
    sampled = report.sampled_device
    if sampled is not None:
        for t, live in sampled[1].samples:
            tf.summary.scalar(f"tfmem/tf_live_MiB/{sampled[0]}", live / MiB, step=int(t * 1000))
    if device is not None:
        tf.summary.scalar(f"tfmem/tf_peak_MiB/{name}", (device.peak_bytes - device.baseline_bytes) / MiB, step=0)
    for t, rss in report.rss.samples:
        tf.summary.scalar("tfmem/rss_MiB", rss / MiB, step=int(t * 1000))
    tf.summary.scalar("tfmem/rss_peak_MiB", (report.rss.peak_bytes - report.rss.baseline_bytes) / MiB, step=0)
    if report.trace is not None:
        for t, live in report.trace.timeline:
            tf.summary.scalar("tfmem/traced_live_MiB", live / MiB, step=int(t * 1000))


def summary_line(written: Written) -> str:
    parts = [f"TensorBoard: {written.run_dir}"]
    if written.xplanes:
        size = sum(p.stat().st_size for p in written.xplanes)
        parts.append(f"trace for the Profile tab: {len(written.xplanes)} XSpace file(s), {format_bytes(size)}")
    if written.note:
        parts.append(written.note)
    return " · ".join(parts) + f"  (tensorboard --logdir {written.run_dir.parent})"
