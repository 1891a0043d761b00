"""Fallbacks: where tfmem degrades instead of failing (a private API that moved, a layer that cannot be described,
a trace that could not be exported), what it caught is logged and counted.

Each module logs through `logging.getLogger(__name__)` (under the `tfmem_magic` logger) at debug level, with the
exception's traceback. The last `KEPT` fallbacks are also kept here, so that `%tfmem status` can say how many this
kernel took and `%tfmem status --log` can show them without any logging set up
(`logging.getLogger("tfmem_magic").setLevel(logging.DEBUG)` with a handler shows them as they happen).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass

KEPT = 50  # the most recent fallbacks kept for `%tfmem status --log`


@dataclass(frozen=True)
class Fallback:
    """One degraded measurement: where (the module's logger), what degraded, and what was caught."""

    where: str  # the logger's name, e.g. "tfmem_magic.measure.tracer"
    what: str  # what degraded, in words
    error: str  # the exception caught: "KeyError: 'x'", or "" where none was


_lock = threading.Lock()
_recent: deque[Fallback] = deque(maxlen=KEPT)
_counts: Counter[str] = Counter()


def fallback(log: logging.Logger, what: str, exc: BaseException | None = None) -> None:
    """Record a fallback: logged at debug level (with the traceback of `exc`), counted and kept for %tfmem status."""
    error = "" if exc is None else f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    log.debug("fallback: %s%s", what, f" ({error})" if error else "", exc_info=exc)
    with _lock:
        _recent.append(Fallback(log.name, what, error))
        _counts[log.name] += 1


def counts() -> dict[str, int]:
    """How many fallbacks each module took in this process, most first."""
    with _lock:
        return dict(_counts.most_common())


def recent() -> list[Fallback]:
    """The last `KEPT` fallbacks, oldest first."""
    with _lock:
        return list(_recent)


def forget() -> None:
    """Forget every fallback (a new session, a test)."""
    with _lock:
        _recent.clear()
        _counts.clear()
