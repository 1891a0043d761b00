"""Several workers of one training job side by side: which one peaks highest, when, on what, and how uneven they
are. Built from one report per worker (a capture's traces, or reports the workers saved themselves)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import DeviceMemory, EnvInfo, Report, RssInfo
from tfmem_magic.core.sizes import format_bytes

IMBALANCE = 1.25  # the worst worker's peak over the median worker's that is called an imbalance


@dataclass
class WorkerRow:
    worker: str
    report: Report | None
    error: str | None = None

    @property
    def device(self) -> str | None:
        return self.report.main_device_name if self.report is not None else None

    @property
    def peak_bytes(self) -> int | None:
        mem = self.report.main_device if self.report is not None else None
        return mem.peak_bytes if mem is not None else None

    @property
    def growth_bytes(self) -> int | None:
        return self.report.tf_peak_bytes if self.report is not None else None

    @property
    def dominant(self) -> str | None:
        """What held the most of the worker's own bytes at its peak: a layer, else an op, with its phase."""
        trace = self.report.trace if self.report is not None else None
        if trace is None:
            return None
        own = [g for g in trace.at_peak if g.phase not in ("pre-existing",)]
        if not own:
            return None
        top = max(own, key=lambda g: g.bytes)
        return " · ".join(x for x in (top.layer, top.op) if x) + f" ({top.phase})"


@dataclass
class ClusterView:
    rows: list[WorkerRow]
    findings: list[str] = field(default_factory=list)

    @property
    def measured(self) -> list[WorkerRow]:
        return [r for r in self.rows if r.report is not None and r.peak_bytes is not None]

    @property
    def worst(self) -> WorkerRow | None:
        return max(self.measured, key=lambda r: r.peak_bytes or 0, default=None)


def cluster_view(rows: list[WorkerRow]) -> ClusterView:
    """The workers side by side, with what stands out: the worst worker and an imbalance between workers."""
    view = ClusterView(rows)
    failed = [r for r in rows if r.report is None]
    for row in failed:
        view.findings.append(f"{row.worker}: no report ({row.error or 'nothing captured'}); the others are shown.")
    for row in rows:
        if row.report is not None and row.peak_bytes is None:
            view.findings.append(
                f"{row.worker}: no TensorFlow allocator figures (TensorFlow had not started there, or its allocator "
                f"keeps no statistics); its process peaked at {format_bytes(row.report.rss.peak_bytes)}."
            )
    measured = view.measured
    for row in measured:
        env = row.report.env if row.report is not None else None
        if env is not None and env.partial_allocator:
            view.findings.append(
                f"{row.worker}: a partial view: its CPU allocator ({env.allocator}) {env.allocator_misses}, so its "
                "peak is a lower bound and comparisons with the other workers are unfair. Start it with "
                "tfmem_magic.serve(PORT) (or tfmem_magic.prepare() where it saves its own reports) before "
                "TensorFlow's first op: both switch to BFC."
            )
    if len(measured) >= 2:
        # by the peak (what runs out), which counts what a worker held before the capture too: the chief's
        # checkpoint buffers or a parameter server's variables are an imbalance as much as a larger batch shard
        middle = statistics.median(r.peak_bytes or 0 for r in measured)
        worst = view.worst
        assert worst is not None
        if middle > 0 and (worst.peak_bytes or 0) > IMBALANCE * middle:
            grown = worst.growth_bytes or 0
            view.findings.append(
                f"Imbalance: {worst.worker} peaked at {format_bytes(worst.peak_bytes or 0)}, "
                f"{(worst.peak_bytes or 0) / middle:.1f}x the median worker ({format_bytes(int(middle))}): "
                f"{format_bytes(grown)} made while it was traced, {format_bytes((worst.peak_bytes or 0) - grown)} "
                f"held before; at its peak: {worst.dominant or 'see its report'}. A larger shard of the batch or "
                "the chief's checkpoints and summaries make one worker heavier, and the job's batch must fit that "
                "worker; a parameter server holds its share of the variables and their optimizer updates, which "
                "the batch size does not change."
            )
    for row in measured:
        budget = row.report.device_budget if row.report is not None else None
        if budget is not None and (row.peak_bytes or 0) >= 0.9 * budget[1]:
            view.findings.append(f"{row.worker} used {(row.peak_bytes or 0) / budget[1]:.0%} of {budget[0]}'s memory.")
    return view


def peaks_report(peaks: dict[str, Any], worker: str) -> Report:
    """The report of a worker that served its peaks instead of a trace (measure/remote.window_peaks: a
    MultiWorkerMirroredStrategy worker other than the chief): TensorFlow's allocator and the process over the
    capture's window, as a quick cell reports them; no breakdown."""
    device = peaks.get("device")
    tf = {}
    if device and peaks.get("tf_peak_bytes") is not None:
        start = int(peaks.get("tf_start_bytes") or 0)
        tf[str(device)] = DeviceMemory(start, int(peaks["tf_peak_bytes"]), int(peaks.get("tf_end_bytes") or start))
    role = peaks.get("role") or "a worker that serves no traces"
    return Report(
        label=worker,
        mode="quick",
        wall_s=float(peaks.get("seconds") or 0.0),
        env=EnvInfo(tensorflow=peaks.get("tensorflow"), devices=list(tf)),
        rss=RssInfo(
            int(peaks.get("rss_start_bytes") or 0),
            int(peaks.get("rss_peak_bytes") or 0),
            int(peaks.get("rss_end_bytes") or 0),
            str(peaks.get("rss_peak_source") or "sampled"),
        ),
        tf=tf,
        notes=[
            f"Peaks only: this is {role}, which tfmem does not trace (TensorFlow's profiler can crash such a "
            "worker when a capture ends: docs/capture-safety.md). Its allocator's and process's peaks over the "
            "capture's window were read without the profiler: no breakdown by op or layer."
            + ("" if tf else " TensorFlow kept no allocator statistics there, or had not started yet.")
        ],
        started_at=float(peaks.get("started_at") or 0.0),
    )


def from_directory(folder: str | os.PathLike[str], read_trace: Callable[[Path], Report] | None = None) -> ClusterView:
    """The cluster view of the reports the workers saved in one (shared) folder: `*.json` reports (one per worker,
    e.g. `tfmem run --save DIR/worker0.json`, MemoryMonitor(save=...)) and `*.xplane.pb` traces; the worker is the
    file's name. `read_trace` makes a trace's report (the pipeline's adds findings and fixes, which this layer
    cannot); by default the bare report of `saved_trace.bare_report`."""
    from tfmem_magic.analyze import saved_trace

    read = read_trace or saved_trace.bare_report
    path = Path(folder)
    if not path.is_dir():
        raise TfmemUsageError(f"{path} is not a folder of worker reports")
    rows = []
    for file in sorted(path.iterdir()):
        name = file.name
        if name.endswith(".json"):
            try:
                data = json.loads(file.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("tfmem.report"):
                continue  # another file in the folder (a callback's epoch figures, a config)
            rows.append(WorkerRow(name[: -len(".json")], Report.from_dict(data)))
        elif name.endswith(saved_trace.SUFFIXES):
            worker = name.split(".xplane.pb")[0]
            try:
                rows.append(WorkerRow(worker, read(file)))
            except TfmemUsageError as exc:
                rows.append(WorkerRow(worker, None, str(exc)))
    if not rows:
        raise TfmemUsageError(f"{path} holds no worker reports (*.json saved by tfmem, or *.xplane.pb traces)")
    return cluster_view(rows)
