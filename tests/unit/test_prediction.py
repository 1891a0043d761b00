"""The measured basis' arithmetic on given probe results: slopes fitted on requested bytes, the cell's own peak
given back at its settings, chunks for what a knob adds from the probes, and noisy probes handled. The probes
themselves (a fresh process training a clone) are run for real in tests/integration/test_diagnosis_predict.py;
here they are the collaborator, replaced by fixed numbers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_fixes import report

from tfmem_magic.advise import calibrate, prediction

MiB = 2**20


class FakeModel:
    """Stands for the live Keras model the report remembers (only its identity matters here)."""


def calibrated(monkeypatch, peaks: dict[int, tuple[int, int]]):
    rep = report(batch=256)
    rep.env.budget_bytes = 24 * 1024 * MiB  # room for the probe at 4x the batch
    model = FakeModel()
    prediction.remember_model(rep, model)
    asked = []
    monkeypatch.setattr(calibrate, "probe_peaks", lambda m, batches, *rest: asked.append(batches) or peaks)
    basis = prediction.measured_basis(rep)
    return rep, basis, asked, model


def test_slopes_come_from_requested_bytes_and_the_cells_peak_is_given_back(monkeypatch):
    # requested bytes: 10 MiB + 0.2 MiB per sample; the probes' chunks are 1.1x what they requested
    peaks = {b: (round(1.1 * (10 * MiB + b * 0.2 * MiB)), round(10 * MiB + b * 0.2 * MiB)) for b in (128, 256, 1024)}
    rep, basis, asked, _ = calibrated(monkeypatch, peaks)
    assert asked == [[128, 256, 1024]] and basis.name == "measured"
    assert basis.activations_per_sample + basis.input_per_sample == pytest.approx(0.2 * MiB, rel=1e-6)
    assert basis.increment_fragmentation == pytest.approx(1.1)
    same = prediction.predict(rep)
    assert same.basis == "measured" and same.peak_bytes == pytest.approx(rep.tf_peak_bytes, rel=1e-3)
    # what the larger batch adds: 768 more samples of requested bytes, in the probes' chunks (not the cell's 1.3x)
    bigger = prediction.predict(rep, batch_size=1024)
    assert bigger.peak_bytes - same.peak_bytes == pytest.approx(768 * 0.2 * MiB * 1.1, rel=1e-3)
    smaller = prediction.predict(rep, batch_size=128)
    assert same.peak_bytes - smaller.peak_bytes == pytest.approx(128 * 0.2 * MiB * 1.1, rel=1e-3)


def test_probes_out_of_order_give_one_least_squares_line_and_the_cells_chunks(monkeypatch):
    # a step that barely grows with the batch: the probes' requested peaks are noise (128 above 256)
    peaks = {128: (15 * MiB, 18 * MiB), 256: (15 * MiB, 14 * MiB), 1024: (16 * MiB, 19 * MiB)}
    rep, basis, _, _ = calibrated(monkeypatch, peaks)
    line = np.polyfit([128, 256, 1024], [18 * MiB, 14 * MiB, 19 * MiB], 1)[0]  # ~3 KiB per sample
    assert basis.activations_per_sample == pytest.approx(max(0.0, line - basis.input_per_sample))
    assert basis.activations_per_sample_below is None
    # 1 MiB of growth in 19 MiB cannot say how the allocator chunks it: the cell's own ratio is kept
    assert basis.increment_fragmentation == pytest.approx(basis.fragmentation)


def test_calibration_is_cached_per_report_and_needs_the_live_model(monkeypatch):
    peaks = {b: (2 * b * MiB // 10, b * MiB // 10) for b in (128, 256, 1024)}
    rep, basis, asked, model = calibrated(monkeypatch, peaks)
    assert prediction.measured_basis(rep) is basis and len(asked) == 1
    other = report(batch=256)
    with pytest.raises(prediction.TfmemUsageError, match="live Keras model"):
        prediction.measured_basis(other)
    assert model is not None  # the live model stays referenced until here


def test_the_4x_probe_needs_room_for_its_peak_and_its_synthetic_inputs():
    rep = report(batch=256)
    basis = prediction.analytic_basis(rep)
    peak_4x = prediction.peak_at(basis, replace(basis.knobs, batch_size=1024))
    inputs = 2 * calibrate.PIPELINE_STEPS * 1024 * basis.input_per_sample  # 4 steps of 4x the batch, held twice
    assert inputs > 0
    # room for the 4x probe's peak (with its margin) but not for its inputs as well: the probes stay at and below
    rep.env.budget_bytes = rep.rss.baseline_bytes + round((peak_4x * 1.5 + inputs / 2) / 0.8)
    assert prediction.probe_batches(rep, basis) == [64, 128, 256]
    rep.env.budget_bytes = rep.rss.baseline_bytes + round((peak_4x * 1.5 + inputs * 2) / 0.8)
    assert prediction.probe_batches(rep, basis) == [128, 256, 1024]


def test_suggested_batches_are_ones_people_type():
    assert [prediction.typeable_batch(n) for n in (1, 2, 3, 13, 15, 16, 23, 159, 251, 256)] == \
        [1, 2, 2, 12, 14, 16, 16, 152, 248, 256]
    assert prediction.typeable_batch(159, step=3) == 144  # a multiple of 8 and of the accumulation steps
    assert prediction.typeable_batch(20, step=3) == 18  # below lcm(8, 3): steps' multiple only
    assert prediction.typeable_batch(2, step=4) == 4  # never below one accumulation step


def test_the_largest_batch_that_fits_is_a_typeable_one():
    r = report()
    basis = prediction.analytic_basis(r)
    for budget in (40, 90, 300, 1000):
        fit = prediction.largest_batch(basis, basis.knobs, budget * 2**20, prediction.ANALYTIC_BAND)
        if fit is not None and fit < prediction.MAX_BATCH:
            assert fit % (8 if fit >= 16 else 2 if fit >= 2 else 1) == 0, (budget, fit)
