"""A Keras callback for scripts and long training: TensorFlow's and the process's memory peak per epoch (or per N
batches), in the logs that History, the progress bar and TensorBoard read; optionally a full traced report of the
first steps. No IPython here; TensorFlow and Keras are imported by the caller (`tfmem_magic.keras`).

The allocator's peak counter is process-wide: each window reads it and resets it. A `%%tfmem` cell measuring the
same fit keeps its own peak (the window folds what it read into every measurement in progress, as nested cells do).
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path
from typing import Any

from tfmem_magic.core.errors import MemoryGrowthWarning, TfmemUsageError
from tfmem_magic.core.report import Report, file_stem, main_device_name
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import environment, kerases
from tfmem_magic.measure.sampling import AllocatorStats, _read_hwm, _reset_hwm, fold_into_measuring

TF_PEAK, RSS_PEAK = "tf_peak_bytes", "rss_peak_bytes"
GROWTH_EPOCHS = 3  # epochs in a row whose peak grew before the growth is called a leak
GROWTH_MIN = 1 << 20  # ... each by at least this (and 0.5% of the peak): allocator noise is smaller


def callback_base() -> type:
    """The Callback class of the Keras the user's models are made with: tf_keras under TF_USE_LEGACY_KERAS=1."""
    return kerases.import_flavour(kerases.in_use()).callbacks.Callback


class _Window:
    """One reading of the peaks: TF's peak counter and the kernel's RSS high-water mark, reset at its start."""

    def __init__(self, device: str | None) -> None:
        self.device = device
        self.rss_start = _rss()
        self.folded_tf, self.folded_rss = 0, 0  # peaks read before a measurement inside the window reset them
        # an enclosing measurement (a %%tfmem cell) keeps its RSS peak only if we leave the high-water mark alone;
        # then a high-water mark that rose during the window is the window's peak
        self.hwm_reset = not SESSION.measuring and _reset_hwm()
        self.hwm_start = None if self.hwm_reset else _read_hwm()
        if device is not None:
            info = AllocatorStats._info(device)
            if info is not None:
                fold_into_measuring(device, info["peak"])
                import tensorflow as tf

                tf.config.experimental.reset_memory_stats(device)

    def fold_current(self) -> None:
        """Keep the peaks so far: a measurement that starts inside the window (the traced first steps) resets
        TensorFlow's counter and the high-water mark."""
        info = AllocatorStats._info(self.device) if self.device is not None else None
        if info is not None:
            self.folded_tf = max(self.folded_tf, int(info["peak"]))
        self.folded_rss = max(self.folded_rss, (_read_hwm() if self.hwm_reset else None) or _rss())

    def fold_report(self, report: Report) -> None:
        mem = report.tf.get(self.device) if self.device is not None else None
        if mem is not None:
            self.folded_tf = max(self.folded_tf, mem.peak_bytes)
        self.folded_rss = max(self.folded_rss, report.rss.peak_bytes)

    def close(self) -> tuple[int | None, int]:
        """(TF peak bytes in use on the device, RSS peak bytes) since the window opened."""
        tf_peak = None
        if self.device is not None:
            info = AllocatorStats._info(self.device)
            if info is not None:
                tf_peak = max(int(info["peak"]), self.folded_tf)
                fold_into_measuring(self.device, tf_peak)
        rss_end = _rss()
        hwm = _read_hwm()
        if not self.hwm_reset and (hwm is None or self.hwm_start is None or hwm <= self.hwm_start):
            hwm = None  # the process's high-water mark is older than this window: it says nothing of it
        return tf_peak, max(hwm or 0, self.rss_start, rss_end, self.folded_rss)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _stats_device(device: str | None) -> str | None:
    """The device to read: the one asked for, else the first GPU, else the CPU, among those keeping statistics."""
    if not environment.tensorflow_initialized():
        import tensorflow as tf

        tf.constant(0)  # create the devices: the model is about to run anyway
    names = [d for d in AllocatorStats._device_names() if AllocatorStats._info(d) is not None]
    if device is not None:
        if device not in names:
            raise TfmemUsageError(f"MemoryMonitor(device={device!r}): TensorFlow keeps no memory statistics for that "
                                  f"device here (devices with statistics: {', '.join(names) or 'none'})")
        return device
    return main_device_name(names)


