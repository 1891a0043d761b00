"""The pre-flight's arithmetic: the line through two probe steps, the verdict against the guard's threshold, the
largest batch, and the refusal's words. The probes themselves (a clone in another process) are a collaborator
here: they run for real in tests/integration/test_preflight.py."""

from __future__ import annotations

import pytest

from tfmem_magic.advise import preflight
from tfmem_magic.advise.preflight import BAND, line_through
from tfmem_magic.core.report import PreflightInfo
from tfmem_magic.measure.instrument import ModelUse

MiB = 2**20


def test_the_line_extrapolates_requested_bytes_in_large_tensors_chunks():
    # requested grows 10 MiB per 64 samples; at the larger probe the chunks were 1.4x (a region just doubled): a
    # batch 8x larger gets the chunks large tensors get, at most GROWTH_FRAGMENTATION
    at = line_through({64: (30 * MiB, 20 * MiB), 128: (42 * MiB, 30 * MiB)})
    assert at(1024) == pytest.approx((30 * MiB + (1024 - 128) * (10 * MiB / 64)) * preflight.GROWTH_FRAGMENTATION)
    tight = line_through({64: (20 * MiB, 20 * MiB), 128: (30 * MiB, 30 * MiB)})  # 1.0x stays 1.0x
    assert tight(1024) == pytest.approx(30 * MiB + 896 * 10 * MiB / 64)


def test_a_probe_whose_trace_missed_frees_gives_the_allocators_line():
    # requested above allocated: the probe's trace did not see every free, so its requested bytes are no line
    at = line_through({8: (10 * MiB, 30 * MiB), 16: (14 * MiB, 60 * MiB)})
    assert at(32) == pytest.approx(14 * MiB + 16 * (4 * MiB / 8))


class _Model:
    optimizer = None
    trainable_variables: list = []


def _use(batch: int) -> ModelUse:
    return ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=batch, feed="dataset")


@pytest.mark.parametrize("threshold, verdict", [(10_000 * MiB, "fits"), (1_100 * MiB, "uncertain"),
                                                (600 * MiB, "refused")])
def test_the_verdict_uses_the_band_both_ways(monkeypatch, threshold, verdict):
    # a step that needs 1 MiB per sample (chunks 1.0x), no probes' floor: 1 GiB at batch 1024, 100 MiB held now
    monkeypatch.setattr(preflight.calibrate, "probe_peaks",
                        lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches})
    info = preflight.check(_Model(), "fit", _use(1024), threshold, rss=100 * MiB)
    assert info.basis == "probes" and info.probe_batches == [64, 128]
    assert info.step_bytes == 1024 * MiB and info.predicted_rss_bytes == 1124 * MiB
    assert info.verdict == verdict
    if verdict != "fits":  # the largest batch whose growth, 1 MiB per sample, fits with its band: (room / 1.25)
        expected = int((threshold - 100 * MiB) / (1 + BAND) // MiB)
        assert info.largest_batch == preflight.typeable_batch(expected)


def test_the_allocators_free_regions_absorb_the_growth(monkeypatch):
    """RSS never shrinks: regions TF already holds (an earlier, larger step) are reused before the process grows."""
    monkeypatch.setattr(preflight.calibrate, "probe_peaks",
                        lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches})
    info = preflight.check(_Model(), "fit", _use(1024), 10_000 * MiB, rss=2000 * MiB, tf_current=100 * MiB,
                           tf_held=900 * MiB)
    assert info.predicted_rss_bytes == 2000 * MiB + (100 + 1024 - 900) * MiB


def test_the_refusal_says_what_was_predicted_against_what_is_allowed_and_what_to_do():
    info = PreflightInfo(call="fit", batch_size=1024, probe_batches=[64, 128], step_bytes=4 * 2**30,
                         extra_bytes=100 * MiB, rss_bytes=800 * MiB, predicted_rss_bytes=5 * 2**30,
                         threshold_bytes=3 * 10**9, band=0.25, verdict="refused", largest_batch=352, seconds=8.6)
    text = preflight.refusal(info, "--limit")
    for said in ("stopped fit() before its first step", "at batch 1024", "~5 GiB", "--limit allows 2.79 GiB",
                 "Lower the batch size to 352", "%tfmem fix shrink-batch", "batches 64 and 128", "8.6 s",
                 "--no-preflight"):
        assert said in text, said
    info.largest_batch = None
    assert "Not even batch 1 fits" in preflight.refusal(info, "--limit")


def test_a_batch_too_small_to_extrapolate_is_left_to_the_guard():
    with pytest.raises(preflight.TfmemUsageError, match="too small"):
        preflight.check(_Model(), "fit", _use(1), 10**9, rss=0)
