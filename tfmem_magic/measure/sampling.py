"""Cheap instruments that run in every mode: process RSS (sampler thread + kernel high-water mark) and TF's allocator
stats."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import main_device_name
from tfmem_magic.core.session import SESSION
from tfmem_magic.measure import environment

_log = logging.getLogger(__name__)

MAX_SAMPLES = 4000


def read_hwm() -> int | None:
    """The kernel's peak RSS of this process (VmHWM), in bytes; None where /proc has no such line."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs). False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class RssSampler:
    """Samples this process's RSS (and TF's live bytes once TF runs) on a daemon thread.

    The exact RSS peak comes from VmHWM where Linux lets us reset it: sampling alone misses short spikes between two
    samples. Nested samplers (a %%tfmem inside another) must not reset the outer one's high-water mark:
    `reset_hwm=False`. `on_tick(t, current, peak)` is called with TF's allocator figures after each sample; the
    tracer uses it to trace only while memory climbs.
    """

    def __init__(
        self,
        interval_s: float = 0.02,
        reset_hwm: bool = True,
        on_tick: Callable[[float, int, int], None] | None = None,
        on_rss: Callable[[int], None] | None = None,
        tf_device: str | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.samples: list[list[float]] = []
        self.tf_samples: list[list[float]] = []  # [t, live bytes] of the main TF device
        # chosen by the caller in the cell's thread: this thread must never import (a cell importing TensorFlow
        # while we do deadlocks on the import lock), so a cell that starts TF itself is not sampled for TF
        self.tf_device = tf_device
        self.baseline = 0
        self._hwm_reset = False
        self._want_reset = reset_hwm
        self._on_tick = on_tick
        self._on_rss = on_rss  # the guard's watchdog
        self.errors: list[str] = []  # what a callback raised: said in the report, never kills the thread

    def start(self, t0: float) -> None:
        self._t0 = t0
        self.baseline = self._process.memory_info().rss
        self._hwm_reset = self._want_reset and reset_hwm()
        self.samples = [[0.0, self.baseline]]
        self._thread = threading.Thread(target=self._run, name="tfmem-rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.interval_s
        while not self._stop.wait(interval):
            t = round(time.perf_counter() - self._t0, 4)
            try:
                rss = self._process.memory_info().rss
            except psutil.Error:  # pragma: no cover - the process always exists for itself
                return
            self.samples.append([t, rss])
            if self._on_rss is not None:
                self._call(self._on_rss, rss)
            self._sample_tf(t)
            if len(self.samples) >= MAX_SAMPLES:  # long cell: halve the resolution instead of growing
                self.samples = self.samples[::2]
                self.tf_samples = self.tf_samples[::2]
                interval *= 2

    def _sample_tf(self, t: float) -> None:
        if self.tf_device is None:
            return
        info = AllocatorStats._info(self.tf_device)
        if info is None:
            return
        self.tf_samples.append([t, info["current"]])
        if self._on_tick is not None:
            self._call(self._on_tick, t, info["current"], info["peak"])

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        """A callback's failure must not stop the sampling (the watchdog lives in this thread): it is noted once
        and that callback is dropped."""
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001 - a callback's failure turns it off, never the sampler
            fallback(_log, "a sampler callback failed and was turned off", exc)
            name = getattr(callback, "__qualname__", repr(callback))
            self.errors.append(
                f"The sampler's {name} callback failed ({type(exc).__name__}: {exc}) and was turned "
                "off for the rest of the cell; sampling went on."
            )
            if callback == self._on_tick:
                self._on_tick = None
            else:
                self._on_rss = None

    def stop(self) -> tuple[int, int, str]:
        """Stop and join the thread; returns (peak, end, peak_source)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        end = self._process.memory_info().rss
        self.samples.append([round(time.perf_counter() - self._t0, 4), end])
        sampled_peak = max(int(s[1]) for s in self.samples)
        hwm = read_hwm() if self._hwm_reset else None
        if hwm is not None:
            return max(hwm, sampled_peak), end, "hwm"
        return sampled_peak, end, "sampled"


def fold_into_measuring(device: str, peak: int) -> None:
    """Keep `peak` in every measurement in progress before TensorFlow's process-wide peak counter is reset (or
    when an inner measurement ends): each of them reports the largest peak it spanned."""
    for outer in SESSION.measuring:
        outer._fold(device, peak)


def tf_device_names() -> list[str]:
    """TensorFlow's CPU and GPU devices ("CPU:0", "GPU:1"): those whose allocators may keep statistics."""
    return [d for d in environment.tf_devices() if d.split(":")[0] in ("CPU", "GPU")]


def main_tf_device() -> str | None:
    """The device whose live bytes are sampled: the first GPU, else the CPU; None before TF runs. Main thread only."""
    if not environment.tensorflow_initialized():
        return None
    return main_device_name(tf_device_names()) or "CPU:0"


class AllocatorStats:
    """Per-device TF allocator stats around a cell, correct when cells nest.

    `reset_memory_stats` resets the device's peak for everyone: before resetting, an inner measurement folds the
    peak so far into every outer one, and when it stops it folds its own peak into them again. TensorFlow has no way
    to set the counter back, so the peak it read before the reset is kept (`peak_before`) and the report says so.
    """

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.baseline: dict[str, int] = {}
        self._folded_peak: dict[str, int] = {}
        self.peak_before: dict[str, int] = {}  # TF's peak counter as the user's code left it, before our reset
        self.initialized_at_start = False

    @staticmethod
    def _info(device: str) -> dict[str, int] | None:
        return memory_info(device)

    def start(self) -> None:
        self.initialized_at_start = environment.tensorflow_initialized()
        if self.initialized_at_start:
            import tensorflow as tf

            for device in tf_device_names():
                info = self._info(device)
                if info is None:
                    continue
                self.devices.append(device)
                self.baseline[device] = info["current"]
                self.peak_before[device] = info["peak"]
                # BFC keeps its regions: the highest peak seen in this kernel is held still, whatever the resets
                SESSION.tf_peak_most[device] = max(SESSION.tf_peak_most.get(device, 0), info["peak"])
                fold_into_measuring(device, info["peak"])
                tf.config.experimental.reset_memory_stats(device)
        SESSION.measuring.append(self)

    def _fold(self, device: str, peak: int) -> None:
        self._folded_peak[device] = max(self._folded_peak.get(device, 0), peak)

    def stop(self) -> dict[str, tuple[int, int, int]]:
        """{device: (baseline, peak, end)} for every device with stats; frees the nesting slot."""
        if self in SESSION.measuring:
            SESSION.measuring.remove(self)
        out: dict[str, tuple[int, int, int]] = {}
        if not environment.tensorflow_initialized():
            return out
        # a cell that ran TF's first op: the allocator was born in the cell, its baseline is 0
        devices = self.devices if self.initialized_at_start else tf_device_names()
        for device in devices:
            info = self._info(device)
            if info is None:
                continue
            peak = max(info["peak"], self._folded_peak.get(device, 0))
            out[device] = (self.baseline.get(device, 0), peak, info["current"])
            fold_into_measuring(device, peak)
        return out

    @classmethod
    def nesting_depth(cls) -> int:
        return len(SESSION.measuring)


def memory_info(device: str) -> dict[str, int] | None:
    """TensorFlow's {"current", "peak"} bytes on `device`; None when its allocator keeps no statistics (the plain
    CPU allocator) or the process has no such device."""
    import tensorflow as tf

    try:
        info: dict[str, int] = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError):
        return None
    return info


def bytes_in_use(device: str | None = None) -> int | None:
    """TensorFlow's allocator's bytes in use on `device` now (default: the main device); None before TensorFlow
    runs or when its allocator keeps no statistics."""
    device = device if device is not None else main_tf_device()
    if device is None or not environment.tensorflow_initialized():
        return None
    info = memory_info(device)
    return info["current"] if info else None


def process_rss() -> int:
    """The process's resident memory now."""
    return int(psutil.Process().memory_info().rss)
