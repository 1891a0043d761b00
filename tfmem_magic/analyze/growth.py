"""Growth over a series of readings: whether memory kept from one epoch, run or loop step to the next is a leak.
The Keras callback judges its epochs' peaks, the pytest plugin's no-leak marker its runs' live bytes."""

from __future__ import annotations

import itertools

GROWTH_EPOCHS = 3  # epochs in a row whose peak grew before the growth is called a leak
GROWTH_MIN = 1 << 20  # ... each by at least this (and 0.5% of the peak): allocator noise is smaller


def steady_growth(peaks: list[int | None]) -> list[int] | None:
    """The last GROWTH_EPOCHS + 1 epochs' peaks when each grew on the one before past allocator noise (something
    is kept from epoch to epoch); None otherwise."""
    last = [p for p in peaks[-(GROWTH_EPOCHS + 1) :] if p is not None]
    if len(last) < GROWTH_EPOCHS + 1 or not all(
        b - a > max(GROWTH_MIN, 0.005 * b) for a, b in itertools.pairwise(last)
    ):
        return None
    return last


def leak_per_run(ends: list[int]) -> tuple[float, int]:
    """(the growth per run the no-leak rule judges, the largest single growth it left out).

    A leak grows every run; a one-off does not: a cache filled or a function traced for a new shape (a short last
    batch) in one run. So the rule is the mean growth of the runs after the first (warm-up) one, leaving out the
    single largest growth when there are at least two to judge. With two later runs that is the smaller growth; over
    a longer loop a leak in only some iterations still counts (a minimum would let every second iteration leak).
    """
    growth = sorted(b - a for a, b in itertools.pairwise(ends))
    judged = growth[:-1] if len(growth) > 1 else growth
    return sum(judged) / len(judged), growth[-1]
