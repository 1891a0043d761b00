"""What one measurement is asked to do: the options of `%%tfmem`, `tfmem run` and `profile()`, checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from tfmem_magic.core.errors import TfmemUsageError

# what a measurement records: profiler events (breakdown and timeline), or the allocator's stats and RSS only
Mode: TypeAlias = Literal["trace", "quick"]
# the value of one of Options' fields, given by name (`profile(limit_bytes=...)`, `Profiler(**kwargs)`): the fields
# differ in type, and Options.__post_init__ checks them at run time
OptionValue: TypeAlias = Any

MODES: tuple[Mode, ...] = ("trace", "quick")


@dataclass(frozen=True)
class Options:
    mode: str = "trace"  # "trace" (profiler events: breakdown and timeline) or "quick" (stats and RSS only)
    label: str = ""
    interval_ms: float = 50.0  # RSS and TF sampling period; the RSS peak is exact regardless (VmHWM)
    limit_bytes: int | None = None  # the user's budget for this block (process memory)
    # predict each fit/evaluate/predict's step before it runs and refuse one that will not fit the limit: True,
    # False, or None = when a limit is set and TensorFlow's allocator is not capped (TensorFlow ran before it)
    preflight: bool | None = None
    # after the block, calibrate its what-if (two probe processes replay the step: advise/calibration.py), so the
    # report is born on the step replay where its self-check passes: True, False, or None = the session's setting
    # (%tfmem calibrate auto|on|off; auto unless set: a report that names the largest batch that fits calibrates)
    calibrate: bool | None = None
    trace_steps: int = 10  # steps of each fit/evaluate/predict call that are traced
    trace_seconds: float = 20.0  # wall-time cap on tracing
    keep_xspaces: bool = False  # keep each trace segment's raw XSpace (for TensorBoard's profile tools)
    cell_key: str | None = None  # identifies re-runs of the same cell, for leak detection
    publish: bool = True  # False: a measurement of our own (calibration probes) stays out of history and last_report
    source: str | None = field(default=None, compare=False)  # the cell's code, for fix cells that rewrite it
    # the user's names for model and data
    namespace: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise TfmemUsageError(f"unknown mode {self.mode!r}: use 'trace' or 'quick'")
        if not (1 <= self.interval_ms <= 60_000):
            raise TfmemUsageError(f"--interval {self.interval_ms:g} ms is out of range: use 1 to 60000 ms")
        if self.trace_steps < 1:
            raise TfmemUsageError(f"--trace-steps {self.trace_steps} must be at least 1")
        if self.trace_seconds <= 0:
            raise TfmemUsageError(f"--trace-seconds {self.trace_seconds:g} must be positive")
