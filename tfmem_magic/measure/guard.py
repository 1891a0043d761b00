"""The memory guard: an over-budget cell fails with a catchable error instead of the kernel being killed.

Three layers, strongest first (docs/design.md, 'Memory guard', 'Out of memory and limits' have the measurements):
1. allocator: TF_CPU_BFC_MEM_LIMIT_IN_MB, read by TensorFlow at its first op. Every TF allocation past it raises
   ResourceExhaustedError, before any memory is touched. Only possible when the limit is set before the first op.
2. batch-end check: a Keras callback in fit/evaluate/predict compares the process RSS with the limit after every
   batch and raises MemoryLimitExceeded between two steps (~1 ms reaction).
3. watchdog: the RSS sampler thread raises MemoryLimitExceeded in the cell's thread (an asynchronous exception,
   delivered at the next Python bytecode): it stops Python loops.
With oneDNN on, TensorFlow 2.21 crashes the process (segfault after "OP_REQUIRES failed at mkl_util.h") when the
allocator limit refuses a request inside fit: so arming layer 1 also turns oneDNN off unless the user chose it
(measured: a small CNN fit 1.5x slower; eager OOMs were caught either way).
What none can catch: one C++ op (a huge matmul, a numpy call) that outgrows the limit in a single step without
going through TF's allocator; the kernel's OOM killer is then still the last word.

RSS never shrinks (TF's allocator keeps its regions), so layers 2 and 3 trip when the process grows past
max(limit, RSS at the cell's start + MARGIN): a process already above the limit is stopped when it grows further.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from tfmem_magic.core.errors import MemoryLimitExceeded, TfmemUsageError, exception_chain
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import environment

LIMIT_ENV = environment.BFC_CAP_ENV
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
MARGIN = 64 * 2**20
MIN_ALLOCATOR_MB = 64
# RSS that TensorFlow's runtime (libraries, kernels, caches: not allocator memory) adds to the process, measured
# on TF 2.21 CPU + Keras 3.15: 537 MiB from import to the end of a first fit, 28 MiB of it after the import. The
# allocator cap leaves room for it, so that TF's allocator refuses before the process reaches the limit (and the
# watchdog's exception never lands while TF raises its own: pybind11 then reports a RuntimeError).
RUNTIME_RSS_NOT_IMPORTED = 640 * 2**20
RUNTIME_RSS_IMPORTED = 64 * 2**20


_TANGLED = "MISMATCH of original and normalized active exception types"


@dataclass
class SessionLimit:
    bytes: int
    source: str  # "user" (%tfmem limit)
    allocator_mb: int | None  # the TF allocator limit set with it, or None when TF was already running


def check_reachable(limit: int, where: str, margin: int = MARGIN) -> None:
    """A limit the process already passes (or leaves no room under) is not a budget any batch can meet: say so
    before the cell runs, with the process's size and a limit that leaves room, instead of stopping the cell as if
    it had grown."""
    rss = psutil.Process().memory_info().rss
    runtime = runtime_still_to_come()
    if limit >= rss + runtime + margin:
        return
    room = max(256 * 2**20, rss // 4)  # for the cell's own work: its tensors, the framework's temporaries
    suggestion = -(-(rss + runtime + room) // (128 * 2**20)) * 128 * 2**20  # rounded up to 128 MiB
    fix = (
        f"Give a limit with room for the cell's work, e.g. {where} {format_bytes(suggestion).replace(' ', '')}, "
        "or free memory first."
    )
    if runtime and limit >= rss:
        raise TfmemUsageError(
            f"{where} {format_bytes(limit)} leaves no room for TensorFlow: the process holds {format_bytes(rss)} now, "
            f"and TensorFlow's runtime adds ~{format_bytes(runtime)} when it starts (its libraries, kernels and "
            f"caches: measured on TF 2.21 CPU), so every cell would pass the limit before its own work. {fix}"
        )
    if limit >= rss:
        raise TfmemUsageError(
            f"{where} {format_bytes(limit)} leaves less than {format_bytes(margin)} of room above what this process "
            f"already holds ({format_bytes(rss)}: Python, TensorFlow's runtime and your variables), so no batch size "
            f"could meet it. {fix}"
        )
    raise TfmemUsageError(
        f"{where} {format_bytes(limit)} is below what this process already holds ({format_bytes(rss)}: Python, "
        f"TensorFlow's runtime and your variables), so no batch size could meet it. {fix}"
    )


def runtime_still_to_come() -> int:
    """The RSS TensorFlow's runtime will still add to this process before any cell's own work: its import (~640
    MiB) when it is not imported yet; once imported, what its first ops add (~64 MiB) is left to the limit's margin,
    as it always was."""
    if environment.tensorflow_imported() or not environment.tensorflow_installed():
        return 0
    return RUNTIME_RSS_NOT_IMPORTED


def session_limit() -> SessionLimit | None:
    limit: SessionLimit | None = SESSION.limit  # the session holds it untyped (core imports nothing of measure)
    return limit


def set_session_limit(limit: int, keep_onednn: bool = False) -> tuple[SessionLimit, str]:
    """`%tfmem limit SIZE`: the budget of every later cell; arms TF's allocator limit if still possible. A limit the
    process already passes is a TfmemUsageError (see check_reachable)."""
    check_reachable(limit, "%tfmem limit", margin=0)
    rss = psutil.Process().memory_info().rss
    allocator_mb = None
    if environment.tensorflow_initialized():
        how = (
            "TensorFlow is already running, so its allocator cannot be limited any more: the batch-end check "
            "and the watchdog protect the cells. Restart the kernel and run %tfmem limit before any TensorFlow "
            "code to also cap TensorFlow's allocator."
        )
    elif os.environ.get(environment.BFC_ENV) not in ("1", "true", "True"):
        how = (
            f"TensorFlow's allocator limit needs the BFC allocator ({environment.BFC_ENV}=1), which is off: the "
            "batch-end check and the watchdog protect the cells."
        )
    else:
        runtime = RUNTIME_RSS_IMPORTED if environment.tensorflow_imported() else RUNTIME_RSS_NOT_IMPORTED
        allocator_mb = max(MIN_ALLOCATOR_MB, (limit - rss - runtime) // 2**20)
        os.environ[LIMIT_ENV] = str(allocator_mb)
        how = (
            f"TensorFlow's allocator is capped at {format_bytes(allocator_mb * 2**20)} ({LIMIT_ENV}: the limit "
            f"minus the {format_bytes(rss)} the process holds now and ~{format_bytes(runtime)} that TensorFlow's "
            "runtime will add), and the batch-end check and the watchdog watch the process."
        )
        if keep_onednn and SESSION.onednn_off_by_us:  # an earlier %tfmem limit turned it off: give it back
            os.environ.pop(ONEDNN_ENV, None)
            SESSION.onednn_off_by_us = False
        if (ONEDNN_ENV in os.environ and not SESSION.onednn_off_by_us) or keep_onednn:
            if os.environ.get(ONEDNN_ENV, "1") != "0":
                how += (
                    " oneDNN stays on: an out-of-memory error inside fit() can then crash the kernel (TensorFlow 2.21)."
                )
        else:
            os.environ[ONEDNN_ENV] = "0"
            SESSION.onednn_off_by_us = True
            how += (
                f" oneDNN is turned off ({ONEDNN_ENV}=0): with it, TensorFlow 2.21 crashes the kernel on an "
                "out-of-memory error inside fit(). CPU training gets slower (a small CNN: 1.5x); "
                "%tfmem limit SIZE --keep-onednn keeps it."
            )
    SESSION.limit = SessionLimit(limit, "user", allocator_mb)
    return SESSION.limit, f"Memory limit {format_bytes(limit)} for every cell. {how}"


def clear_session_limit() -> str:
    limit = SESSION.limit
    armed = limit is not None and limit.allocator_mb is not None and environment.tensorflow_initialized()
    SESSION.limit = None
    if armed:
        return (
            "Memory limit removed for the batch-end check and the watchdog. TensorFlow's allocator keeps the cap "
            "(and oneDNN stays off) as read at its first op, until the kernel restarts."
        )
    # TensorFlow has not read them yet: take back every variable the limit set (the machine-sized BFC cap returns)
    default_cap = environment.allocator_setup().bfc_cap_mb_by_us
    if default_cap is not None:
        os.environ[LIMIT_ENV] = str(default_cap)
    else:
        os.environ.pop(LIMIT_ENV, None)
    if SESSION.onednn_off_by_us:
        os.environ.pop(ONEDNN_ENV, None)
        SESSION.onednn_off_by_us = False
    return "Memory limit removed."


def allocator_limit_bytes() -> int | None:
    """TF's allocator cap in force (read at the first op), if any."""
    value = os.environ.get(LIMIT_ENV)
    if value is None or not environment.tensorflow_initialized():
        return None
    try:
        mb = int(value)
    except ValueError:
        return None
    # a cap the size of the machine (tfmem's default, or one inherited from a parent process) guards nothing
    return mb * 2**20 if mb < environment.machine_memory_mb() else None


