"""Peak windows: TensorFlow's allocator peak and the process's RSS peak over a stretch of a long run (an epoch, N
batches, one evaluate call), read again and again without a cell around them. `MemoryMonitor` reads one per window;
`analyze/growth.py` judges their series.

The allocator's peak counter is process-wide: each window reads it and resets it. A `%%tfmem` cell measuring the
same run keeps its own peak (the window folds what it read into every measurement in progress, as nested cells do).
"""

from __future__ import annotations

from typing import NamedTuple

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Report, main_device_name
from tfmem_magic.core.session import SESSION
from tfmem_magic.measure import environment
from tfmem_magic.measure.sampling import (
    fold_into_measuring,
    memory_info,
    process_rss,
    read_hwm,
    reset_hwm,
    tf_device_names,
)


class Peaks(NamedTuple):
    tf_bytes: int | None  # TensorFlow's peak bytes in use on the device; None: its allocator keeps no statistics
    rss_bytes: int  # the process's RSS peak


class PeakWindow:
    """One reading of the peaks: TF's peak counter and the kernel's RSS high-water mark, reset at its start."""

    def __init__(self, device: str | None) -> None:
        self.device = device
        self.rss_start = process_rss()
        self.folded_tf, self.folded_rss = 0, 0  # peaks read before a measurement inside the window reset them
        # an enclosing measurement (a %%tfmem cell) keeps its RSS peak only if we leave the high-water mark alone;
        # then a high-water mark that rose during the window is the window's peak
        self.hwm_reset = not SESSION.measuring and reset_hwm()
        self.hwm_start = None if self.hwm_reset else read_hwm()
        info = memory_info(device) if device is not None else None
        if device is not None and info is not None:
            fold_into_measuring(device, info["peak"])
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats(device)

    def fold_current(self) -> None:
        """Keep the peaks so far: a measurement that starts inside the window (the traced first steps) resets
        TensorFlow's counter and the high-water mark."""
        info = memory_info(self.device) if self.device is not None else None
        if info is not None:
            self.folded_tf = max(self.folded_tf, int(info["peak"]))
        self.folded_rss = max(self.folded_rss, (read_hwm() if self.hwm_reset else None) or process_rss())

    def fold_report(self, report: Report) -> None:
        """Keep the peaks of a measurement that ran inside the window."""
        mem = report.tf.get(self.device) if self.device is not None else None
        if mem is not None:
            self.folded_tf = max(self.folded_tf, mem.peak_bytes)
        self.folded_rss = max(self.folded_rss, report.rss.peak_bytes)

    def close(self) -> Peaks:
        """The peaks since the window opened."""
        tf_peak = None
        info = memory_info(self.device) if self.device is not None else None
        if self.device is not None and info is not None:
            tf_peak = max(int(info["peak"]), self.folded_tf)
            fold_into_measuring(self.device, tf_peak)
        rss_end = process_rss()
        hwm = read_hwm()
        if not self.hwm_reset and (hwm is None or self.hwm_start is None or hwm <= self.hwm_start):
            hwm = None  # the process's high-water mark is older than this window: it says nothing of it
        return Peaks(tf_peak, max(hwm or 0, self.rss_start, rss_end, self.folded_rss))


def stats_device(device: str | None, who: str = "MemoryMonitor") -> str | None:
    """The device to read: the one asked for, else the first GPU, else the CPU, among those keeping statistics."""
    if not environment.tensorflow_initialized():
        import tensorflow as tf

        tf.constant(0)  # create the devices: the model is about to run anyway
    names = [d for d in tf_device_names() if memory_info(d) is not None]
    if device is not None:
        if device not in names:
            raise TfmemUsageError(
                f"{who}(device={device!r}): TensorFlow keeps no memory statistics for that "
                f"device here (devices with statistics: {', '.join(names) or 'none'})"
            )
        return device
    return main_device_name(names)
