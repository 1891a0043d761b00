"""The watch over tfmem's own work in the kernel after a cell (measure/guard.py, OwnWorkWatch): under a limit, the
process's growth from that work is stopped before the limit, with real allocations."""

from __future__ import annotations

import time

import psutil
import pytest

from tfmem_magic.measure import guard

MiB = 2**20


def grow(chunks: list[bytearray], total_mib: int) -> None:
    """Python work that grows the process by `total_mib` (bytearrays are zeroed: their pages are touched)."""
    for _ in range(total_mib // 4):
        chunks.append(bytearray(4 * MiB))
        time.sleep(0.005)


def test_work_that_would_pass_the_limit_is_stopped_below_it():
    rss = psutil.Process().memory_info().rss
    limit = rss + 96 * MiB
    chunks: list[bytearray] = []
    with pytest.raises(guard.OwnWorkStopped), guard.own_work_within(limit) as watch:
        assert watch is not None and watch.room() > 64 * MiB
        grow(chunks, 400)
    assert watch.tripped_rss >= watch.threshold
    assert watch.peak < limit, (watch.peak - rss) / MiB  # stopped with the reserve to spare
    assert len(chunks) * 4 < 200  # it did not run on to its end
    chunks.clear()


def test_work_within_the_limit_runs_and_no_stop_lands_after_it():
    rss = psutil.Process().memory_info().rss
    chunks: list[bytearray] = []
    with guard.own_work_within(rss + 512 * MiB) as watch:
        grow(chunks, 40)
    assert watch is not None and watch.tripped_rss == 0 and watch.peak >= rss
    time.sleep(5 * guard.OWN_WORK_INTERVAL_S)  # a late stop would land here
    chunks.clear()


def test_no_limit_watches_nothing():
    with guard.own_work_within(None) as watch:
        assert watch is None


def test_where_the_process_is_past_the_line_already_only_tfmems_own_growth_is_stopped():
    """A cell stopped for memory leaves the process at the limit (it keeps what reached it): the report's analysis
    still runs, however long it takes, and tfmem's own growth past where it started is what gets stopped."""
    rss = psutil.Process().memory_info().rss
    limit = rss - 8 * MiB  # the cell left the process past the limit
    chunks: list[bytearray] = []
    with guard.own_work_within(limit) as watch:
        # the line is the reserve above where the work started: no room for a calibration (RSS itself moves)
        assert watch is not None and watch.threshold == watch.start_rss + guard.OWN_WORK_RESERVE
        time.sleep(10 * guard.OWN_WORK_INTERVAL_S)  # an analysis slower than the sampling interval
        grow(chunks, 4)
    assert watch.tripped_rss == 0
    with pytest.raises(guard.OwnWorkStopped), guard.own_work_within(limit) as watch:
        grow(chunks, 400)
    assert watch.tripped_rss >= watch.threshold
    assert len(chunks) * 4 < 200, len(chunks)  # it did not run on to its end
    chunks.clear()
