"""Calibration: a clone of the cell's model trains at three batch sizes in a fresh process (calibrate.py runs the
probes), and the slopes measured there replace the analytic basis' (advise/prediction.py). The measured basis is
stored on the report, so a saved and reloaded report predicts what the live panel did."""

from __future__ import annotations

import time
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

from tfmem_magic.advise import calibrate
from tfmem_magic.advise.prediction import (analytic_basis, budget_for_tf, peak_at, summary)
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, Report
from tfmem_magic.core.session import SESSION


def remember_model(report: Report, model: Any, structure: dict[str, Any] | None = None) -> None:
    """Keep a weak link from a report to the live Keras model it measured (for calibrate), and what one of its
    batches held (feeding.spec_of: the probes make synthetic batches like it)."""
    _forget_dead()
    try:
        SESSION.models[id(report)] = (weakref.ref(report), weakref.ref(model), structure)
    except TypeError:  # not weak-referenceable
        pass


def _forget_dead() -> None:
    for key in [k for k, entry in SESSION.models.items() if entry[0]() is None]:
        del SESSION.models[key]


def probe_batches(report: Report, basis: Basis) -> list[int]:
    """Batch sizes for the probes: a quarter of the cell's batch, the batch, and 4x it. The slope above the cell's
    batch comes from the batch and 4x; the quarter gives the span over which the chunks of what the batch adds are
    measured, and the order check (probes out of order: noise). Below the cell's batch the analytic slope is used
    (measured_basis: the probes' slope down to a quarter missed by more). Without room for 4x in the
    budget (or after an OOM), the probes stay at and below the batch (half of it after an OOM). The room counts
    the probe's synthetic inputs too: a few batches, held twice while they become tensors."""
    batch = basis.knobs.batch_size
    budget = budget_for_tf(report)
    inputs = 2 * calibrate.PIPELINE_STEPS * 4 * batch * basis.input_per_sample
    roomy = budget is None or peak_at(basis, replace(basis.knobs, batch_size=4 * batch)) * 1.5 + inputs < 0.8 * budget
    if report.status == "ok" and roomy:
        return sorted({max(1, batch // 4), batch, 4 * batch})
    high = batch if report.status == "ok" else max(2, batch // 2)
    return sorted({max(1, high // 4), max(1, high // 2), high})


def measured_basis(report: Report, progress: Callable[[str, float], None] | None = None) -> Basis:
    """Calibrate: a clone of the cell's model trains on synthetic data at three batch sizes; the slopes of the
    requested bytes' peak between them replace the analytic one. The result is the report's basis from then on
    (`Report.whatif_basis`, saved with it), and its `prediction` block is redone on it."""
    stored = report.whatif_basis
    if stored is not None and stored.name == "measured":
        return stored
    basis = analytic_basis(report)
    if basis.knobs.replicas > 1:
        raise TfmemUsageError(f"calibration trains a clone of the model in one process; this cell ran it as one of "
                              f"{basis.knobs.replicas} replicas of a tf.distribute strategy, which the probes cannot "
                              "replay: the analytic basis stays")
    entry = SESSION.models.get(id(report))
    model = entry[1]() if entry is not None and entry[0]() is report else None
    if entry is None or model is None:
        raise TfmemUsageError("calibration needs the live Keras model of this cell: run the cell again in this "
                              "kernel (a report loaded from a file can only use the analytic basis)")
    calls = report.model.calls if report.model else []
    if "optimizer.apply" in calls and not any(c in calls for c in ("fit", "train_on_batch")):
        raise TfmemUsageError("calibration replays the cell's fit() on a clone, and this cell trained in a loop of "
                              "its own (optimizer.apply): the probes cannot replay that loop. The analytic basis "
                              "(from this cell's trace) stays in use, with its wider band.")
    batches = probe_batches(report, basis)
    started = time.perf_counter()
    train = report.model.training if report.model else True
    pipeline = report.model.fed_arrays if report.model else False
    peaks = calibrate.probe_peaks(model, batches, train, entry[2], pipeline, progress)
    if progress:
        progress("done", 1.0)
    anchor = basis.knobs.batch_size

    # The slopes are fitted on the requested bytes, which grow in a straight line with the batch, unlike BFC's
    # chunks. A probe whose trace did not see every free (a large graph's trace: requested above what the allocator
    # held, measured on EfficientNetB0: 374 MB requested at an allocator peak of 290) gives no such line: then the
    # allocator's peaks are the line, in their own chunks.
    column = 1 if all(requested <= 1.05 * allocated for allocated, requested in peaks.values()) else 0

    def slope(a: int, b: int) -> float:  # per sample, less the input pipeline's share
        per_sample = max(0.0, (peaks[b][column] - peaks[a][column]) / (b - a))
        return max(0.0, per_sample - basis.input_per_sample)

    low, high = batches[0], batches[-1]
    grown = peaks[high][1] - peaks[low][1]
    # what the batch adds is large enough to measure its chunks (not a step's noise: temporaries that overlap or
    # not, e.g. +-4 MiB on an MLP whose step barely grows with the batch)
    measurable = grown >= 0.25 * peaks[high][1]
    if column == 0:
        chunks = 1.0  # the line is in the allocator's chunks already
    elif measurable:
        chunks = (peaks[high][0] - peaks[low][0]) / grown
    else:
        chunks = basis.fragmentation

    lower = [b for b in batches if b < anchor]
    upper = [b for b in batches if b > anchor]
    line = [peaks[b][column] for b in batches]
    if line != sorted(line):  # noise-dominated: one least-squares line through all the probes
        above, below = max(0.0, _line_slope(batches, line) - basis.input_per_sample), None
    elif anchor in peaks and upper:
        above = slope(anchor, upper[-1])
        below = slope(lower[0], anchor) if lower else None
    else:  # after an OOM: the probes are all below the cell's batch
        above, below = slope(batches[-2], batches[-1]), None
    if basis.measured_peak is not None:
        # below the cell's batch, what the cell's own trace says leaves it (the analytic slope, in the cell's chunks)
        # beat the probes' slope down to a quarter of the batch: three runs of each of the 14 zoo cells
        # (benchmarks/predict_accuracy.py --zoo), each scored both ways: 57 of 84 points below the cell within 10%
        # against 48, worst 59% against 67% (the probes' one run at a small batch carries its own first step and
        # chunk reuse)
        below = basis.activations_per_sample
    parts = (basis.weights + basis.gradients + basis.optimizer + basis.input_copy
             + (above + basis.input_per_sample) * anchor)
    other = (round(basis.measured_peak / basis.fragmentation + basis.copy_missing - parts)
             if basis.measured_peak is not None else 0)
    measured = replace(basis, name="measured", activations_per_sample=above, activations_per_sample_below=below,
                       other=other, slope_source="probe runs", increment_fragmentation=min(2.0, max(1.0, chunks)),
                       calibration={"batches": batches, "peak_bytes": [peaks[b][0] for b in batches],
                                    "requested_bytes": [peaks[b][1] for b in batches],
                                    "seconds": round(time.perf_counter() - started, 2)})
    report.whatif_basis = measured
    report.prediction = summary(report)
    return measured


def _line_slope(xs: list[int], ys: Sequence[float]) -> float:
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
