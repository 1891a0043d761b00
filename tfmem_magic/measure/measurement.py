"""One cell's measurement as a transaction: every instrument is armed through one undo stack and unwound in reverse
on any exit, so that no instrument, patch, thread, profiler session or temp folder outlives the cell.

    measurement = Measurement(options)
    measurement.start()            # all or nothing: a failure or Ctrl-C part-way undoes what was armed
    with measurement.user_code():  # the guard's watchdog may interrupt only in here
        ...the user's code...
    measured = measurement.stop()  # never raises; what could not be stopped cleanly is said in measured.notes

No IPython here, and nothing that analyses or advises: the analyze layer turns a `Measured` into a report.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.options import Options
from tfmem_magic.core.report import HeldInfo
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.types import KerasModel
from tfmem_magic.measure import (
    capabilities,
    environment,
    guard,
    holders,
    kerases,
    release,
    remote,
    step_counters,
    xplane,
)
from tfmem_magic.measure.eager_ops import EagerOps
from tfmem_magic.measure.instrument import Instrumentation, ModelUse
from tfmem_magic.measure.interrupts import StopLatch
from tfmem_magic.measure.sampling import AllocatorStats, RssSampler, main_tf_device, memory_info
from tfmem_magic.measure.tracer import Tracer, user_profiler_running

_log = logging.getLogger(__name__)

# runs of an undo step that Ctrl-C may cut short before tfmem gives up on it (steps are safe to run again; a user
# pressing stop over and over is not kept waiting for ever)
UNDO_ATTEMPTS = 3
GC_BEFORE_SCAN_BYTES = 2**20  # variables alive but named by nothing, worth a garbage collection before the scan
# What a collection could not clear: the unnamed bytes found right after the last one (a model kept alive by an object
# no name reaches: a test framework's frames, a closure, another module). Only unnamed bytes that moved from it are
# worth the next collection: without it every cell collected (a full collection of a large heap: 0.7 s per
# `--quick` cell in a long pytest process, 191 s for the leak test's 264 cells in CI).
_settled_unnamed = 0


@dataclass
class Measured:
    """What one cell's instruments recorded, before any analysis."""

    options: Options
    mode: str
    notes: list[str]
    started_at: float  # wall clock
    wall_s: float
    rss_baseline: int
    rss_peak: int
    rss_end: int
    rss_peak_source: str
    rss_samples: list[list[float]]
    tf_device: str | None  # the device whose live bytes were sampled
    tf_samples: list[list[float]]
    devices: dict[str, tuple[int, int, int]]  # device -> (baseline, peak, end)
    peak_before: dict[str, int]  # device -> TF's peak counter before this cell reset it
    limit: int | None
    limit_source: str
    tf_running_at_start: bool
    guard: guard.Guard | None = None
    instrumentation: Instrumentation | None = None
    tracer: Tracer | None = None
    eager_ops: EagerOps | None = None  # the eager ops run while the trace recorded, with their lines
    segments: list[tuple[bytes | xplane.Decoded, int]] = field(default_factory=list)  # xplane.read_segments' input
    # [(XSpace bytes, start s)] when options.keep_xspaces
    xspaces: list[tuple[bytes, float]] = field(default_factory=list)
    held: HeldInfo | None = None  # who holds TensorFlow memory at the end (the allocator's numbers come later)


