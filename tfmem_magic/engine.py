"""Measure a block of code: start the probes, run it, stop them and build the Report. No IPython in here.

    with tfmem_magic.profile(label="train") as p:
        model.fit(x, y, batch_size=64)
    print(p.report.tf_peak_bytes)
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from . import analysis, diagnose, environment, fixes, guard, modelinfo, prediction, xplane
from .instrument import Instrumentation
from .probes import AllocatorStats, RssSampler, main_tf_device
from .sizes import format_bytes
from .report import DeviceMemory, EnvInfo, ErrorInfo, GuardInfo, Report, RssInfo, TraceInfo
from .tracer import Tracer, user_profiler_running

MODES = ("trace", "quick")
# process memory the profiler itself takes per xplane byte it records, at its high-water mark (recorder + export;
# measured 22-27x on MLP, CNN, LSTM and GRU steps: tracer.py): the upper end, so it is never blamed on the user
PROFILER_RSS_PER_BYTE = 27
HISTORY_SIZE = 100


@dataclass(frozen=True)
class Options:
    mode: str = "trace"  # "trace" (profiler events: breakdown and timeline) or "quick" (stats and RSS only)
    label: str = ""
    interval_ms: float = 50.0  # RSS and TF sampling period; the RSS peak is exact regardless (VmHWM)
    limit_bytes: int | None = None  # the user's budget for this block (process memory)
    trace_steps: int = 10  # steps of each fit/evaluate/predict call that are traced
    trace_seconds: float = 20.0  # wall-time cap on tracing
    cell_key: str | None = None  # identifies re-runs of the same cell, for leak detection
    publish: bool = True  # False: a measurement of our own (calibration probes) stays out of history and last_report
    source: str | None = field(default=None, compare=False)  # the cell's code, for fix cells that rewrite it
    namespace: dict | None = field(default=None, compare=False, repr=False)  # the user's names for model and data

    def __post_init__(self) -> None:
        from .errors import TfmemUsageError

        if self.mode not in MODES:
            raise TfmemUsageError(f"unknown mode {self.mode!r}: use 'trace' or 'quick'")
        if not (1 <= self.interval_ms <= 60_000):
            raise TfmemUsageError(f"--interval {self.interval_ms:g} ms is out of range: use 1 to 60000 ms")
        if self.trace_steps < 1:
            raise TfmemUsageError(f"--trace-steps {self.trace_steps} must be at least 1")
        if self.trace_seconds <= 0:
            raise TfmemUsageError(f"--trace-seconds {self.trace_seconds:g} must be positive")


_last: Report | None = None
_published = 0  # reports published this session: each gets the next number
history: deque[Report] = deque(maxlen=HISTORY_SIZE)
# per cell key, what each run left behind (for the leak rule); bounded in keys and runs
runs: dict[str, deque[diagnose.RunSummary]] = {}
MAX_CELLS, RUNS_PER_CELL = 500, 20


def last_report() -> Report | None:
    """The report of the most recent profiled cell or block, or None."""
    return _last


def _status_of(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "ResourceExhaustedError":
        return "oom"
    return "error"


class Profiler:
    """One measurement. Use as a context manager, or call start() and finish(exc) around the code."""

    def __init__(self, options: Options | None = None, **kwargs: Any) -> None:
        self.options = replace(options or Options(), **kwargs)
        self.report: Report | None = None
        self.notes: list[str] = []
        self._tracer: Tracer | None = None
        self._instrumentation: Instrumentation | None = None
        self._sampler: RssSampler | None = None
        self._allocator = AllocatorStats()
        self._mode = self.options.mode
        self._guard: guard.Guard | None = None
        self._limit_and_source: tuple[int | None, str] = (None, "")
        self._t0 = 0.0
        self._wall0 = 0.0
        self._tf_running_at_start = False

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        clean = self.untangle(exc)
        self.finish(exc)
        if clean is not exc:  # the guard's own exception, not pybind11's tangle of two (see Guard.untangle)
            raise clean from None
        return False  # never swallow the user's exception

    def untangle(self, exc: BaseException | None) -> BaseException | None:
        """The exception the user should see for `exc` (the same one unless the guard's watchdog tangled it)."""
        return self._guard.untangle(exc) if self._guard is not None else exc

    # ---- start ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Arm every probe. All or nothing: if arming fails or is interrupted (Ctrl-C) part-way, what was armed is
        undone in reverse before the exception leaves, so no later cell finds a probe, patch or thread of this one
        (an allocator-stats slot left behind would make every later cell 'nested', in quick mode)."""
        try:
            self._arm()
        except BaseException:
            self._disarm_partial()
            raise

    def _disarm_partial(self) -> None:
        undo = [lambda: self._guard.disarm() if self._guard is not None else None,
                lambda: self._instrumentation.uninstall() if self._instrumentation is not None else None,
                lambda: self._sampler.stop() if self._sampler is not None else None,
                lambda: self._tracer.finish() if self._tracer is not None else None,
                self._allocator.stop]
        for step in undo:
            try:
                step()
            except Exception:  # undo the rest whatever one step says
                pass
        self._instrumentation = self._sampler = self._tracer = self._guard = None

    def _arm(self) -> None:
        nested = AllocatorStats.nesting_depth() > 0
        self._tf_running_at_start = environment.tensorflow_initialized()
        if not self._tf_running_at_start:
            environment.prepare_allocator()
        if self._mode == "trace":
            self._mode = self._trace_possible(nested)
        self._limit_and_source = limit, source = self._limit()
        if limit is not None:
            if self._mode == "quick":
                self._import_keras()  # a cell that imports Keras itself must still get the batch-end check
            # after the imports: the runtime's own memory is not the cell's growth
            self._guard = guard.Guard(limit, source, psutil.Process().memory_info().rss)
        self._wall0 = time.time()
        self._t0 = time.perf_counter()
        self._allocator.start()
        if self._mode == "trace":
            try:
                self._tracer = Tracer(self._t0, self.options.trace_seconds)
                self._tracer.start()
            except Exception as exc:  # the profiler refused (a profiler server), no temp folder could be made...
                self.notes.append(f"The TensorFlow profiler could not start ({type(exc).__name__}: {exc}); "
                                  "measured in quick mode.")
                if self._tracer is not None:
                    self._tracer.finish()
                self._tracer, self._mode = None, "quick"
        on_tick = self._tracer.observe if self._tracer is not None else None
        on_rss = self._guard.observe if self._guard is not None else None
        self._sampler = RssSampler(self.options.interval_ms / 1000, reset_hwm=not nested, on_tick=on_tick,
                                   on_rss=on_rss, tf_device=main_tf_device())
        self._sampler.start(self._t0)
        self._instrumentation = Instrumentation(self._tracer, self.options.trace_steps, guard=self._guard)
        self._instrumentation.install()

    @staticmethod
    def _import_keras() -> None:
        """Import TF and Keras now (not the allocator: no op runs), so that a cell which imports Keras itself still
        gets layer spans, bounded fit traces and the guard's batch-end check."""
        if sys.modules.get("keras") is not None or not environment.tensorflow_installed():
            return
        environment.note_tensorflow_import()
        try:
            import tensorflow  # noqa: F401
            import keras  # noqa: F401
        except ImportError:  # a broken install: the cell will say so itself
            pass

    def _limit(self) -> tuple[int | None, str]:
        """The cell's own --limit, else the session's %tfmem limit."""
        if self.options.limit_bytes is not None:
            return self.options.limit_bytes, "--limit"
        session = guard.session_limit()
        if session is not None:
            return session.bytes, "%tfmem limit"
        budget = environment.memory_budget()
        if budget.budget_source == "cgroup":  # a container would OOM-kill the kernel: guard it, and say so
            return budget.budget_bytes, "container limit"
        return None, ""

    def _trace_possible(self, nested: bool) -> str:
        if nested:
            self.notes.append("Nested inside another profiled block: measured in quick mode (no trace).")
            return "quick"
        if not environment.tensorflow_installed():
            self.notes.append("TensorFlow is not installed: only process memory (RSS) is measured.")
            return "quick"
        self._import_keras()

        if user_profiler_running():
            self.notes.append("A TensorFlow profiler session you started is running: measured in quick mode "
                              "(TF allows one session at a time). Stop it with tf.profiler.experimental.stop().")
            return "quick"
        return "trace"

    # ---- finish ---------------------------------------------------------------------------------------------
    def finish(self, exc: BaseException | None = None) -> Report:
        """Stop every probe (always), then build and publish the report."""
        global _last
        wall = time.perf_counter() - self._t0
        exc = self.untangle(exc)  # callers that show the exception untangle it too; the report must not depend on it
        if self._guard is not None:
            try:
                self._guard.disarm()
            except guard.MemoryLimitExceeded as late:  # the watchdog's exception arrived as the cell ended
                exc = exc or late
        segments: list[tuple[bytes, int]] = []
        try:
            if self._instrumentation is not None:
                self._instrumentation.uninstall()
            if self._tracer is not None:
                segments = self._tracer.finish()
        finally:
            assert self._sampler is not None, "finish() called before start()"
            rss_peak, rss_end, peak_source = self._sampler.stop()
            devices = self._allocator.stop()
        report = Report(label=self.options.label, status=_status_of(exc), mode=self._mode, wall_s=round(wall, 4),
                        started_at=self._wall0, notes=self.notes, number=self._number())
        if exc is not None:
            request = guard.parse_oom(str(exc)) if report.status == "oom" else None
            report.error = ErrorInfo(type(exc).__name__, str(exc), request)
        report.rss = RssInfo(self._sampler.baseline, rss_peak, rss_end, peak_source, self._sampler.samples)
        report.tf = {d: DeviceMemory(*v) for d, v in devices.items()}
        if self._sampler.tf_device in report.tf:
            report.tf[self._sampler.tf_device].samples = self._sampler.tf_samples
        report.env = self._env(rss_baseline=self._sampler.baseline)
        report.guard = self._guard_info(report)
        try:
            self._analyse(report, segments)
        except Exception as err:  # our bug must never hide the user's result or exception
            report.notes.append(f"tfmem_magic could not analyse this cell ({type(err).__name__}: {err}); "
                                "the numbers above are still valid. Please report it.")
        self.report = report
        if self.options.publish:
            _last = report
            history.append(report)
        return report

    def _number(self) -> int:
        global _published
        if not self.options.publish:
            return 0
        _published += 1
        return _published

    def _guard_info(self, report: Report) -> GuardInfo | None:
        g = self._guard
        if g is None:
            return None
        allocator = guard.allocator_limit_bytes()
        layers = (["allocator"] if allocator else []) + (["batch-end check"] if self._instrumentation and
                                                          self._instrumentation.installed else []) + ["watchdog"]
        tripped = g.tripped_by
        if tripped is None and report.error is not None and report.error.request is not None:
            tripped = "allocator"  # TensorFlow's own OOM error: its allocator refused the request
        return GuardInfo(g.limit, g.source, layers, allocator, tripped, g.tripped_rss or None)

    def _env(self, rss_baseline: int) -> EnvInfo:
        view = environment.allocator_view()
        limit, source = self._limit_and_source  # decided at start: the budget reads RAM and cgroup files
        user_limit = limit if source in ("--limit", "%tfmem limit") else None  # a container limit is not the user's
        budget = environment.memory_budget(user_limit, rss_now=rss_baseline)
        return EnvInfo(**environment.versions(), allocator=view.name, allocator_complete=view.complete,
                       allocator_note=view.note, devices=environment.tf_devices(),
                       ram_total_bytes=budget.ram_total_bytes, ram_available_bytes=budget.ram_available_bytes,
                       cgroup_limit_bytes=budget.cgroup_limit_bytes, budget_bytes=budget.budget_bytes,
                       budget_source=budget.budget_source,
                       mixed_precision_policy=environment.mixed_precision_policy(),
                       tensorflow_started_in_cell=not self._tf_running_at_start
                       and environment.tensorflow_initialized())

    def _analyse(self, report: Report, segments: list[tuple[bytes, int]]) -> None:
        instr = self._instrumentation
        use = None
        if instr is not None:
            uses = list(instr.models.values())
            use = modelinfo.main_use(uses, instr.applied)
            report.model = (modelinfo.describe(use, instr.new_variables, instr.built_optimizers, instr.applied,
                                               uses) if use is not None else None)
            report.tf_function_traces = instr.function_traces()
            report.notes.extend(instr.notes)
            if report.model is not None and self.options.publish:
                prediction.remember_model(report, use.model_ref(), use.target)
        if self._mode == "trace":
            report.trace = self._trace_info(segments, report, use)
        report.prediction = prediction.summary(report)
        previous = self._remember_run(report) if self.options.publish else []
        report.findings = diagnose.findings(report, previous)
        report.fixes = fixes.build(report, self._fix_context(report, use))

    def _fix_context(self, report: Report, use: Any) -> fixes.Context:
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
        return fixes.Context(source=self.options.source, model_name=model_name, array_names=arrays,
                             number=report.number)

    def _remember_run(self, report: Report) -> list[diagnose.RunSummary]:
        """Record this run under its cell key; returns the earlier runs of the same cell."""
        key = self.options.cell_key
        if key is None:
            return []
        report.cell_key = key
        if key not in runs and len(runs) >= MAX_CELLS:
            runs.pop(next(iter(runs)))
        series = runs.setdefault(key, deque(maxlen=RUNS_PER_CELL))
        previous = list(series)
        report.run = previous[-1].run + 1 if previous else 1
        series.append(diagnose.run_summary(report, self._instrumentation.new_models if self._instrumentation else 0))
        return previous

    def _trace_info(self, segments: list[tuple[bytes, int]], report: Report, use: Any) -> TraceInfo:
        instr = self._instrumentation
        assert instr is not None and self._tracer is not None
        ctx = analysis.Context(layer_names=set(instr.layer_names), input_array_bytes=set(instr.copy_roles),
                               copy_roles=dict(instr.copy_roles),
                               windows=list(self._tracer.windows),
                               batch_size=report.model.batch_size if report.model is not None else None,
                               weight_shapes=modelinfo.weight_shapes(use))
        ctx.optimizer_scopes |= instr.optimizer_names
        info = analysis.summarize(xplane.read_segments(segments), ctx)
        if info.allocator and info.allocator != report.env.allocator and report.env.allocator != "none":
            report.env.allocator = info.allocator
        info.windows = [[round(a, 4), round(b, 4)] for a, b in self._tracer.windows]
        info.profiler_bytes = int(self._tracer.traced_bytes)
        # the recorder's and the export's high-water mark follows the largest segment (the next one reuses what an
        # export frees), plus the decoded events kept
        info.profiler_rss_bytes = int(PROFILER_RSS_PER_BYTE * self._tracer.largest_segment_bytes
                                      + 0.4 * info.profiler_bytes)
        reasons = self._tracer.paused_reasons
        if reasons:
            info.complete = False
            info.note = "; ".join(reasons) + ". The allocator's peak still covers the whole cell."
        device = report.tf.get("CPU:0")
        if device is not None and info.events and not info.complete:
            gap = device.peak_bytes - info.peak_live_bytes
            if gap > max(0.01 * device.peak_bytes, 64 * 1024):
                info.note = (info.note or "") + (
                    f" The cell's peak ({format_bytes(device.peak_bytes)}) came outside the traced window; the "
                    f"breakdown shows the largest traced moment ({format_bytes(info.peak_live_bytes)})."
                    + (" The trace's memory budget was spent first: the what-if then predicts from the cell's own "
                       "peak (an upper bound)." if self._tracer.budget_spent else
                       " Raise --trace-steps or --trace-seconds to trace more."))
        return info


def profile(label: str = "", mode: str = "trace", **kwargs: Any) -> Profiler:
    """Measure the memory of a `with` block: `with profile() as p: ...`, then `p.report`."""
    return Profiler(Options(mode=mode, label=label, **kwargs))
