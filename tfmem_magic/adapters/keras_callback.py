"""A Keras callback for scripts and long training: TensorFlow's and the process's memory peak per epoch (or per N
batches), in the logs that History, the progress bar and TensorBoard read; optionally a full traced report of the
first steps. No IPython here; TensorFlow and Keras are imported by the caller (`tfmem_magic.keras`).

This module wires Keras' hooks to the peak windows of `measure/window.py`, which do the reading.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfmem_magic.analyze.growth import GROWTH_EPOCHS, steady_growth
from tfmem_magic.core.errors import MemoryGrowthWarning, TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import Report, file_stem
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import environment, kerases
from tfmem_magic.measure.window import PeakWindow, stats_device
from tfmem_magic.show.saving import save_report

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tfmem_magic.pipeline import Profiler

TF_PEAK, RSS_PEAK = "tf_peak_bytes", "rss_peak_bytes"
Logs = dict[str, Any]  # what Keras hands each hook: the logs our figures go into


def callback_base() -> type:
    """The Callback class of the Keras the user's models are made with: tf_keras under TF_USE_LEGACY_KERAS=1."""
    base: type = kerases.import_flavour(kerases.in_use()).callbacks.Callback
    return base


class MemoryMonitorMixin:
    """The callback's logic; `tfmem_magic.keras.MemoryMonitor` puts it on the right Keras' Callback class."""

    def __init__(
        self,
        every: str | int = "epoch",
        trace_steps: int = 0,
        save: str | os.PathLike[str] | None = None,
        device: str | None = None,
        warn_growth: bool = True,
        verbose: bool = False,
    ) -> None:
        super().__init__()
        if every not in ("epoch", "batch") and not (
            isinstance(every, int) and not isinstance(every, bool) and every >= 1
        ):
            raise TfmemUsageError(
                f"MemoryMonitor(every={every!r}): use 'epoch', 'batch', or a number of batches (e.g. every=100)"
            )
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
        self._window: PeakWindow | None = None
        self._epoch_peaks: tuple[int | None, int] = (None, 0)  # the epoch's max over its batch windows
        self._epoch: int | None = None
        self._call: str | None = None
        self._profiler: Profiler | None = None
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
        self.device = stats_device(self._asked_device)
        self._check_allocator()
        self._window = PeakWindow(self.device)
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
            warnings.warn(
                f"MemoryMonitor: {view.note or 'TensorFlow allocator statistics are incomplete.'} (In a "
                "script: import tfmem_magic.keras, or call tfmem_magic.prepare(), before TensorFlow's first "
                "op.)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _close(self, logs: Logs | None, kind: str, epoch: int | None = None, batch: int | None = None) -> None:
        """Read and record the open window (kind: "epoch", "batches" or "call"); its figures go into `logs`."""
        if self._window is None:
            return
        tf_peak, rss_peak = self._window.close()
        self._window = None
        self._record(kind, epoch, batch, tf_peak, rss_peak, logs)
        old_tf, old_rss = self._epoch_peaks
        self._epoch_peaks = (old_tf if tf_peak is None else max(tf_peak, old_tf or 0), max(rss_peak, old_rss))

    def _record(
        self, kind: str, epoch: int | None, batch: int | None, tf_peak: int | None, rss_peak: int, logs: Logs | None
    ) -> None:
        self.records.append(
            {"call": self._call, "kind": kind, "epoch": epoch, "batch": batch, TF_PEAK: tf_peak, RSS_PEAK: rss_peak}
        )
        if logs is not None:
            logs[TF_PEAK] = tf_peak if tf_peak is not None else float("nan")
            logs[RSS_PEAK] = rss_peak

    def _end(self, logs: Logs | None, call: str) -> None:
        if self._call != call:
            return
        self._close(logs, "call")
        self._finish_trace("the call ended before its traced steps did")
        self._call = None
        self._save_records()  # a standalone evaluate or predict (no fit) is saved too

    # ---- fit --------------------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._begin("fit")
        if self.trace_steps and self.report is None:
            self._start_trace()

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if self._window is None:  # the first epoch's window opened with the fit: its set-up counts too
            self._window = PeakWindow(self.device)
        self._epoch = epoch
        self._epoch_peaks = (None, 0)
        self._window_first_batch = 0

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._profiler is not None:
            self._steps_traced += 1
            if self._steps_traced >= self.trace_steps:
                self._finish_trace(None)
        # by batch index, not by calls: with steps_per_execution > 1 Keras calls this once per execution
        if self.every_batches and batch + 1 - self._window_first_batch >= self.every_batches:
            self._close(logs, "batches", self._epoch, batch)
            self._window = PeakWindow(self.device)
            self._window_first_batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.every_batches:  # the last batches' window, then the epoch: the largest of its windows
            self._close(None, "batches", epoch, None)
            self._record("epoch", epoch, None, *self._epoch_peaks, logs)
        else:
            self._close(logs, "epoch", epoch)
        tf_peak, rss_peak = self._epoch_peaks
        self._fit_epoch_peaks.append(tf_peak)
        if self.verbose:
            print(
                f"MemoryMonitor: epoch {epoch + 1}: TensorFlow peak "
                f"{format_bytes(tf_peak) if tf_peak is not None else 'not measured'} on {self.device}, "
                f"process RSS peak {format_bytes(rss_peak)}"
            )
        self._check_growth()

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._window = None  # the last epoch is recorded; what follows it is not an epoch
        self._finish_trace("fit ended before its traced steps did")
        self._call = None
        self._save_records()

    # ---- evaluate and predict ---------------------------------------------------------------------------------
    def on_test_begin(self, logs: Logs | None = None) -> None:
        self._begin("evaluate")

    def on_test_end(self, logs: Logs | None = None) -> None:
        self._end(logs, "evaluate")

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        self._begin("predict")

    def on_predict_end(self, logs: Logs | None = None) -> None:
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
        peaks = steady_growth(self._fit_epoch_peaks) if self.warn_growth and not self._warned else None
        if peaks is not None:
            self._warned = True
            warnings.warn(
                f"TensorFlow's peak on {self.device} grew in each of the last {GROWTH_EPOCHS} epochs ("
                f"{' → '.join(format_bytes(p) for p in peaks)}, about "
                f"{format_bytes((peaks[-1] - peaks[0]) // (len(peaks) - 1))} per "
                "epoch): something is kept from epoch to epoch (a callback or metric collecting tensors, a growing "
                "tf.data cache, a tf.function retraced for new Python values). At this rate the run needs that "
                "much more memory every epoch.",
                MemoryGrowthWarning,
                stacklevel=2,
            )

    # ---- the traced report of the first steps -----------------------------------------------------------------
    def _start_trace(self) -> None:
        from tfmem_magic.core.options import Options
        from tfmem_magic.pipeline import Profiler

        name = getattr(getattr(self, "model", None), "name", "model")
        profiler = Profiler(
            Options(
                mode="trace",
                label=f"{name}: first {self.trace_steps} steps of fit",
                trace_steps=self.trace_steps,
                publish=False,
            )
        )
        if self._window is not None:
            self._window.fold_current()
        try:
            profiler.start()
        except Exception as exc:  # noqa: BLE001 - never break the user's fit for our trace
            fallback(_log, "MemoryMonitor could not trace the first steps", exc)
            warnings.warn(
                f"MemoryMonitor: the first steps could not be traced ({type(exc).__name__}: {exc}); the "
                "per-epoch figures are measured as usual.",
                RuntimeWarning,
                stacklevel=2,
            )
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
        except Exception as exc:  # noqa: BLE001 - our failure must not break the user's fit
            fallback(_log, "MemoryMonitor's traced report failed", exc)
            warnings.warn(
                f"MemoryMonitor: the traced report of the first steps failed ({type(exc).__name__}: "
                f"{exc}); the per-epoch figures are measured as usual.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if self._window is not None:
            self._window.fold_report(report)
        if why:
            report.notes.append(f"MemoryMonitor: {why} (traced {self._steps_traced} of {self.trace_steps}).")
        self.report = report
        stem = f"tfmem-{file_stem(report.label.split(':')[0], 'model')}-first-steps"
        self._save(
            "the report",
            lambda folder: [save_report(report, folder / (stem + suffix)) for suffix in (".json", ".html")],
        )

    def _save_records(self) -> None:
        """`save=DIR`: every window so far into DIR/tfmem-epochs.json, at the end of each fit, evaluate and predict."""
        self._save(
            "the figures",
            lambda folder: (folder / "tfmem-epochs.json").write_text(
                json.dumps({"device": self.device, "records": self.records}, indent=1)
            ),
        )

    def _save(self, what: str, write: Callable[[Path], object]) -> None:
        """`save=DIR`: write into DIR; a folder that cannot be written costs a warning, never the user's fit."""
        if self.save_dir is None:
            return
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            write(self.save_dir)
        except OSError as exc:
            warnings.warn(
                f"MemoryMonitor: could not save {what} in {self.save_dir} ({exc})", RuntimeWarning, stacklevel=3
            )
