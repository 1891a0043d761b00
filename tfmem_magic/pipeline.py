"""The pipeline of one measurement: capture (measure) -> the measured report (analyze) -> advice (advise) -> the
session. No IPython in here.

    with tfmem_magic.profile(label="train") as p:
        model.fit(x, y, batch_size=64)
    print(p.report.tf_peak_bytes)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from tfmem_magic.advise import bases, calibration, diagnose, fixes, prediction, preflight
from tfmem_magic.analyze import build, saved_trace
from tfmem_magic.core.errors import MemoryLimitExceeded, TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.options import MODES, Mode, Options, OptionValue
from tfmem_magic.core.report import Report
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import guard
from tfmem_magic.measure.instrument import ModelUse
from tfmem_magic.measure.measurement import Measured, Measurement

if TYPE_CHECKING:  # imported where a cluster is asked for
    from tfmem_magic.analyze.cluster import ClusterView

_log = logging.getLogger(__name__)

__all__ = ["MODES", "Options", "Profiler", "analyze_xplane", "capture", "last_report", "profile"]  # + `history`


def last_report() -> Report | None:
    """The report of the most recent profiled cell or block, or None."""
    return SESSION.last


def __getattr__(name: str) -> deque[Report]:
    if name == "history":  # the session's reports, oldest first (read-only view kept for %tfmem and tests)
        return SESSION.history
    raise AttributeError(name)


class Profiler:
    """One measurement. Use as a context manager, or call start(), then finish(exc) after the code (with
    `user_code()` around it for the guard's watchdog)."""

    def __init__(self, options: Options | None = None, **kwargs: OptionValue) -> None:
        self.options = replace(options or Options(), **kwargs)
        self.report: Report | None = None
        # the trace's raw XSpaces, [(bytes, segment start in s)], when options.keep_xspaces (TensorBoard)
        self.xspaces: list[tuple[bytes, float]] = []
        self._preflight = preflight.Preflight()
        self._measurement = Measurement(self.options, self._preflight)

    @property
    def notes(self) -> list[str]:
        return self._measurement.notes

    def __enter__(self) -> Profiler:
        self.start()
        self.enter_user_code()  # the `with` body is the user's code
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        clean = self.untangle(exc)
        swallowed = self.swallowed_stop() if exc is None else None
        self.finish(exc or swallowed)
        if swallowed is not None:  # Ctrl-C that the block's code swallowed: the block still stops (interrupts.py)
            raise swallowed
        if clean is not exc:  # the guard's own exception, not pybind11's tangle of two (see Guard.untangle)
            assert clean is not None  # untangle gives None only for None
            raise clean from None
        return False  # never swallow the user's exception

    def untangle(self, exc: BaseException | None) -> BaseException | None:
        """The exception the user should see for `exc` (the same one unless the guard's watchdog tangled it)."""
        g = self._measurement.guard
        return g.untangle(exc) if g is not None else exc

    def start(self) -> None:
        """Arm every instrument, all or nothing (see measure.measurement)."""
        self._measurement.start()

    def enter_user_code(self) -> None:
        """The user's code starts now (finish() ends it): the guard's watchdog may raise from here on."""
        self._measurement.open_guard()

    def leave_user_code(self, ended: BaseException | None) -> None:
        """The user's code ended, with `ended` where it raised (its error is about to be shown): the guard's watchdog
        raises no more, so its exception cannot land in the display of that error (see Guard.close). Where it lands
        before the guard could cancel it, it is caught here and the guard closed with it: `ended` stands."""
        try:
            self._measurement.close_guard(ended)
        except MemoryLimitExceeded as late:
            self._measurement.close_guard(ended, late)

    def swallowed_stop(self) -> KeyboardInterrupt | None:
        """Call when the user's code ended without an error: the KeyboardInterrupt to end it with, if stop was pressed
        and the code it landed in swallowed it (see measure.interrupts)."""
        stops = self._measurement.stops
        return stops.swallowed() if stops is not None and stops.armed else None

    @contextlib.contextmanager
    def showing_error(self, exc: BaseException | None) -> Iterator[None]:
        """Around the display of the cell's error: further presses of stop are counted, not raised, so they cannot
        cut the display short (IPython would print a bare "KeyboardInterrupt" and no error output)."""
        stops = self._measurement.stops
        if stops is None or not stops.armed:
            yield
            return
        stops.seen(exc)
        with stops.absorbing():
            yield

    @contextlib.contextmanager
    def user_code(self) -> Iterator[None]:
        """Around the user's code: the only window in which the guard's watchdog may raise."""
        with self._measurement.user_code():
            yield

    def finish(self, exc: BaseException | None = None) -> Report:
        """Stop every instrument (always), then build, advise and publish the report."""
        try:
            self._measurement.close_guard(exc)
        except MemoryLimitExceeded as late:  # the watchdog's exception arrived as the cell ended
            exc = exc or late
            with contextlib.suppress(MemoryLimitExceeded):  # the report is built whatever lands
                self._measurement.close_guard(exc, late)  # the close it cut short
        exc = self.untangle(exc)  # callers that show the exception untangle it too; the report must not depend on it
        measured = self._measurement.stop()
        self.xspaces = measured.xspaces
        report = build.measured_report(measured, exc, SESSION.next_number() if self.options.publish else 0)
        self._add_preflight(report, measured)
        g = self._measurement.guard
        try:
            # under a limit, tfmem's own work in the kernel counts against it like the cell's (measure/guard.py)
            with guard.own_work_within(g.limit if g is not None else None) as watch:
                self._analyse_and_advise(report, measured)
                self._calibrate(report, watch)
        except guard.OwnWorkStopped:
            _keep_the_oom_finding(report)
            limit = format_bytes(g.limit) if g is not None else "?"
            report.notes.append(
                f"tfmem stopped its own work on this cell (the analysis or the calibration) as the process reached "
                f"the memory limit ({limit}): what it had not finished is missing; the memory figures above are "
                "complete."
            )
        except KeyboardInterrupt:  # Ctrl-C while we analyse: the user's code is done; skip our remaining work
            report.notes.append(
                "Interrupted while tfmem analysed the cell: the breakdown and advice are missing; "
                "the memory figures above are complete."
            )
        except Exception as err:  # noqa: BLE001 - our bug must never hide the user's result or exception
            fallback(_log, "the cell's analysis failed: the report keeps its measured numbers", err)
            report.notes.append(
                f"tfmem_magic could not analyse this cell ({type(err).__name__}: {err}); "
                "the numbers above are still valid. Please report it."
            )
        self.report = report
        if self.options.publish:
            SESSION.publish(report)
        return report

    def _add_preflight(self, report: Report, measured: Measured) -> None:
        """The cell's last pre-flight, and what it predicted against what the process reached; or, where the
        pre-flight was on and the cell trained in a loop of its own, that nothing checked that loop's steps."""
        checks = self._preflight
        report.notes.extend(checks.notes)
        loop = _unchecked_loop(measured) if not checks.results else ""
        if loop:
            watched = (
                "only the guard watched it, at each RSS sample, and it cannot stop a step inside TensorFlow's C++ call"
                if measured.guard is not None
                else "nothing watched it"
            )
            report.notes.append(
                "The pre-flight checks fit(), evaluate(), predict() and their *_on_batch calls before their first "
                f"step; this cell trained in a loop of its own ({loop}, outside fit), which it cannot run ahead of "
                f"time: {watched}. Run the "
                "loop's first steps at a small batch under %%tfmem, then use the what-if's largest batch that fits."
            )
        if not checks.results:
            return
        info = report.preflight = checks.results[-1]
        if info.verdict != "refused":
            reached = report.rss.peak_bytes
            how = preflight.how_predicted(info)
            report.notes.append(
                f"Pre-flight of {info.call}() at batch {info.batch_size} ({how}): predicted "
                f"~{format_bytes(info.predicted_rss_bytes)} for the process ({preflight.band_words(info)}) against "
                f"{format_bytes(info.threshold_bytes)} allowed; it reached {format_bytes(reached)}."
                + preflight.gpu_words(info)
            )

    def _analyse_and_advise(self, report: Report, m: Measured) -> None:
        use = build.add_analysis(report, m)
        context = self._fix_context(report, use)
        if report.model is not None and use is not None and self.options.publish:
            calibration.remember_model(report, use.model_ref(), use.structure, context)
        try:  # stored, so that a saved report predicts what the live one does (None: no model to predict from)
            report.whatif_basis = prediction.analytic_basis(report)
        except TfmemUsageError:
            report.whatif_basis = None
        if report.whatif_basis is not None:  # a call the pre-flight refused: the replay it made predicts
            report.whatif_basis = preflight.refused_basis(report, report.whatif_basis) or report.whatif_basis
        report.prediction = prediction.summary(report)
        previous = self._remember_run(report, m) if self.options.publish else []
        report.findings = diagnose.findings(report, previous)
        report.fixes = fixes.build(report, context)

    def _calibrate(self, report: Report, watch: guard.OwnWorkWatch | None = None) -> None:
        """The what-if calibrated before the report is shown, so its panel, its saved copy and its fixes stand on the
        step replay where the replay's self-check passes: with --calibrate or `%tfmem calibrate on` for every cell
        with a Keras model, with `auto` (the default) for a report that names the largest batch that fits. Where
        calibration cannot run, the analytic basis stays and a note says why."""
        mode = SESSION.calibrate if self.options.calibrate is None else "on" if self.options.calibrate else "off"
        if mode == "off" or report.whatif_basis is None or not self.options.publish:
            return  # nothing to calibrate (no Keras model), or a measurement of our own
        if mode == "auto":
            auto = calibration.auto_calibration(report)
            if auto is None:
                return
            go, why = auto
            if not go:
                report.notes.append(f"Calibration (auto) did not run: {why}. The what-if stays analytic.")
                return
            asked = f"auto: {why}; %tfmem calibrate off or calibrate=False skips it"
        else:
            asked = "--calibrate" if self.options.calibrate else "%tfmem calibrate on"
        if SESSION.measuring:  # a block inside a measured cell: its probes would be counted in the outer one
            report.notes.append(
                f"Calibration ({asked}) did not run: this block is inside another measurement, "
                "which its probe processes would be counted in; the what-if stays analytic."
            )
            return
        if report.status not in ("ok", "oom", "refused"):
            report.notes.append(
                f"Calibration ({asked}) did not run: the cell ended {report.status}, so its "
                "step was not measured; the what-if stays analytic."
            )
            return
        if bases.anchored_on_preflight(report.whatif_basis):
            report.notes.append(
                f"Calibration ({asked}) did not run: the what-if stands on the pre-flight's replay "
                "of the call it refused already (nothing of the call ran to anchor probes on)."
            )
            return
        needed = calibration.kernel_bytes(report)
        if watch is not None and needed is not None and watch.room() < needed:
            report.notes.append(
                f"Calibration ({asked}) did not run: it works in the kernel too (~{format_bytes(needed)} for "
                f"this model), and the process has {format_bytes(max(0, watch.room()))} left under the memory "
                f"limit ({format_bytes(watch.limit)}); the what-if stays analytic."
            )
            return
        said = f"; {asked}" if mode == "auto" else ""
        print(f"tfmem: calibrating the what-if (probe processes replay the step{said})...", flush=True)
        started = time.perf_counter()
        try:
            basis = calibration.measured_basis(report)
        except TfmemUsageError as exc:
            report.notes.append(f"Calibration ({asked}) did not run: {exc}")
            return
        except guard.OwnWorkStopped:  # the kernel reached the user's limit while it calibrated
            limit = format_bytes(watch.limit) if watch is not None else "?"
            report.notes.append(
                f"tfmem stopped its own work on this cell: the calibration ({asked}) brought the process to the "
                f"memory limit ({limit}); the what-if stays analytic."
            )
        except KeyboardInterrupt:  # stop pressed while the probes ran: the cell's own report is complete
            report.notes.append(f"Calibration ({asked}) was stopped: the what-if stays analytic.")
            return
        except Exception as exc:  # noqa: BLE001 - our bug must not cost the cell its report
            fallback(_log, "calibration failed: the what-if stays analytic", exc)
            report.notes.append(
                f"Calibration ({asked}) failed ({type(exc).__name__}: {str(exc)[:200]}); the "
                "what-if stays analytic. Please report it."
            )
            return
        took = time.perf_counter() - started
        replay = basis.replay
        how = (
            "the step replay"
            if basis.name == "replay"
            else f"the probes' parts (the step replay could not be used: {replay.why_not})"
            if replay is not None
            else "the probes' parts"
        )
        report.notes.append(f"Calibrated as the cell ended ({asked}, {took:.0f} s): the what-if stands on {how}.")

    def _fix_context(self, report: Report, use: ModelUse | None) -> fixes.FixContext:
        """What the fix writer needs beyond the report: the cell's code and the user's names for model and data."""
        model_name, arrays = None, None
        ns = self.options.namespace
        if ns is not None and use is not None:
            public: dict[int, str] = {}  # id(value) -> the first name bound to it; private names only as fallback
            private: dict[int, str] = {}
            for name, value in list(ns.items()):  # one pass over the namespace
                if name.isidentifier():
                    (private if name.startswith("_") else public).setdefault(id(value), name)
            model = use.model_ref()
            if model is not None:
                model_name = public.get(id(model)) or private.get(id(model))
            arrays = {}
            for a in use.training_arrays:  # "" for an expression; None for several arrays (a dict of inputs)
                arrays[a.role] = None if a.role in arrays else (public.get(a.id) or private.get(a.id) or "")
        return fixes.FixContext(
            source=self.options.source, model_name=model_name, array_names=arrays, number=report.number
        )

    def _remember_run(self, report: Report, m: Measured) -> list[diagnose.RunSummary]:
        """Record this run under its cell key; returns the earlier runs of the same cell."""
        key = self.options.cell_key
        if key is None:
            return []
        report.cell_key = key
        previous = SESSION.runs_of(key)
        report.run = previous[-1].run + 1 if previous else 1
        new_models = m.instrumentation.new_models if m.instrumentation else 0
        SESSION.add_run(key, diagnose.run_summary(report, new_models))
        return previous


def _keep_the_oom_finding(report: Report) -> None:
    """A cell stopped for memory keeps its oom finding (what stopped it, and that the kernel and its variables live)
    where tfmem's own work was stopped at the limit before the findings: a cell that ends holding what reached the
    limit stops that work at once. Its words cost nothing against the limit."""
    if not report.stopped_for_memory or any(f.id == "oom" for f in report.findings):
        return
    try:
        finding = diagnose.out_of_memory(report)
    except Exception as err:  # noqa: BLE001 - the report keeps its measured numbers and its note
        fallback(_log, "the out-of-memory finding could not be made", err)
        return
    if finding is not None:
        report.findings.insert(0, finding)


def profile(label: str = "", mode: Mode = "trace", **kwargs: OptionValue) -> Profiler:
    """Measure the memory of a `with` block: `with profile() as p: ...`, then `p.report`."""
    return Profiler(Options(mode=mode, label=label, **kwargs))


def capture(
    workers: str | list[str], seconds: float = 2.0, logdir: str | os.PathLike[str] | None = None
) -> ClusterView:
    """Trace every worker of a training job (each started with `tfmem_magic.serve(PORT)`) for `seconds`, all at
    once, and return the cluster view: one report per worker, side by side (`tfmem_magic.analyze.cluster`)."""
    from tfmem_magic.analyze import cluster
    from tfmem_magic.core.errors import TfmemUsageError
    from tfmem_magic.measure import remote

    rows = []
    for part in remote.trace_workers(remote.parse_workers(workers), seconds, logdir):
        if part.peaks is not None:  # a worker that must not be traced served its peaks
            rows.append(cluster.WorkerRow(part.worker, cluster.peaks_report(part.peaks, part.worker)))
            continue
        if part.path is None:
            rows.append(cluster.WorkerRow(part.worker, None, part.error))
            continue
        try:
            rows.append(cluster.WorkerRow(part.worker, analyze_xplane(part.path, label=part.worker)))
        except TfmemUsageError as exc:  # a trace without memory events: the worker's allocator was not set up
            rows.append(
                cluster.WorkerRow(
                    part.worker,
                    None,
                    f"{exc} (start the worker with tfmem_magic.serve(PORT) before TensorFlow's first op)",
                )
            )
    return cluster.cluster_view(rows)


def cluster_from(folder: str | os.PathLike[str]) -> ClusterView:
    """The cluster view of the reports and traces the workers saved in one folder (`%tfmem cluster DIR`); their
    traces get findings and fixes as `analyze_xplane` gives them."""
    from tfmem_magic.analyze import cluster

    return cluster.from_directory(folder, read_trace=analyze_xplane)


def analyze_xplane(
    path: str | os.PathLike[str], device: str | None = None, label: str | None = None, batch_size: int | None = None
) -> Report:
    """The report of a trace recorded elsewhere (a `.xplane.pb`, e.g. from a GPU machine or TensorBoard's
    `plugins/profile/<run>/`), with its findings and fixes; `device` ("GPU:1") picks the allocator, by default the
    busiest GPU's. Where the trace's own sequence replays, `tfmem_magic.predict(report, batch_size=...)` predicts
    that device's peak at another batch from it (`batch_size`: the batch its step ran, per replica; by default read
    from the tensors' shapes). It is not added to this session's history."""
    if batch_size is not None and batch_size < 1:
        raise TfmemUsageError(
            f"batch_size={batch_size}: give the batch one step of the trace's device ran (per "
            "replica), 1 or more; or leave it out to read it from the tensors' shapes"
        )
    report = saved_trace.bare_report(path, device, label, batch_size)
    report.prediction = prediction.summary(report)
    if report.whatif_basis is not None:
        report.notes.append(prediction.trace_whatif_note(report))
    report.findings = diagnose.findings(report)
    report.fixes = fixes.build(report, fixes.FixContext())
    return report


def _unchecked_loop(measured: Measured) -> str:
    """The optimizer update ("Adam.apply()") of a custom training loop in a cell the pre-flight was on for, or "":
    an update seen outside fit/evaluate/predict, where the cell called none of them (fit's own update, run on a
    distribution strategy's replica thread, reads as outside)."""
    instr = measured.instrumentation
    if instr is None or instr.preflight is None or not instr.custom_loop:
        return ""
    if any(set(use.calls) - {"__call__"} for use in instr.models.values()):
        return ""
    return instr.custom_loop