class Measurement:
    """The instruments of one measurement, armed and disarmed as one transaction."""

    def __init__(self, options: Options, preflight: Callable[..., Any] | None = None) -> None:
        self.options = options
        # the pipeline's pre-flight: (model, call, use, threshold, rss, source, tf_current, tf_held) -> None, or
        # raises PreflightRefused (see _preflight_check)
        self._preflight = preflight
        self.mode = options.mode
        self.notes: list[str] = []
        self.guard: guard.Guard | None = None
        self.tracer: Tracer | None = None
        self.eager_ops: EagerOps | None = None
        self.sampler: RssSampler | None = None
        self.instrumentation: Instrumentation | None = None
        self.stops: StopLatch | None = None  # the cell's stop presses (not armed when nested: the outer one has it)
        self.allocator = AllocatorStats()
        self._undo: list[tuple[str, Callable[[], Any]]] = []  # (what, how to undo it), in arming order
        self._limit: tuple[int | None, str] = (None, "")
        self._t0 = 0.0
        self._wall0 = 0.0
        self._tf_running_at_start = False
        self._stopped = False
        self._names_before: dict[str, int] = {}  # the namespace at the start: name -> id of its value
        self._runtime_at_start = 0  # what only TensorFlow's gradient registry held at the start
        self._step_counters: list[step_counters.Counter] = []  # the namespace's optimizers' steps at the start

    # ---- arming ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Arm every instrument. All or nothing: if arming fails or is interrupted part-way (Ctrl-C, a full disk),
        what was armed is undone in reverse before the exception leaves, so no later cell finds an instrument, patch or
        thread of this one (an allocator-stats slot left behind would make every later cell 'nested')."""
        _end_abandoned()  # a callback's measurement whose fit raised: it ends before this one starts
        try:
            self._arm()
        except BaseException:
            self._unwind()
            raise

    def _push(self, what: str, undo: Callable[[], Any]) -> None:
        self._undo.append((what, undo))

    def _arm(self) -> None:
        nested = AllocatorStats.nesting_depth() > 0
        self._tf_running_at_start = environment.tensorflow_initialized()
        if not self._tf_running_at_start:
            environment.prepare_allocator()  # a process-wide setting TF reads at its first op: kept on purpose
        if self.mode == "trace":
            self.mode = self._trace_possible(nested)
        self._limit = limit, source = self._choose_limit()
        if limit is not None:
            if self.mode == "quick":
                _import_keras()  # a cell that imports Keras itself must still get the batch-end check
            # after the imports: the runtime's own memory is not the cell's growth. Closed until user_code().
            self.guard = guard.Guard(limit, source, psutil.Process().memory_info().rss)
            self._push("guard", self.guard.close)
        ns = self.options.namespace or {}
        self._names_before = {name: id(value) for name, value in list(ns.items())}
        self._runtime_at_start = self._runtime_pinned_now() if self._tf_running_at_start else 0
        self._wall0 = time.time()
        self._t0 = time.perf_counter()
        self._push("allocator stats", self.allocator.stop)
        self.allocator.start()
        if self.mode == "trace":
            self._arm_tracer()
        if self.tracer is not None:
            self._arm_eager_ops(self.tracer)
        on_tick = self.tracer.observe if self.tracer is not None else None
        on_rss = self.guard.observe if self.guard is not None else None
        self.sampler = RssSampler(
            self.options.interval_ms / 1000,
            reset_hwm=not nested,
            on_tick=on_tick,
            on_rss=on_rss,
            tf_device=main_tf_device(),
        )
        self._push("sampler", self.sampler.stop)
        self.sampler.start(self._t0)
        if not nested:
            latch = StopLatch()
            if latch.arm():
                self.stops = latch
                self._push("stop latch", latch.disarm)
        self.instrumentation = Instrumentation(
            self.tracer,
            self.options.trace_steps,
            guard=self.guard,
            stops=self.stops,
            preflight=self._preflight_check(),
            t0=self._t0,
        )
        self._push("Keras patches", self.instrumentation.uninstall)
        self.instrumentation.install()
        if self.instrumentation.preflight is not None:  # a loop of a traced tf.function calls no Python update
            self._step_counters = step_counters.read(ns)

    def _arm_tracer(self) -> None:
        try:
            self.tracer = Tracer(self._t0, self.options.trace_seconds, keep_xspaces=self.options.keep_xspaces)
            self._push("profiler", self.tracer.finish)
            self.tracer.start()
        except Exception as exc:  # noqa: BLE001 - the profiler refused (another session), no temp folder could be made...
            fallback(_log, "the trace could not start: the cell is measured in quick mode", exc)
            served = remote.serving_port()
            why = (
                f" This process serves captures on port {served} (tfmem_magic.serve): a capture from outside was "
                "probably tracing it; TensorFlow allows one profiler session per process."
                if served
                else ""
            )
            self.notes.append(
                f"The TensorFlow profiler could not start ({type(exc).__name__}: {exc}); measured in quick mode.{why}"
            )
            if self.tracer is not None:
                self._undo.pop()
                _quietly(self.tracer.finish)
            self.tracer, self.mode = None, "quick"

    def _arm_eager_ops(self, tracer: Tracer) -> None:
        """The op callback that notes each eager op's line while the trace records (eager_ops.py). Without it the
        report's eager ops are grouped as eager, unnamed; the rest of the trace stands."""
        if not capabilities.check().get("lines of eager ops", False):
            return
        recorder = EagerOps(tracer)
        try:
            self._push("op callback", recorder.stop)
            recorder.start()
        except Exception as exc:  # noqa: BLE001 - a TensorFlow without op callbacks: eager ops stay unnamed
            fallback(_log, "the eager-op callback could not be added: eager ops are not named by line", exc)
            self._undo.pop()
            _quietly(recorder.stop)
            return
        self.eager_ops = recorder

    def _preflight_check(self) -> Callable[[KerasModel, str, ModelUse], None] | None:
        """The pre-flight for this cell's calls, or None: asked for (--preflight), or on by default when the user set
        a limit and TensorFlow's allocator is not capped (TensorFlow was running before the limit: nothing else
        stops one step that outgrows the limit, as one step is one C++ call)."""
        wanted = self.options.preflight
        guard_ = self.guard
        if self._preflight is None or wanted is False:
            return None
        if wanted is None and not (
            guard_ is not None
            and guard_.source in ("--limit", "%tfmem limit")
            and self._tf_running_at_start
            and guard.allocator_limit_bytes() is None
        ):
            return None
        hook = self._preflight
        wants = getattr(hook, "wants", None)  # asked first: a *_on_batch loop comes here at every step
        armed = getattr(hook, "armed", None)  # told now: it may start what its checks will need
        if armed is not None:
            armed()

        def check(model: KerasModel, call: str, use: ModelUse) -> None:
            if wants is not None and not wants(model, call, use):
                return
            rss = psutil.Process().memory_info().rss
            if guard_ is not None:
                threshold, source = guard_.threshold, guard_.source
            else:  # --preflight without a limit: what the machine has
                threshold, source = environment.memory_budget(rss_now=rss).budget_bytes, "the memory available"
            # TF's allocator keeps its regions (RSS never shrinks): what it held at its peak so far can be reused
            device = main_tf_device()
            info = memory_info(device) if device is not None else None
            current = info["current"] if info else 0
            held = max(
                SESSION.tf_peak_most.get(device or "", 0),
                self.allocator.peak_before.get(device or "", 0),
                info["peak"] if info else 0,
                current,
            )
            hook(model, call, use, threshold, rss, source, current, held)

        return check

    def _choose_limit(self) -> tuple[int | None, str]:
        """The cell's own --limit, else the session's %tfmem limit, else a container's limit."""
        if self.options.limit_bytes is not None:
            guard.check_reachable(self.options.limit_bytes, "--limit", margin=guard.MARGIN)
            return self.options.limit_bytes, "--limit"
        session = guard.session_limit()
        if session is not None:
            guard.check_reachable(session.bytes, "%tfmem limit", margin=0)
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
        _import_keras()
        if user_profiler_running():
            self.notes.append(
                "A TensorFlow profiler session you started is running: measured in quick mode "
                "(TF allows one session at a time). Stop it with tf.profiler.experimental.stop()."
            )
            return "quick"
        return "trace"

    # ---- the user's code ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def user_code(self) -> Iterator[None]:
        """The window in which the guard's watchdog may raise into this thread: the user's code, nothing of ours."""
        self.open_guard()
        ended: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            ended = exc
            raise
        finally:
            self.close_guard(ended)

    def open_guard(self) -> None:
        if self.guard is not None:
            self.guard.open()

    def close_guard(self, ended: BaseException | None = None, late: BaseException | None = None) -> None:
        """The user's code ended (with `ended`, where known): see Guard.close."""
        if self.guard is not None:
            self.guard.close(ended, late)

    # ---- disarming ------------------------------------------------------------------------------------------
    def _unwind(self) -> dict[str, Any]:
        """Undo everything armed, newest first, whatever each step raises (Ctrl-C included): returns each step's
        result by name, and notes what could not be undone cleanly."""
        results: dict[str, Any] = {}
        interrupted, abandoned = False, False
        while self._undo:
            what, undo = self._undo.pop()
            for attempt in range(1, UNDO_ATTEMPTS + 1):  # an interrupt can cut a run of an undo step anywhere
                try:
                    results[what] = undo()
                    break
                except KeyboardInterrupt:  # keep unwinding: a half-disarmed cell is worse than a late interrupt
                    interrupted = True
                    if attempt == UNDO_ATTEMPTS:
                        abandoned = True
                        self.notes.append(
                            f"Interrupted {UNDO_ATTEMPTS} times while stopping the {what}: it may "
                            "still run; its figures are missing."
                        )
                except Exception as exc:  # noqa: BLE001 - e.g. the trace export on a full disk
                    fallback(_log, "stopping an instrument failed: its figures are missing", exc)
                    self.notes.append(
                        f"Stopping the {what} failed ({type(exc).__name__}: {exc}); its figures "
                        "are missing, the rest of the report stands."
                    )
                    break
        if interrupted and not abandoned:
            self.notes.append(
                "Interrupted while tfmem stopped its instruments: they were stopped all the same, "
                "and nothing of tfmem was left running."
            )
        return results

    def stop(self) -> Measured:
        """Stop every instrument (always; never raises) and return what was measured."""
        assert not self._stopped, "stop() called twice"
        self._stopped = True
        wall = time.perf_counter() - self._t0
        # a callback's measurement started inside this one whose fit raised is inner: it ends first, so its undo
        # steps (Keras patches, its allocator slot) unwind before ours and fold its peak into ours
        _end_abandoned()
        results = self._unwind()
        rss_peak, rss_end, peak_source = results.get("sampler") or _rss_now()
        sampler = self.sampler
        limit, source = self._limit
        if sampler is not None:
            self.notes.extend(sampler.errors)
        if self.stops is not None:
            self.notes.extend(self.stops.notes())
        self.notes.extend(capabilities.notes())  # a private API this TensorFlow or Keras moved: what degrades
        held = self._who_holds()
        instr = self.instrumentation
        if instr is not None and instr.preflight is not None and not instr.custom_loop and self._step_counters:
            moved = step_counters.advanced(self._step_counters)
            if moved:  # no update passed through Python: a tf.function traced before the cell ran them
                instr.custom_loop = f"{moved} in a tf.function traced before the cell, by its step counter"
        return Measured(
            options=self.options,
            mode=self.mode,
            notes=self.notes,
            started_at=self._wall0,
            wall_s=round(wall, 4),
            rss_baseline=sampler.baseline if sampler else rss_end,
            rss_peak=rss_peak,
            rss_end=rss_end,
            rss_peak_source=peak_source,
            rss_samples=sampler.samples if sampler else [],
            tf_device=sampler.tf_device if sampler else None,
            tf_samples=sampler.tf_samples if sampler else [],
            devices=results.get("allocator stats") or {},
            peak_before=dict(self.allocator.peak_before),
            limit=limit,
            limit_source=source,
            tf_running_at_start=self._tf_running_at_start,
            guard=self.guard,
            instrumentation=self.instrumentation,
            tracer=self.tracer,
            eager_ops=self.eager_ops,
            segments=results.get("profiler") or [],
            xspaces=self.tracer.xspaces if self.tracer is not None else [],
            held=held,
        )

    @staticmethod
    def _runtime_pinned_now() -> int:
        """What only TensorFlow's gradient registry holds now (~1 ms): the cell is blamed only for what it adds."""
        if not capabilities.check().get("gradient registry"):
            return 0
        try:
            return release.registry_pinned().bytes
        except Exception as exc:  # noqa: BLE001 - the registry is private; its reading is optional
            fallback(_log, "the gradient registry's bytes could not be read: taken as 0", exc)
            return 0

    def _changed_names(self) -> set[str]:
        """Names the cell bound or rebound (a tensor under one of them was made by the cell)."""
        ns = self.options.namespace or {}
        return {name for name, value in list(ns.items()) if self._names_before.get(name) != id(value)}

    def _collected_if_dropped(self, pinned: release.Pinned, handles: set[int]) -> release.Pinned:
        """A model the cell dropped is often in a reference cycle the collector has not reached yet: it is gone for
        the user, and its memory is the registry's from the next collection on. So collect (~50 ms in a small
        process, more in a large heap) and scan again, but only when the unnamed bytes moved from what the last
        collection left (`_settled_unnamed`): what no collection clears is not worth one every cell. A fall counts
        too: what was kept went away, and what is unnamed now may be a model just dropped."""
        global _settled_unnamed
        unnamed = pinned.unnamed_bytes
        if abs(unnamed - _settled_unnamed) < GC_BEFORE_SCAN_BYTES or self.options.namespace is None:
            return pinned
        gc.collect()
        pinned = release.registry_pinned(handles)
        _settled_unnamed = pinned.unnamed_bytes
        return pinned

    def _who_holds(self) -> HeldInfo | None:
        """The names that still reach TensorFlow memory at the cell's end, and what only TensorFlow's gradient
        registry keeps (measure/holders.py, release.registry_pinned). None when TensorFlow has not run."""
        if not environment.tensorflow_initialized():
            return None
        instr = self.instrumentation

        def made_here(obj: object) -> bool:  # a variable or an optimizer the cell created
            return instr is not None and (obj in instr.new_variables or obj in instr.built_optimizers)

        try:
            found = holders.walk(self.options.namespace, made_here, self._changed_names())
            pinned = (
                release.registry_pinned(found.handles)
                if capabilities.check().get("gradient registry")
                else release.Pinned(readable=False)
            )
            pinned = self._collected_if_dropped(pinned, found.handles)
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - never cost the user's cell: the report says what is missing
            fallback(_log, "the walk of who holds TensorFlow's memory failed", exc)
            self.notes.append(f"Could not tell who holds TensorFlow's memory ({type(exc).__name__}: {exc}).")
            return None
        grown = max(0, pinned.bytes - (self._runtime_at_start or 0))
        return HeldInfo(
            holders=found.holders,
            runtime_bytes=pinned.bytes,
            runtime_entries=pinned.entries,
            runtime_new_bytes=grown,
            complete=found.complete,
        )


def _rss_now() -> tuple[int, int, str]:
    rss = psutil.Process().memory_info().rss
    return rss, rss, "sampled"


def _end_abandoned() -> None:
    """Finish the measurements a Keras callback started and whose call raised (SESSION.abandoned), newest first."""
    while SESSION.abandoned:
        _quietly(SESSION.abandoned.pop())


def _quietly(step: Callable[[], Any]) -> None:
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - an abandoned measurement's undo must not stop the others
        fallback(_log, "an abandoned measurement could not be finished", exc)
        pass


def _import_keras() -> None:
    """Import TF and the Keras `tf.keras` is now (not the allocator: no op runs), so that a cell which imports Keras
    itself still gets layer spans, bounded fit traces and the guard's batch-end check."""
    if not environment.tensorflow_installed() or kerases.module(kerases.in_use()) is not None:
        return
    environment.note_tensorflow_import()
    try:
        import tensorflow  # noqa: F401

        kerases.import_flavour(kerases.in_use())
    except ImportError:  # a broken install: the cell will say so itself
        pass