class Guard:
    """Layers 2 and 3 for one cell. `check()` raises in the cell's thread; `observe()`, called from the sampler
    thread, raises in the cell's thread asynchronously. Both act only while the guard is open: from `open()`, just
    before the user's code runs, to `close()`, just after; so the watchdog's exception never lands in tfmem's own
    arming or stopping code (where it would leave instruments half-armed)."""

    def __init__(self, limit: int, source: str, rss_at_start: int) -> None:
        self.limit = limit
        self.source = source
        self.threshold = max(limit, rss_at_start + MARGIN)
        self.tripped_by: str | None = None
        self.tripped_rss = 0
        self._thread_id = threading.get_ident()
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._armed = False  # closed until the user's code runs
        self.delivered = False  # the watchdog's exception landed in the cell's thread
        self._raised: type[MemoryLimitExceeded] | None = None  # the class of the watchdog's exception, once raised

    def message(self, rss: int, where: str) -> str:
        over = "passed its memory limit" if self.threshold == self.limit else "grew past its memory limit"
        return (
            f"The process {over} ({format_bytes(rss)} against {format_bytes(self.limit)}, {self.source}) "
            f"{where}; tfmem stopped the cell before the machine ran out. Your variables are intact: free "
            "memory or lower the batch size and run again."
        )

    def check(self, where: str) -> None:
        """The batch-end check (layer 2), in the cell's own thread."""
        rss = self._process.memory_info().rss
        if rss > self.threshold and self._claim("batch-end check", rss):
            raise MemoryLimitExceeded(self.message(rss, where))

    def observe(self, rss: int) -> None:
        """The watchdog (layer 3), from the sampler thread. The claim and the raise are one step under the lock, so
        that `close()` (which takes the lock) comes either first, and nothing is raised, or after, and cancels it."""
        if rss <= self.threshold:
            return
        with self._lock:
            if not self._claim_locked("watchdog", rss):
                return
            detail = self.message(rss, "in Python code")
            watched = self

            def landed(exc: MemoryLimitExceeded, *args: object) -> None:  # Python makes it where it lands
                MemoryLimitExceeded.__init__(exc, *args)
                watched.delivered = True

            exc_type = type("MemoryLimitExceeded", (MemoryLimitExceeded,), {"detail": detail, "__init__": landed})
            self._raised = exc_type
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), ctypes.py_object(exc_type))

    def untangle(self, exc: BaseException | None) -> BaseException | None:
        """The user-facing exception for `exc`. When TF's allocator refuses a request it first waits (up to 10 s)
        for memory; a watchdog exception queued meanwhile lands while TF builds its own error, and pybind11 then
        reports both as a RuntimeError ("MISMATCH of original and normalized active exception types"). Give the
        user the guard's clean MemoryLimitExceeded instead of that."""
        if not (
            isinstance(exc, RuntimeError)
            and self.tripped_by == "watchdog"
            and _TANGLED in str(exc)
            and "MemoryLimitExceeded" in str(exc)
        ):
            return exc
        clean = MemoryLimitExceeded(
            self.message(
                self.tripped_rss,
                "while TensorFlow's allocator was refusing a "
                "request (it waits up to 10 s for memory before it gives up)",
            )
        )
        clean.__traceback__ = exc.__traceback__
        return clean

    def open(self) -> None:
        """The user's code starts: trips may raise from now on."""
        with self._lock:
            self._armed = True

    def close(self, ended: BaseException | None = None, late: BaseException | None = None) -> None:
        """The user's code ended: no more trips, and a watchdog exception not yet delivered is cancelled (it must
        not land in tfmem's code, in IPython's display of the cell's error, or in the next cell). Called from the
        cell's thread; safe to call again. `ended` is the exception the user's code ended with, where it raised one;
        `late`, the watchdog's exception where it landed after that code but before close could cancel it (the
        caller caught it).

        The watchdog's exception can land in close's own code too, before it cancels. Where the user's code ended by
        itself with an error (TensorFlow's allocator refused a request as the watchdog fired), that error stands and
        the trip is undone; where it ended without one, the cell is stopped at its end (the exception is raised from
        here). A trip whose exception never landed is undone too: nothing stopped the cell. Another guard's
        exception (an outer cell's) is neither caught nor cancelled."""
        if late is not None and type(late) is not self._raised:
            raise late
        while True:
            try:
                with self._lock:
                    self._armed = False
                    if self._pending() and threading.get_ident() == self._thread_id:
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)
                break
            except MemoryLimitExceeded as exc:
                if type(exc) is not self._raised:  # not this guard's: it goes on
                    raise
                late = exc  # this guard's, landed before it was cancelled: one per guard
        landed = self.delivered or any(type(e) is self._raised for e in exception_chain(ended))
        if self.tripped_by == "watchdog" and (
            not landed or (late is not None and ended is not None and ended is not late)
        ):
            self.tripped_by, self.tripped_rss = None, 0
        elif late is not None and ended is None:
            raise late

    def _pending(self) -> bool:
        """This guard's watchdog raised and its exception has not landed (yet)."""
        return self.tripped_by == "watchdog" and not self.delivered

    def _claim(self, layer: str, rss: int) -> bool:
        with self._lock:
            return self._claim_locked(layer, rss)

    def _claim_locked(self, layer: str, rss: int) -> bool:
        if self.tripped_by is not None or not self._armed:
            return False
        self.tripped_by, self.tripped_rss = layer, rss
        return True


