"""The guard's watchdog and the end of the user's code (measure/guard.py, Guard.observe and Guard.close): the
watchdog raises from its own thread into the cell's; once the user's code has ended, its exception is cancelled or
caught, never delivered into what runs next (IPython's display of the cell's error, tfmem's report), and a trip
whose exception the cell did not end with is undone."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from tfmem_magic.core.errors import MemoryLimitExceeded
from tfmem_magic.measure import guard


def over_the_line() -> guard.Guard:
    """An open guard whose line the process is already past."""
    g = guard.Guard(limit=1, source="test", rss_at_start=0)
    g.open()
    return g


def watchdog_fires(g: guard.Guard) -> None:
    """The watchdog's sample, from another thread as in a cell (its exception lands in this thread)."""
    sampler = threading.Thread(target=g.observe, args=(psutil.Process().memory_info().rss,))
    sampler.start()
    sampler.join()


def run_python_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class FiresOnClose:
    """The guard's lock, where the watchdog of `g` fires just as close() takes it: its exception lands in close."""

    def __init__(self, g: guard.Guard) -> None:
        self.g, self.lock, self.fired = g, g._lock, False

    def __enter__(self) -> None:
        if threading.get_ident() == self.g._thread_id and not self.fired:
            self.fired = True
            watchdog_fires(self.g)
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_the_watchdog_stops_the_users_code_and_the_trip_stands():
    g = over_the_line()
    with pytest.raises(MemoryLimitExceeded) as stopped:
        watchdog_fires(g)
        run_python_for(2.0)
    g.close(ended=stopped.value)
    assert g.tripped_by == "watchdog" and g.tripped_rss > 0 and g.delivered


def test_an_exception_that_lands_in_close_after_the_cells_own_error_is_caught_and_the_trip_undone():
    g = over_the_line()
    g._lock = FiresOnClose(g)  # type: ignore[assignment]
    g.close(ended=RuntimeError("OOM when allocating tensor"))  # TensorFlow's own error ended the cell first
    run_python_for(0.2)  # nothing lands after it either
    assert g._lock.fired and g.delivered  # type: ignore[attr-defined]
    assert g.tripped_by is None and g.tripped_rss == 0  # the report names what ended the cell: the allocator


def test_an_exception_that_lands_in_close_after_code_that_ended_well_stops_the_cell():
    g = over_the_line()
    g._lock = FiresOnClose(g)  # type: ignore[assignment]
    with pytest.raises(MemoryLimitExceeded):
        g.close()
    assert g.tripped_by == "watchdog"
    g.close()  # again: nothing more
    run_python_for(0.2)


def test_after_close_the_watchdog_raises_nothing():
    g = over_the_line()
    g.close()
    watchdog_fires(g)
    run_python_for(0.2)
    assert g.tripped_by is None and not g.delivered


def test_a_late_exception_the_caller_caught_after_the_cells_own_error_undoes_the_trip():
    g = over_the_line()
    with pytest.raises(MemoryLimitExceeded) as landed:
        watchdog_fires(g)
        run_python_for(2.0)
    own_error = RuntimeError("OOM when allocating tensor")
    g.close(ended=own_error, late=landed.value)
    assert g.tripped_by is None


def test_a_late_exception_that_ended_the_cell_keeps_the_trip():
    g = over_the_line()
    with pytest.raises(MemoryLimitExceeded) as landed:
        watchdog_fires(g)
        run_python_for(2.0)
    g.close(ended=landed.value, late=landed.value)
    assert g.tripped_by == "watchdog"


def test_an_outer_guards_exception_goes_through_an_inner_guards_close():
    outer, inner = over_the_line(), over_the_line()
    inner._lock = FiresOnClose(outer)  # type: ignore[assignment]  # the outer's watchdog fires as the inner closes
    inner._lock.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(MemoryLimitExceeded) as stopped:
        inner.close(ended=ValueError("the inner cell's own error"))
    assert type(stopped.value) is outer._raised and outer.tripped_by == "watchdog"
    assert inner.tripped_by is None
    outer.close(ended=stopped.value)
    assert outer.tripped_by == "watchdog"
