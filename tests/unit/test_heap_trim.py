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