# ---- tfmem's own work after a cell --------------------------------------------------------------------------------

# What the watch of tfmem's own work keeps free below the limit: its sampling lag (OWN_WORK_INTERVAL_S) at the growth
# a calibration's model export makes (docs/preflight.md, "tfmem's own work counts")
OWN_WORK_RESERVE = 16 * 2**20
OWN_WORK_INTERVAL_S = 0.02


class OwnWorkStopped(KeyboardInterrupt):
    """tfmem's own work after the user's code (the report's analysis, calibration) brought the process to the user's
    limit and was stopped there. A KeyboardInterrupt, so that whatever cleans up on a stop (a probe process killed,
    an instrument disarmed) runs for it too; the pipeline catches it by this name."""


class OwnWorkWatch:
    """Samples the process's RSS while tfmem works in the kernel on the user's behalf, and stops that work (an
    OwnWorkStopped raised in its thread) when the process reaches `limit` - OWN_WORK_RESERVE: the limit's promise
    is the process's, tfmem's own work included. Where the user's code left the process at that line or past it (a
    cell stopped for memory keeps what reached the limit), the line is OWN_WORK_RESERVE above where the work starts:
    tfmem's own growth is what it stops, not the cell's, so an out-of-memory cell still gets its findings and fixes
    (which leaves no room for a calibration). `peak` is the highest RSS it saw."""

    def __init__(self, limit: int) -> None:
        self._process = psutil.Process()
        self.limit = limit
        self.start_rss = int(self._process.memory_info().rss)
        self.threshold = max(limit - OWN_WORK_RESERVE, self.start_rss + OWN_WORK_RESERVE)
        self.peak = 0
        self.tripped_rss = 0
        self._thread_id = threading.get_ident()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._armed = False
        self._sampler = threading.Thread(target=self._run, name="tfmem-own-work-watch", daemon=True)

    def room(self) -> int:
        """Bytes tfmem's own work may still add to the process (negative: the process is past the line already)."""
        return self.threshold - int(self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._done.wait(OWN_WORK_INTERVAL_S):
            rss = self._process.memory_info().rss
            self.peak = max(self.peak, rss)
            if rss >= self.threshold:
                with self._lock:
                    if not self._armed or self.tripped_rss:
                        continue
                    self.tripped_rss = rss
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread_id), ctypes.py_object(OwnWorkStopped)
                )
                return  # one stop: the sampler ends even where the stop lands before stop() could run

    def start(self) -> None:
        self.peak = self._process.memory_info().rss
        with self._lock:
            self._armed = True
        self._sampler.start()

    def stop(self) -> None:
        """No more stops; one not yet delivered is cancelled (it must not land in the next cell)."""
        with self._lock:
            self._armed = False
        self._done.set()
        if self._sampler.is_alive():
            self._sampler.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        if threading.get_ident() == self._thread_id:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)


