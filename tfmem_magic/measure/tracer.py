"""The TensorFlow profiler, driven in segments so that long cells stay cheap to trace.

A segment is one profiler session. Two rules pause it, each holding the trace until it lets go:
- "steps": the Keras instrumentation pauses after the first steps of each `fit`/`evaluate`/`predict` call and lets
  go at the next call;
- "plateau": fed by the sampler thread, it pauses when TF's peak has not grown for `PLATEAU_S` and lets go when the
  peak grows again. A steady loop repeats the moment already traced; the trace exists to explain the peak.
A timer stops tracing for good after `max_seconds`, and at most MAX_SEGMENTS windows are traced.

The profiler's own memory. TensorFlow's recorder keeps every TraceMe event of every thread until the session stops
(4.2-4.8 malloc'd bytes per byte of the xplane it will write, more in RSS as per-thread arenas fragment), and the
export builds the XSpace and its serialized copy on top: the process's high-water mark grows by 22-27 bytes per
xplane byte of the largest segment (the next segment reuses much of what one export frees; malloc_trim gives
the rest back, see TRIM_AT_BYTES). The event rate depends on the
model far more than on its size: an MLP or CNN step writes 20-90 kB, an LSTM over 120 time steps fed by
`timeseries_dataset_from_array` writes ~3.4 MB per step (70k events: its while loop's ops, tf.data's per-element
iterator events, thread-pool events, 13k memory events) and a bidirectional GRU ~5 MB, so ten traced steps cost
~900 MB. Only ~20% of those events are the memory events we read, and no option reachable from Python records fewer
of the others (see `_start_segment`). So each cell gets a budget of `budget_bytes` of xplane. A watcher thread
estimates the running segment's size from the growth of malloc'd bytes (glibc's mallinfo2) and of RSS not explained
by TF's allocator, and stops the segment when the estimate nears what is left of the budget. The export then gives
the exact size: a segment stopped early by the cell's own growth (a first step builds graphs and oneDNN caches) is
restarted; once the budget is spent the trace stops for good and the report says so. Exported segments are decoded
at once when they are large (xplane.Decoded keeps 81 bytes per memory event, ~0.3 bytes per xplane byte, not the
blob), and each temporary folder is deleted at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.measure import environment, xplane

_log = logging.getLogger(__name__)

PS_PER_S = 10**12
PLATEAU_S = 1.0
MAX_SEGMENTS = 12  # windows: segments started at the cell's start or when a pause ends
MiB = 1024 * 1024
# The profiler's high-water mark is ~22-27x the xplane of its *largest segment* (3.4 MB, one LSTM step: +74 MB of
# RSS): the next segment reuses much of what an export freed (ten steps in 6 segments: +121 MB; as one: +898 MB).
# So a segment is capped at SEGMENT_BYTES (the transient cost), and the cell's total at TRACE_BUDGET_BYTES, which
# bounds what is kept (~0.3 bytes of decoded events per xplane byte) and the export time: enough for a recurrent
# model's first steps (an LSTM over 120 time steps writes ~3.4 MB per step) in rotated segments. MLP and CNN cells
# write a tenth of one segment in their 10 traced steps.
TRACE_BUDGET_BYTES = 12 * MiB
# the most one segment may record before it is exported (its transient cost, ~22-27x its size): small enough to keep a
# recurrent model's trace under the 100 MiB target, large enough not to restart for nothing (docs/overhead.md)
SEGMENT_BYTES = 2 * MiB
MIN_SEGMENT_BYTES = SEGMENT_BYTES // 4  # less budget than this left: stop rather than restart (a short
# segment adds a gap, its export, to the trace more than it adds events)
STOP_AT = 0.8  # stop when the estimate reaches this share of what is left: the watcher looks every WATCH_S
# What the recorder holds per xplane byte while it records: in malloc'd bytes (glibc's mallinfo2; measured 4.2-4.8
# on LSTM and GRU steps) and in RSS (8.7-13.5 on a first segment). Each misses something (see _estimate), so the
# watcher takes the larger; without mallinfo2 (macOS, musl) RSS and the rate of the previous segments.
HEAP_PER_TRACE_BYTE = 4
RSS_PER_TRACE_BYTE = 12
# a segment this large or larger is followed by glibc's malloc_trim: what the recorder and the export freed and the
# next segment does not reuse sits in per-thread arenas that the cell's own growth does not reuse either. It runs
# under the lock, as the export does (which takes far longer). It lowers a traced cell's peak and what it leaves behind
# (docs/overhead.md, Memory); smaller segments free too little to be worth the call.
TRIM_AT_BYTES = 256 * 1024
DECODE_AT_BYTES = 1 * MiB  # raw xplane held before it is decoded (small traces are decoded once, at the end)
WATCH_S = 0.025  # the watcher's period (mallinfo2 takes 0.4-1.5 ms)
# no segment is stopped for its size before this age: a young segment's growth is mostly the cell's own (a first op,
# oneDNN's caches), and each needless restart leaves a gap whose frees the trace misses. Short, because a recurrent
# model's steps can write ~80 MB/s: a longer age lets a segment grow far past SEGMENT_BYTES (docs/overhead.md).
MIN_SEGMENT_S = 0.05
MAX_ROTATIONS = 200  # segments stopped by the budget's estimate and restarted, per cell (each costs
# an export: ~1 ms when the growth that triggered it was the cell's own, not the recorder's)


# the profiler's own C++ INFO lines ("profiler_session.cc:... Profiler session started."), and nothing else
_PROFILER_LOG = re.compile(rb"^[IW]\d{4} [^\n]*(?:profiler|xplane|trace)[^\n]*\n?", re.IGNORECASE | re.MULTILINE)
TRACE_DIR_PREFIX = "tfmem-trace-"


@contextlib.contextmanager
def _profiler_logs_filtered(enabled: bool) -> Iterator[None]:
    """Keep the profiler's C++ INFO lines out of the notebook while it starts or stops (a few milliseconds).

    Only used when TF was imported before we could set TF_CPP_MIN_LOG_LEVEL. fd 2 is the whole process's, and this
    may run in a background thread: whatever else is written to it meanwhile (the user's own stderr) is kept in an
    in-memory file and passed on afterwards, only the profiler's lines are dropped. Without memfd_create (not
    Linux), nothing is filtered.
    """
    memfd = getattr(os, "memfd_create", None)
    if not enabled or memfd is None:
        yield
        return
    try:
        held = memfd("tfmem-stderr")
    except OSError:
        yield
        return
    saved = os.dup(2)
    try:
        os.dup2(held, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        try:
            os.lseek(held, 0, os.SEEK_SET)
            rest = _PROFILER_LOG.sub(b"", os.read(held, 1 << 20))
            if rest:
                os.write(2, rest)
        finally:
            os.close(held)


def remove_leftovers(directory: str | None = None) -> int:
    """Delete the trace folders of processes that no longer run (a killed kernel, a killed calibration probe): on a
    tmpfs they are memory. Returns how many were removed."""
    removed = 0
    root = Path(directory or tempfile.gettempdir())
    try:
        candidates = list(root.glob(f"{TRACE_DIR_PREFIX}*"))
    except OSError:
        return 0
    for path in candidates:
        pid = path.name[len(TRACE_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or psutil.pid_exists(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not path.exists()
    return removed


def user_profiler_running() -> bool:
    """True when someone else's `tf.profiler.experimental` session is active (ours never registers there). A
    TensorFlow that moved the module or its `_profiler` reads as "not running" (capabilities.py says so in the
    report): TensorFlow then refuses our session if one runs, and the cell falls back to quick mode with a note."""
    try:  # by name, as sys.modules has it (a package attribute left behind is not the module TensorFlow uses)
        profiler_v2 = importlib.import_module("tensorflow.python.profiler.profiler_v2")
        return getattr(profiler_v2, "_profiler", None) is not None  # private: see capabilities.py
    except (ImportError, AttributeError):
        return False


class _Int(int):
    """An int that TF 2.21's `ProfilerSession.start` passes on as an int.

    Its binding turns the options dict into `std::variant<bool, int, std::string>` trying `cast<bool>()` first, and
    pybind11's bool cast accepts anything with `__bool__`: every Python number arrives as a bool, and the session
    manager ignores it ("host_tracer_level expects an i value", `i` being int's type name). An int whose `__bool__`
    raises fails that cast and is then read as the int it is.
    """

    def __bool__(self) -> bool:
        raise TypeError("a profiler level, not a truth value")


def _format_mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_reader() -> Callable[[], int] | None:
    """A function returning the bytes malloc has handed out and not taken back (mmapped blocks aside): glibc's
    mallinfo2, which sums every thread's arena. None where there is no such call (macOS, musl, old glibc)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except Exception as exc:  # noqa: BLE001 - OSError, AttributeError; TypeError on Windows (no handle for the process itself)
        fallback(_log, "glibc's mallinfo2 is not available: the heap is not read", exc)
        return None
    mallinfo2.restype = _Mallinfo2
    mallinfo2.argtypes = []
    return lambda: int(mallinfo2().uordblks)


def _heap_trimmer() -> Callable[[], None] | None:
    """A function giving the free pages of every malloc arena back to the system: glibc's malloc_trim(0). The
    recorder's events and the export's copies are malloc'd on many threads, so what an export frees stays in RSS
    as free chunks of per-thread arenas that the cell's later growth does not reuse. None without glibc."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except Exception as exc:  # noqa: BLE001 - OSError, AttributeError; TypeError on Windows
        fallback(_log, "glibc's malloc_trim is not available: the heap is not trimmed", exc)
        return None
    malloc_trim.restype = ctypes.c_int
    malloc_trim.argtypes = [ctypes.c_size_t]

    def trim() -> None:
        malloc_trim(0)

    return trim


class Tracer:
    def __init__(
        self, t0: float, max_seconds: float = 20.0, budget_bytes: int | None = None, keep_xspaces: bool = False
    ) -> None:
        """`budget_bytes`: xplane bytes the trace may record (None: TRACE_BUDGET_BYTES; 0: no budget, for
        benchmarks of full traces). `max_seconds` <= 0: no time cap. `keep_xspaces`: keep every segment's exported
        XSpace as written (`xspaces`), for TensorBoard; it costs their size (the budget bounds it)."""
        self.keep_xspaces = keep_xspaces
        self.xspaces: list[tuple[bytes, float]] = []  # (serialized XSpace, segment start in s from t0)
        self._t0 = t0
        self.max_seconds = max_seconds
        self.budget_bytes = TRACE_BUDGET_BYTES if budget_bytes is None else budget_bytes
        self._lock = threading.RLock()
        self._dir = Path(tempfile.mkdtemp(prefix=f"{TRACE_DIR_PREFIX}{os.getpid()}-"))  # whose it is, if one is left
        self._session: Any = None  # the running _pywrap_profiler.ProfilerSession
        # the running segment's index in `windows` (its window is appended when it stops); -1 while none records.
        # Read without the lock by the eager-op callback (measure/eager_ops.py), on the cell's thread
        self.recording = -1
        self._segment_start = 0.0
        self._count = 0  # segments made (folder names)
        self._windows_started = 0  # segments started at the start or after a pause (MAX_SEGMENTS)
        self._rotations = 0
        self._raw: list[tuple[bytes, int]] = []  # (xplane bytes, start offset in ps from t0), not decoded yet
        self._raw_bytes = 0
        self._decoded: xplane.Decoded | None = None
        self.traced_bytes = 0  # xplane bytes of all segments so far
        # the profiler's high-water mark follows its largest segment (~22-27 bytes of RSS per xplane byte), not the
        # sum: the next segment's recorder reuses much of what one export frees
        self.largest_segment_bytes = 0
        self.budget_spent = False
        self.windows: list[tuple[float, float]] = []  # (start, end) of each segment, seconds from t0
        self.paused_reasons: list[str] = []
        self.closed = False  # no more segments: time cap or budget reached, or finished
        self._holds: set[str] = set()
        self._steps_seen = False  # step boundaries are reported (see step_boundary)
        self._plateau_due = False
        self._peak_seen = 0
        self._grew_at = 0.0
        self._tf_current = 0  # TF's live bytes, from the sampler (0 when it does not sample TF)
        self._rate = 0.0  # xplane bytes per second of the last segment long enough to measure
        self._segment_rss = 0
        self._segment_tf = 0
        self._segment_heap = 0
        self._process = psutil.Process()
        self._heap = _heap_reader() if self.budget_bytes else None
        self._trim = _heap_trimmer()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._quiet = not environment.profiler_logs_quiet()

    # ---- public ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first segment; raises if another profiler session is active."""
        xplane._lazy_space_class()  # builds a message class (imports protobuf): here, not in the watcher thread
        self._windows_started += 1
        self._start_segment()
        self._started_at = time.perf_counter()
        if self.max_seconds > 0 or self.budget_bytes:
            self._watcher = threading.Thread(target=self._watch, name="tfmem-trace-watch", daemon=True)
            self._watcher.start()

    @property
    def running(self) -> bool:
        return self._session is not None

    @property
    def segments(self) -> list[tuple[bytes | xplane.Decoded, int]]:
        """What was traced: raw xplane blobs with their offsets, and the decoded part (offset 0), for
        `xplane.read_segments`."""
        out: list[tuple[bytes | xplane.Decoded, int]] = list(self._raw)
        if self._decoded is not None:
            out.append((self._decoded, 0))
        return out

    def hold(self, rule: str, reason: str) -> None:
        """Pause the trace until `rule` lets go (see release)."""
        with self._lock:
            self._holds.add(rule)
            if self._session is not None:
                self._stop_segment()
                if reason not in self.paused_reasons:
                    self.paused_reasons.append(reason)

    def release(self, rule: str) -> None:
        """`rule` no longer needs the trace paused; it resumes if no other rule holds it."""
        with self._lock:
            self._holds.discard(rule)
            if self._holds or self._session is not None or self.closed:
                return
            if self._windows_started >= MAX_SEGMENTS:
                self.closed = True
                self.paused_reasons.append(f"the trace stopped after {MAX_SEGMENTS} segments")
                return
            self._windows_started += 1
            self._restart()

    def observe(self, t: float, current: int, peak: int) -> None:
        """Sampler tick with TF's allocator figures: the plateau rule."""
        self._tf_current = current
        if peak > self._peak_seen:
            self._peak_seen, self._grew_at = peak, t
            self._plateau_due = False
            if "plateau" in self._holds:
                self.release("plateau")
        elif t - self._grew_at >= PLATEAU_S and "plateau" not in self._holds and self._session is not None:
            if self._steps_seen:
                self._plateau_due = True  # pause at the end of the running step, never inside it
            else:
                self._plateau_hold()

    def steps_begin(self) -> None:
        """Keras' steps are about to run: the plateau rule waits for step ends from the first step on."""
        self._steps_seen = True

    def step_boundary(self) -> None:
        """A training step ended (a Keras batch end, or an optimizer's apply in a custom loop). Once steps are known,
        the plateau rule pauses only here: a step longer than PLATEAU_S whose peak is still to come (its backward
        pass) is traced whole, not cut in the middle."""
        self._steps_seen = True
        if self._plateau_due:
            self._plateau_due = False
            if "plateau" not in self._holds and self._session is not None:
                self._plateau_hold()

    def _plateau_hold(self) -> None:
        self.hold(
            "plateau",
            f"traced while TensorFlow's memory climbed, paused while its peak stayed flat for {PLATEAU_S:g} s",
        )

    def finish(self) -> list[tuple[bytes | xplane.Decoded, int]]:
        """Stop everything (watcher, segment), delete the temp folder; returns the segments."""
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        trimmed = False
        with self._lock:
            self.closed = True
            if self._session is not None:
                trimmed = self._stop_segment()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._trim is not None and self.traced_bytes and not trimmed:
            self._trim()  # the last export's free chunks (a segment paused earlier): not left after the cell
        return self.segments

    # ---- internals ------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """The watcher thread: the time cap, the budget, and decoding what was exported. Its failure ends the trace
        with the reason (never silently: the report says why the trace is short)."""
        try:
            while not self._watch_stop.wait(WATCH_S):
                if not self._watch_once():
                    return
                self._decode_raw(DECODE_AT_BYTES)
        except Exception as exc:  # noqa: BLE001 - the watcher thread must end the trace, never the process
            fallback(_log, "the trace's watcher failed: the trace stopped", exc)
            with self._lock:
                self._close(f"the trace stopped: its watcher failed ({type(exc).__name__}: {exc})")
                if self._session is not None:
                    self._stop_segment()

    def _watch_once(self) -> bool:
        """Stop the running segment before its estimated size passes what is left; False when the trace is over."""
        with self._lock:
            if self.closed:
                return False
            now = time.perf_counter()
            if self.max_seconds > 0 and now - self._started_at >= self.max_seconds:
                self._time_up()
                return False
            if self._session is None or not self.budget_bytes:
                return True
            # stop with a margin: the recorder keeps growing until the next look, and until the stop
            if now - self._segment_start < MIN_SEGMENT_S:
                return True  # a young segment's growth is the cell's own (a first op, oneDNN's caches), not events
            if self._estimate(now) >= STOP_AT * min(SEGMENT_BYTES, self.budget_bytes - self.traced_bytes):
                self._stop_segment()
                self._rotations += 1
                if self._rotations > MAX_ROTATIONS:
                    self._close(f"the trace stopped after {MAX_ROTATIONS} restarts")
                else:
                    self._restart()
            return True

    def _estimate(self, now: float) -> float:
        """Bytes of xplane the running segment would export now. Upper-leaning: the cell's own growth counts too,
        and costs a restart, not the trace. Each signal misses something: malloc'd bytes are net of what the cell
        frees meanwhile (a first step frees its graph compilation's temporaries), RSS does not grow while the
        recorder reuses what an earlier segment freed, and the rate changes from phase to phase."""
        rss, heap = self._memory_now()
        growth = rss - self._segment_rss - max(self._tf_current - self._segment_tf, 0)
        estimate = growth / RSS_PER_TRACE_BYTE
        if self._heap is not None:
            return max(estimate, (heap - self._segment_heap) / HEAP_PER_TRACE_BYTE)
        return max(estimate, self._rate * (now - self._segment_start))

    def _restart(self) -> None:
        """Start the next segment if the budget allows one worth having; else stop for good and say why."""
        if self.closed:
            return
        if self.budget_bytes and self.budget_bytes - self.traced_bytes < MIN_SEGMENT_BYTES:
            self.budget_spent = True
            self._close(
                f"the trace stopped after {_format_mib(self.traced_bytes)} of profiler events, to keep the "
                f"profiler's own memory small (TensorFlow holds over 20 bytes per byte of trace while it "
                f"records and exports)"
            )
            return
        try:
            self._start_segment()
        except Exception as exc:  # noqa: BLE001 - someone else's session took the profiler: stay paused
            fallback(_log, "the profiler could not be restarted: the trace stays paused", exc)
            self.closed = True

    def _close(self, reason: str) -> None:
        self.closed = True
        if reason not in self.paused_reasons:
            self.paused_reasons.append(reason)

    def _time_up(self) -> None:
        with self._lock:
            if self.closed:
                return
            if self._session is not None:
                self._stop_segment()
                self.paused_reasons.append(f"the trace stopped after {self.max_seconds:g} s")
            self.closed = True

    def _start_segment(self) -> None:
        from tensorflow.python.profiler.internal import _pywrap_profiler

        self._count += 1
        logdir = self._dir / f"s{self._count}"
        session_class = getattr(_pywrap_profiler, "ProfilerSession", None)  # private: see capabilities.py
        if session_class is None:  # the cell is measured in quick mode (measurement.py), the report says why
            raise RuntimeError("this TensorFlow has no _pywrap_profiler.ProfilerSession (see %tfmem status)")
        session = session_class()
        # The defaults, said explicitly (see _Int for why a plain int would be ignored). Host level 2 is the lowest
        # that records memory events: the allocators emit them at TraceMeLevel::kInfo (2), and level 1 keeps only
        # thread-pool and tf.data events (checked on TF 2.21: 0 memory events). Python tracing stays off; the
        # device tracer (CUPTI kernels on a GPU) writes events we never read, and the GPU allocators' memory
        # events are host events, so it is turned off.
        options = {"host_tracer_level": _Int(2), "python_tracer_level": _Int(0), "device_tracer_level": _Int(0)}
        self._segment_rss, self._segment_heap = self._memory_now()
        self._segment_tf = self._tf_current
        with _profiler_logs_filtered(self._quiet):
            self._segment_start = time.perf_counter()
            try:
                session.start(str(logdir), options)
            except TypeError:  # a binding that takes options differently: the defaults are what we asked for
                session.start(str(logdir), {})
        self._session = session
        self.recording = len(self.windows)

    def _stop_segment(self) -> bool:
        """Stop and export the running segment. Never raises: it runs in Keras callbacks (the user's fit) and in the
        watcher thread; an export that fails (a full or read-only temp folder) ends the trace, with the reason.
        Returns whether it trimmed the heap after the export (then `finish` need not again)."""
        self.recording = -1
        session, self._session = self._session, None
        end = time.perf_counter()
        self.windows.append((self._segment_start - self._t0, end - self._t0))
        size = 0
        try:
            with _profiler_logs_filtered(self._quiet):
                session.export_to_tb()
            del session
            for path in sorted(self._dir.glob(f"s{self._count}/**/*.xplane.pb")):
                offset_ps = int((self._segment_start - self._t0) * PS_PER_S)
                data = path.read_bytes()
                size += len(data)
                if self.keep_xspaces:
                    self.xspaces.append((data, self._segment_start - self._t0))
                self._raw.append((data, offset_ps))
                self._raw_bytes += len(data)
        except Exception as exc:  # noqa: BLE001 - any failure of the export closes the trace with its reason
            fallback(_log, "a trace segment's export failed: the trace stopped", exc)
            self._close(f"the trace stopped: its export failed ({type(exc).__name__}: {exc})")
        finally:
            shutil.rmtree(self._dir / f"s{self._count}", ignore_errors=True)
        trimmed = size >= TRIM_AT_BYTES and self._trim is not None
        if trimmed:
            assert self._trim is not None
            self._trim()  # before the next segment records into the same arenas
        self.traced_bytes += size
        self.largest_segment_bytes = max(self.largest_segment_bytes, size)
        duration = end - self._segment_start
        if duration >= 0.05:  # shorter ones are mostly the xplane's fixed part (metadata, thread names)
            self._rate = size / duration
        return trimmed

    def _decode_raw(self, at_least: int = 0) -> None:
        """Read the raw blobs into the decoded columns and drop them, once `at_least` bytes wait. Outside the lock:
        the training thread's callbacks must not wait for a decode. The watcher thread does this while it runs (the
        message class was built at start, so nothing is imported here); what is left raw when the trace ends is
        decoded by xplane.read_segments."""
        with self._lock:
            if self._raw_bytes < max(at_least, 1):
                return
            pending, self._raw, self._raw_bytes = self._raw, [], 0
            if self._decoded is None:
                self._decoded = xplane.Decoded()
            before, segment = self._memory_now(), self._count
        while pending:
            data, offset_ps = pending.pop(0)
            self._decoded.add(data, offset_ps)
            del data
        with self._lock:  # the decode's own memory is not the running segment's growth (see _estimate)
            after = self._memory_now()
            # only where one segment ran throughout: a segment stopped meanwhile (on the training thread) trimmed
            # the heap, and its successor's baseline was read after that
            if self._session is not None and self._count == segment:
                self._segment_rss += after[0] - before[0]
                self._segment_heap += after[1] - before[1]

    def _memory_now(self) -> tuple[int, int]:
        """(RSS, malloc'd bytes; 0 without mallinfo2) of the process now: a segment's baseline and _estimate's
        reading."""
        try:
            rss = self._process.memory_info().rss
        except psutil.Error:  # pragma: no cover - the process always exists for itself
            rss = self._segment_rss
        return rss, self._heap() if self._heap is not None else 0