class MemoryMonitorMixin:
    """The callback's logic; `tfmem_magic.keras.MemoryMonitor` puts it on the right Keras' Callback class."""

    def __init__(self, every: str | int = "epoch", trace_steps: int = 0, save: str | os.PathLike | None = None,
                 device: str | None = None, warn_growth: bool = True, verbose: bool = False) -> None:
        super().__init__()
        if every not in ("epoch", "batch") and not (isinstance(every, int) and not isinstance(every, bool)
                                                    and every >= 1):
            raise TfmemUsageError(f"MemoryMonitor(every={every!r}): use 'epoch', 'batch', or a number of batches "
                                  "(e.g. every=100)")
        if not isinstance(trace_steps, int) or isinstance(trace_steps, bool) or trace_steps < 0:
            raise TfmemUsageError(f"MemoryMonitor(trace_steps={trace_steps!r}): a number of steps, 0 for none")
        self.every_batches = None if every == "epoch" else (1 if every == "batch" else int(every))
        self.trace_steps = trace_steps
        self.save_dir = Path(save) if save is not None else None
        self.warn_growth = warn_growth
        self.verbose = verbose
        self._asked_device = device
        self.device: str | None = None
        # one per window: call (fit/evaluate/predict), kind (epoch/batches/call), epoch, batch, tf/rss peak bytes
        self.records: list[dict[str, Any]] = []
        self.report: Report | None = None  # the traced report of the first steps (trace_steps > 0)
        self._window: _Window | None = None
        self._epoch_peaks: tuple[int | None, int] = (None, 0)  # the epoch's max over its batch windows
        self._epoch: int | None = None
        self._call: str | None = None
        self._profiler: Any = None
        self._steps_traced = 0
        self._warned = False
        self._allocator_warned = False
        self._window_first_batch = 0  # the first batch of the open batch window (steps_per_execution > 1 skips)
        self._fit_epoch_peaks: list[int | None] = []  # this fit's epochs: growth is judged within one fit
        environment.prepare_allocator()  # before TensorFlow's first op, every allocation becomes visible

    # ---- windows --------------------------------------------------------------------------------------------
    def _begin(self, call: str) -> None:
        if self._call == "fit" and call != "fit":
            return  # fit's validation (evaluate's hooks), or a predict in a callback: part of the epoch
        if self._call is not None:  # an earlier call raised: Keras calls no end hook, so its state is still here
            self._window = None
            self._call = None
        self._finish_trace("the call raised before its traced steps ended")
        self._call = call
        self.device = _stats_device(self._asked_device)
        self._check_allocator()
        self._window = _Window(self.device)
        self._epoch_peaks = (None, 0)
        self._window_first_batch = 0
        if call == "fit":
            self._fit_epoch_peaks = []

    def _check_allocator(self) -> None:
        if self.device is not None and not self.device.startswith("CPU"):
            return  # a GPU's allocator sees every allocation; the CPU allocator's set-up does not matter here
        view = environment.allocator_view()
        if not view.complete and not self._allocator_warned:
            self._allocator_warned = True
            warnings.warn(f"MemoryMonitor: {view.note or 'TensorFlow allocator statistics are incomplete.'} (In a "
                          "script: import tfmem_magic.keras, or call tfmem_magic.prepare(), before TensorFlow's first "
                          "op.)", RuntimeWarning,
                          stacklevel=3)

    def _close(self, logs: dict | None, kind: str, epoch: int | None = None, batch: int | None = None) -> None:
        """Read and record the open window (kind: "epoch", "batches" or "call"); its figures go into `logs`."""
        if self._window is None:
            return
        tf_peak, rss_peak = self._window.close()
        self._window = None
        self._record(kind, epoch, batch, tf_peak, rss_peak, logs)
        old_tf, old_rss = self._epoch_peaks
        self._epoch_peaks = (old_tf if tf_peak is None else max(tf_peak, old_tf or 0), max(rss_peak, old_rss))

    def _record(self, kind: str, epoch: int | None, batch: int | None, tf_peak: int | None, rss_peak: int,
                logs: dict | None) -> None:
        self.records.append({"call": self._call, "kind": kind, "epoch": epoch, "batch": batch, TF_PEAK: tf_peak,
                             RSS_PEAK: rss_peak})
        if logs is not None:
            logs[TF_PEAK] = tf_peak if tf_peak is not None else float("nan")
            logs[RSS_PEAK] = rss_peak

    def _end(self, logs: dict | None, call: str) -> None:
        if self._call != call:
            return
        self._close(logs, "call")
        self._finish_trace("the call ended before its traced steps did")
        self._call = None
        self._save_records()  # a standalone evaluate or predict (no fit) is saved too

    # ---- fit --------------------------------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        self._begin("fit")
        if self.trace_steps and self.report is None:
            self._start_trace()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._window is None:  # the first epoch's window opened with the fit: its set-up counts too
            self._window = _Window(self.device)
        self._epoch = epoch
        self._epoch_peaks = (None, 0)
        self._window_first_batch = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._profiler is not None:
            self._steps_traced += 1
            if self._steps_traced >= self.trace_steps:
                self._finish_trace(None)
        # by batch index, not by calls: with steps_per_execution > 1 Keras calls this once per execution
        if self.every_batches and batch + 1 - self._window_first_batch >= self.every_batches:
            self._close(logs, "batches", self._epoch, batch)
            self._window = _Window(self.device)
            self._window_first_batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.every_batches:  # the last batches' window, then the epoch: the largest of its windows
            self._close(None, "batches", epoch, None)
            self._record("epoch", epoch, None, *self._epoch_peaks, logs)
        else:
            self._close(logs, "epoch", epoch)
        tf_peak, rss_peak = self._epoch_peaks
        self._fit_epoch_peaks.append(tf_peak)
        if self.verbose:
            print(f"MemoryMonitor: epoch {epoch + 1}: TensorFlow peak "
                  f"{format_bytes(tf_peak) if tf_peak is not None else 'not measured'} on {self.device}, "
                  f"process RSS peak {format_bytes(rss_peak)}")
        self._check_growth()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._window = None  # the last epoch is recorded; what follows it is not an epoch
        self._finish_trace("fit ended before its traced steps did")
        self._call = None
        self._save_records()

    # ---- evaluate and predict ---------------------------------------------------------------------------------
    def on_test_begin(self, logs: dict | None = None) -> None:
        self._begin("evaluate")

    def on_test_end(self, logs: dict | None = None) -> None:
        self._end(logs, "evaluate")

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._begin("predict")

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._end(logs, "predict")

    @property
    def last(self) -> dict[str, Any] | None:
        """The last window's record (evaluate's and predict's figures are here: Keras gives on_test_end a copy of
        the logs that evaluate returns, and predict returns no logs)."""
        return self.records[-1] if self.records else None

    # ---- growth across epochs ---------------------------------------------------------------------------------
    def epoch_peaks(self) -> list[int | None]:
        """TensorFlow's peak of each epoch of the fits seen so far."""
        return [r[TF_PEAK] for r in self.records if r["kind"] == "epoch"]

    def _check_growth(self) -> None:
        # within this fit only: separate fits (a batch-size sweep with one monitor) may differ by design
        peaks = [p for p in self._fit_epoch_peaks[-(GROWTH_EPOCHS + 1):] if p is not None]
        if self._warned or not self.warn_growth or len(peaks) < GROWTH_EPOCHS + 1:
            return
        steps = [b - a for a, b in itertools.pairwise(peaks)]
        if all(b - a > max(GROWTH_MIN, 0.005 * b) for a, b in itertools.pairwise(peaks)):
            self._warned = True
            warnings.warn(
                f"TensorFlow's peak on {self.device} grew in each of the last {GROWTH_EPOCHS} epochs ("
                f"{' → '.join(format_bytes(p) for p in peaks)}, about {format_bytes(sum(steps) // len(steps))} per "
                "epoch): something is kept from epoch to epoch (a callback or metric collecting tensors, a growing "
                "tf.data cache, a tf.function retraced for new Python values). At this rate the run needs that "
                "much more memory every epoch.", MemoryGrowthWarning, stacklevel=2)

    # ---- the traced report of the first steps -----------------------------------------------------------------
    def _start_trace(self) -> None:
        from tfmem_magic.core.options import Options
        from tfmem_magic.pipeline import Profiler

        name = getattr(getattr(self, "model", None), "name", "model")
        profiler = Profiler(Options(mode="trace", label=f"{name}: first {self.trace_steps} steps of fit",
                                    trace_steps=self.trace_steps, publish=False))
        if self._window is not None:
            self._window.fold_current()
        try:
            profiler.start()
        except Exception as exc:  # never break the user's fit for our trace
            warnings.warn(f"MemoryMonitor: the first steps could not be traced ({type(exc).__name__}: {exc}); the "
                          "per-epoch figures are measured as usual.", RuntimeWarning, stacklevel=2)
            return
        self._profiler, self._steps_traced = profiler, 0
        SESSION.abandoned.append(self._abandon_trace)  # if fit raises in a traced step, the next measurement ends it

    def _abandon_trace(self) -> None:
        self._finish_trace("fit raised before its traced steps ended")

    def _finish_trace(self, why: str | None) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if self._abandon_trace in SESSION.abandoned:
            SESSION.abandoned.remove(self._abandon_trace)
        try:
            report = profiler.finish(None)
        except Exception as exc:  # our failure must not break the user's fit
            warnings.warn(f"MemoryMonitor: the traced report of the first steps failed ({type(exc).__name__}: "
                          f"{exc}); the per-epoch figures are measured as usual.", RuntimeWarning, stacklevel=2)
            return
        if self._window is not None:
            self._window.fold_report(report)
        if why:
            report.notes.append(f"MemoryMonitor: {why} (traced {self._steps_traced} of {self.trace_steps}).")
        self.report = report
        if self.save_dir is not None:
            from tfmem_magic.adapters.arguments import save_report

            self.save_dir.mkdir(parents=True, exist_ok=True)
            stem = self.save_dir / f"tfmem-{file_stem(report.label.split(':')[0], 'model')}-first-steps"
            try:
                save_report(report, stem.with_suffix(".json"))
                save_report(report, stem.with_suffix(".html"))
            except OSError as exc:
                warnings.warn(f"MemoryMonitor: could not save the report in {self.save_dir} ({exc})", RuntimeWarning,
                              stacklevel=2)

    def _save_records(self) -> None:
        """`save=DIR`: every window so far into DIR/tfmem-epochs.json, at the end of each fit, evaluate and predict."""
        if self.save_dir is None:
            return
        import json

        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            (self.save_dir / "tfmem-epochs.json").write_text(json.dumps(
                {"device": self.device, "records": self.records}, indent=1))
        except OSError as exc:
            warnings.warn(f"MemoryMonitor: could not save the figures in {self.save_dir} ({exc})", RuntimeWarning,
                          stacklevel=2)