@contextlib.contextmanager
def own_work_within(limit: int | None) -> Iterator[OwnWorkWatch | None]:
    """Around tfmem's own work in the kernel after a cell under `limit` (None: no limit, nothing watched)."""
    if limit is None:
        yield None
        return
    watch = OwnWorkWatch(limit)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


# ---- reading TensorFlow's OOM messages ---------------------------------------------------------------------------

_OOM = re.compile(r"OOM when allocating tensor with shape\s*\[([^\]]*)\] and type (\w+) on (\S+) by allocator (\S+)")
_EAGER_OP = re.compile(r"\[Op:(\w+)\]")  # eager: "... [Op:Fill] name:"
_GRAPH_OP = re.compile(r"\{\{node ([^}]+)\}\}")  # in fit / tf.function: "[[{{node StatefulPartitionedCall/...}}]]"
_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "half": 2,
    "bfloat16": 2,
    "int32": 4,
    "int64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
_DTYPE_NAMES = {"float": "float32", "double": "float64", "half": "float16"}


def parse_oom(message: str) -> dict[str, Any] | None:
    """The failed request in a ResourceExhaustedError message: shape, dtype, bytes, device, allocator, op (a graph
    op's node path, or an eager op's type), and for a graph op the tf.function that ran it (`function`)."""
    match = _OOM.search(message)
    if match is None:
        return None
    dims = [int(d) for d in match.group(1).replace(" ", "").split(",") if d.strip().lstrip("-").isdigit()]
    dtype = match.group(2)
    # a graph op's node first: a function's error also ends in `[Op:__inference_<function>]`, the function that ran
    node, eager = _GRAPH_OP.search(message), _EAGER_OP.search(message)
    op = node or eager
    found = {
        "shape": f"[{','.join(str(d) for d in dims)}]",
        "dtype": _DTYPE_NAMES.get(dtype, dtype),
        "bytes": math.prod(dims) * _DTYPE_BYTES.get(dtype, 4) if dims else 0,
        "device": match.group(3).split("device:")[-1],
        "allocator": match.group(4),
        "op": op.group(1) if op else None,
    }
    if node is not None and eager is not None and eager.group(1).startswith("__inference_"):
        found["function"] = eager.group(1)  # the function the node ran in (or one that called it)
    return found
