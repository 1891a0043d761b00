"""The TensorFlow profiler, driven in segments so that long cells stay cheap to trace.

A segment is one profiler session. Two rules pause it, each holding the trace until it lets go:
- "steps": the Keras instrumentation pauses after the first steps of each `fit`/`evaluate`/`predict` call and lets
  go at the next call;
- "plateau": fed by the sampler thread, it pauses when TF's peak has not grown for `PLATEAU_S` and lets go when the
  peak grows again. A steady loop repeats the moment already traced; the trace exists to explain the peak.
A timer stops tracing for good after `max_seconds`, and at most MAX_SEGMENTS segments are made. Each segment's
xplane is read into memory and its temporary folder deleted at once. Exporting and parsing cost time per traced
event (benchmarks/overhead.py), which is why the trace is kept short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from . import environment

PS_PER_S = 10**12
PLATEAU_S = 1.0
MAX_SEGMENTS = 12


@contextlib.contextmanager
def _quiet_fd2(enabled: bool) -> Iterator[None]:
    """Silence fd 2 while the profiler starts or stops: its C++ INFO lines would land in the notebook cell.

    Only used when TF was imported before we could set TF_CPP_MIN_LOG_LEVEL; it lasts a few milliseconds.
    """
    if not enabled:
        yield
        return
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def user_profiler_running() -> bool:
    """True when someone else's `tf.profiler.experimental` session is active (ours never registers there)."""
    from tensorflow.python.profiler import profiler_v2

    return profiler_v2._profiler is not None


class Tracer:
    def __init__(self, t0: float, max_seconds: float = 20.0) -> None:
        self._t0 = t0
        self.max_seconds = max_seconds
        self._lock = threading.RLock()
        self._dir = Path(tempfile.mkdtemp(prefix=f"tfmem-trace-{os.getpid()}-"))  # whose it is, if one is left
        self._session = None  # the running _pywrap_profiler.ProfilerSession
        self._segment_start = 0.0
        self._count = 0
        self.segments: list[tuple[bytes, int]] = []  # (xplane bytes, start offset in ps from t0)
        self.windows: list[tuple[float, float]] = []  # (start, end) of each segment, seconds from t0
        self.paused_reasons: list[str] = []
        self.closed = False  # no more segments: time cap reached or finished
        self._holds: set[str] = set()
        self._peak_seen = 0
        self._grew_at = 0.0
        self._timer: threading.Timer | None = None
        self._quiet = not environment.profiler_logs_quiet()

    # ---- public ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first segment; raises if another profiler session is active."""
        self._start_segment()
        if self.max_seconds > 0:
            self._timer = threading.Timer(self.max_seconds, self._time_up)
            self._timer.name = "tfmem-trace-timer"
            self._timer.daemon = True
            self._timer.start()

    @property
    def running(self) -> bool:
        return self._session is not None

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
            if self._count >= MAX_SEGMENTS:
                self.closed = True
                self.paused_reasons.append(f"the trace stopped after {MAX_SEGMENTS} segments")
                return
            try:
                self._start_segment()
            except Exception:  # someone else's session took the profiler: stay paused
                self.closed = True

    def observe(self, t: float, current: int, peak: int) -> None:
        """Sampler tick with TF's allocator figures: the plateau rule."""
        if peak > self._peak_seen:
            self._peak_seen, self._grew_at = peak, t
            if "plateau" in self._holds:
                self.release("plateau")
        elif t - self._grew_at >= PLATEAU_S and "plateau" not in self._holds and self._session is not None:
            self.hold("plateau", f"traced while TensorFlow's memory climbed, paused while its peak stayed flat for "
                                 f"{PLATEAU_S:g} s")

    def finish(self) -> list[tuple[bytes, int]]:
        """Stop everything (timer, segment), delete the temp folder; returns the segments."""
        if self._timer is not None:
            self._timer.cancel()
            if self._timer is not threading.current_thread():
                self._timer.join()
        with self._lock:
            self.closed = True
            if self._session is not None:
                self._stop_segment()
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.segments

    # ---- internals ------------------------------------------------------------------------------------------
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
        session = _pywrap_profiler.ProfilerSession()
        # TF 2.21's binding ignores every option given from Python (it logs "host_tracer_level expects an i value"
        # and traces at the defaults, host level 2): pass none, and get the same trace without the warnings.
        options: dict = {}
        with _quiet_fd2(self._quiet):
            self._segment_start = time.perf_counter()
            session.start(str(logdir), options)
        self._session = session

    def _stop_segment(self) -> None:
        session, self._session = self._session, None
        self.windows.append((self._segment_start - self._t0, time.perf_counter() - self._t0))
        with _quiet_fd2(self._quiet):
            session.export_to_tb()
        del session
        files = sorted(self._dir.glob(f"s{self._count}/**/*.xplane.pb"))
        for path in files:
            offset_ps = int((self._segment_start - self._t0) * PS_PER_S)
            self.segments.append((path.read_bytes(), offset_ps))
        shutil.rmtree(self._dir / f"s{self._count}", ignore_errors=True)
