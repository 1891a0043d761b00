"""The tracer's heap trimmer (glibc's malloc_trim) gives freed malloc'd pages back: what a trace's exports free sits in
per-thread arenas as free chunks, which count in RSS until trimmed."""

from __future__ import annotations

import ctypes
import platform
import threading

import psutil
import pytest

from tfmem_magic.measure.tracer import _heap_trimmer

MiB = 2**20
glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc, reason="malloc_trim is glibc's")
def test_the_trimmer_gives_back_chunks_freed_in_another_threads_arena():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()

    def fill_and_free() -> None:
        # 64 MiB in 2 kB chunks (far below the mmap threshold), touched; the last one stays allocated so that
        # free() cannot shrink the heap from its top by itself
        chunks = [libc.malloc(2048) for _ in range(32 * 1024)]
        for chunk in chunks:
            ctypes.memset(chunk, 1, 2048)
        for chunk in chunks[:-1]:
            libc.free(chunk)
        kept.append(chunks[-1])

    kept: list[int] = []
    worker = threading.Thread(target=fill_and_free)  # a thread's own arena, as the profiler's threads have
    worker.start()
    worker.join()
    before = process.memory_info().rss
    trim = _heap_trimmer()
    assert trim is not None
    trim()
    given_back = before - process.memory_info().rss
    libc.free(kept[0])
    assert given_back >= 32 * MiB, given_back / MiB


def test_without_glibc_there_is_no_trimmer(monkeypatch):
    def no_symbol(_name: object) -> object:
        raise AttributeError("malloc_trim")

    monkeypatch.setattr(ctypes, "CDLL", no_symbol)
    assert _heap_trimmer() is None


class _Decoded:
    """xplane.Decoded's add(), with what happens on another thread meanwhile (`during`)."""

    def __init__(self, during) -> None:
        self.during = during

    def add(self, data: bytes, offset_ps: int) -> None:
        self.during()


def test_a_decode_moves_the_running_segments_baseline_only_when_one_segment_ran_throughout(monkeypatch):
    import time

    from tfmem_magic.measure import tracer

    t = tracer.Tracer(time.perf_counter())
    try:
        readings = iter([(1000 * MiB, 0), (1040 * MiB, 0), (1000 * MiB, 0), (900 * MiB, 0)])
        monkeypatch.setattr(t, "_memory_now", lambda: next(readings))
        t._session, t._segment_rss = object(), 500 * MiB  # a running segment (never started: no profiler here)
        t._decoded = _Decoded(lambda: None)
        t._raw, t._raw_bytes = [(b"x", 0)], 1
        t._decode_raw()  # the decode's own 40 MiB is not the segment's growth
        assert t._segment_rss == 540 * MiB

        def restarted() -> None:  # the training thread stopped the segment (a trim: -100 MiB) and started the next
            t._count += 1
            t._segment_rss = 900 * MiB

        t._decoded = _Decoded(restarted)
        t._raw, t._raw_bytes = [(b"x", 0)], 1
        t._decode_raw()
        assert t._segment_rss == 900 * MiB  # the new segment's baseline stands: the trim was not its growth
    finally:
        t._session = None
        t.finish()


def test_the_last_segment_trims_once_when_the_trace_finishes(monkeypatch):
    # finish stops a running segment; one that large trims after its export, and finish then need not trim again
    # (it still trims where the last segment had stopped before: its export's free chunks are left otherwise)
    import functools
    import time

    from tfmem_magic.measure import tracer

    class Session:  # the profiler's session: its export writes one segment's xplane
        def __init__(self, folder, size: int) -> None:
            self.folder, self.size = folder, size

        def export_to_tb(self) -> None:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "host.xplane.pb").write_bytes(b"x" * self.size)

    for size, trims in ((tracer.TRIM_AT_BYTES, 1), (1024, 1)):
        t = tracer.Tracer(time.perf_counter())
        calls = []
        monkeypatch.setattr(t, "_trim", functools.partial(calls.append, 1))
        t._session = Session(t._dir / f"s{t._count}", size)
        t.finish()
        assert len(calls) == trims, (size, calls)
