"""Pre-flight: predict a fit/evaluate/predict's step before it runs, and refuse one that will not fit the limit.

Why: once TensorFlow runs, its allocator can no longer be capped, and the guard's batch-end check and watchdog act
between steps. One training step is one C++ call, so a step that outgrows the limit runs to its end (measured: a
CNN's `fit` at batch 1024 under `--limit 3GB` took the process to 5.22 GiB before the batch-end check could stop
it; on a machine with 3 GB the kernel would have died).

How: a clone of the model runs a step at two small batches in another process (`calibrate.probe_peaks`: each
probe's TF allocator peak over its step's start, and the bytes its step requested), and the line through the two
predicts the call's step at its own batch: requested bytes grow in a straight line with the batch, and what the
batch adds gets the chunks the probes measured for it. Added to it, from the live model: the optimizer's slots when
the optimizer is not built yet, and fit's copy of numpy arrays. The allocator's regions already held (RSS never
shrinks: TF keeps them) absorb part of the growth. The process's memory then is compared with the guard's
threshold, with a band for the extrapolation:
- the low end of the band (on what the process grows by) does not fit: the call is refused before its first step
  (`PreflightRefused`), with the predicted peak, the room and the largest batch that fits;
- the high end fits: the call runs, and the report compares the prediction with what was measured;
- in between: the call runs, and the guard watches it as before.
Most calls fit with room to spare: when the model's own parts (its layer outputs, several times over) fit, no probe
runs and the pre-flight costs nothing. The probes run at 1/16 and 1/8 of the batch (a step that needs 4 GB costs
them 250 and 500 MB, in their own process), so the line is extrapolated 8x: BAND is that extrapolation's error,
measured in docs/preflight.md.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from tfmem_magic.advise import calibrate
from tfmem_magic.advise.prediction import GROWTH_FRAGMENTATION, OPTIMIZER_SLOTS, activation_bytes, typeable_batch
from tfmem_magic.analyze.modelinfo import describe_model
from tfmem_magic.core.errors import PreflightRefused, TfmemUsageError
from tfmem_magic.core.report import PreflightInfo
from tfmem_magic.core.sizes import format_bytes, variable_bytes
from tfmem_magic.measure.instrument import ModelUse

BAND = 0.25  # the extrapolation's error: docs/preflight.md
MODEL_MARGIN = 3.0  # how far inside the limit the model's own estimate must be to skip the probes
PROBE_FRACTION = 8  # the larger probe runs 1/PROBE_FRACTION of the batch, the smaller half of that


class Preflight:
    """The pre-flights of one measured cell: each fit/evaluate/predict is checked before it runs (once per model,
    call and batch), and the last result goes into the report."""

    def __init__(self) -> None:
        self.results: list[PreflightInfo] = []
        self.notes: list[str] = []
        self._done: set[tuple[int, str, int]] = set()

    def __call__(self, model: Any, call: str, use: ModelUse, threshold: int, rss: int, source: str,
                 tf_current: int = 0, tf_held: int = 0) -> None:
        batch = use.batch_size
        if not batch:
            self._note(f"The pre-flight skipped {call}(): the batch size is known only once it runs ({use.feed}).")
            return
        key = (id(model), call, batch)
        if key in self._done:
            return
        self._done.add(key)
        started = time.perf_counter()
        try:
            info = check(model, call, use, threshold, rss, tf_current, tf_held)
        except TfmemUsageError as exc:  # a model the probes cannot rebuild, no allocator stats, ...
            self._note(f"The pre-flight could not check {call}() at batch {batch}: {exc}")
            return
        info.seconds = round(time.perf_counter() - started, 2)
        self.results.append(info)
        if info.verdict == "refused":
            raise PreflightRefused(refusal(info, source))
        if info.verdict == "uncertain":
            self._note(f"Pre-flight of {call}() at batch {batch}: the predicted peak "
                       f"({format_bytes(info.predicted_rss_bytes)} for the process) is within ±{info.band:.0%} of "
                       f"what {source} allows ({format_bytes(info.threshold_bytes)}): it ran, and the guard "
                       "watched it.")

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def check(model: Any, call: str, use: ModelUse, threshold: int, rss: int, tf_current: int = 0,
          tf_held: int = 0) -> PreflightInfo:
    """Predict `call`'s step at its batch from two probe steps of a clone, and say whether the process stays under
    `threshold` (bytes): a PreflightInfo with its verdict. Raises TfmemUsageError when the probes cannot run."""
    batch = int(use.batch_size or 0)
    train = call == "fit"
    extra = _slots_to_build(model) if train else 0
    extra += sum(a.copy_bytes for a in use.input_arrays)  # fit/evaluate/predict copy numpy arrays into tensors

    def growth(step: float) -> float:  # what the process grows by: the allocator's regions held are reused first
        return max(0.0, tf_current + step + extra - max(tf_held, tf_current))

    generous = model_upper_bound(use, train, batch)
    if generous is not None and rss + growth(generous) <= threshold:
        # the model's own parts, at several times what they usually are, fit: no need to spend seconds on probes
        return PreflightInfo(call=call, batch_size=batch, step_bytes=generous, extra_bytes=extra, rss_bytes=rss,
                             predicted_rss_bytes=round(rss + growth(generous)), threshold_bytes=threshold, band=BAND,
                             verdict="fits", basis="model")
    high = max(2, batch // PROBE_FRACTION)
    low = max(1, high // 2)
    if high >= batch:  # a tiny batch: probing it is as cheap as running it, and it is guarded anyway
        high, low = batch, max(1, batch // 2)
    batches = sorted({low, high})
    if len(batches) < 2:
        raise TfmemUsageError(f"batch {batch} is too small to extrapolate from (it is guarded as it runs)")
    peaks = calibrate.probe_peaks(model, batches, train, use.structure, pipeline=use.feed == "arrays")
    step_at = line_through(peaks)
    info = PreflightInfo(call=call, batch_size=batch, probe_batches=batches, step_bytes=round(step_at(batch)),
                         extra_bytes=extra, rss_bytes=rss, threshold_bytes=threshold, band=BAND)

    grows = growth(step_at(batch))
    info.predicted_rss_bytes = round(rss + grows)
    # the band is the prediction's error: it widens what the process grows by, not what it holds already
    if rss + grows * (1 - BAND) > threshold:
        info.verdict = "refused"
    elif rss + grows * (1 + BAND) <= threshold:
        info.verdict = "fits"
    else:
        info.verdict = "uncertain"
    info.largest_batch = _largest(lambda b: rss + growth(step_at(b)) * (1 + BAND) <= threshold, batch)
    return info


def model_upper_bound(use: ModelUse, train: bool, batch: int) -> int | None:
    """A generous upper bound of one step's allocator growth from the model's own parts, no run: the layer outputs
    (training: with their gradients, TRAIN_ACTIVATION_FACTOR) at MODEL_MARGIN times, in chunks up to 1.5x, plus
    the gradients. The analytic basis misses by up to 73% on the benchmark's zoo (a recurrent layer's insides):
    only a step far inside the limit is let through on it. None when the model cannot be described."""
    info = describe_model(replace(use, calls=[*use.calls, "fit"] if train and "fit" not in use.calls else use.calls))
    if info is None or not info.layers:
        return None
    per_sample = activation_bytes(info)
    gradients = info.trainable_bytes if train else 0
    return round(MODEL_MARGIN * (1.5 * per_sample * batch + gradients))


def line_through(peaks: dict[int, tuple[int, int]]) -> Any:
    """The step's allocator bytes at any batch, from probe peaks {batch: (allocator peak, requested peak)}: the
    requested bytes' line (they grow in a straight line with the batch), in chunks of at most GROWTH_FRAGMENTATION
    per requested byte. Small probes' own ratios are no guide to a batch 8x larger: BFC's regions double as it
    grows, and a CNN's probe at batch 128 held 1.45x its requested bytes where batch 512 held 1.05x and the real
    batch 1024 1.03x (docs/preflight.md). A probe whose trace missed frees (requested above allocated) gives no
    requested line: the allocator's peaks are the line then."""
    (b1, (a1, r1)), (b2, (a2, r2)) = sorted(peaks.items())[:2]
    if r1 > 1.05 * a1 or r2 > 1.05 * a2:
        r1, r2, ratio = a1, a2, 1.0
    else:
        ratio = min(GROWTH_FRAGMENTATION, max(1.0, a2 / max(r2, 1)))
    slope = max(0.0, (r2 - r1) / (b2 - b1))

    def at(batch: float) -> float:
        return max(0.0, r2 + (batch - b2) * slope) * ratio

    return at


def _slots_to_build(model: Any) -> int:
    """The optimizer's slot variables fit will make in its first step, when the optimizer is not built yet."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "built", True) and getattr(optimizer, "variables", None):
        return 0
    name = type(optimizer).__name__.lower()
    slots = OPTIMIZER_SLOTS.get(name, 2)
    return slots * variable_bytes(getattr(model, "trainable_variables", []))


def _largest(fits: Any, batch: int) -> int | None:
    """The largest batch below `batch` that `fits` (monotone), as people type it; None if not even 1 does."""
    if not fits(1):
        return None
    if fits(batch):
        return batch
    low, high = 1, batch  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return typeable_batch(low)


def refusal(info: PreflightInfo, source: str) -> str:
    """The message of a refused call: what was predicted against what is allowed, and what to do."""
    fix = (f"Lower the batch size to {info.largest_batch} (the largest whose upper estimate fits), or run "
           "%tfmem fix shrink-batch for a ready cell." if info.largest_batch else
           "Not even batch 1 fits: free memory first (del large arrays, restart the kernel to give back a model's "
           "memory), or raise the limit.")
    return (f"tfmem's pre-flight stopped {info.call}() before its first step: at batch {info.batch_size} the process "
            f"would reach ~{format_bytes(info.predicted_rss_bytes)} (±{info.band:.0%}: it holds "
            f"{format_bytes(info.rss_bytes)} now, the step needs ~{format_bytes(info.step_bytes)}"
            + (f", plus {format_bytes(info.extra_bytes)} the call adds (optimizer slots, copies of numpy arrays)"
               if info.extra_bytes else "")
            + f"), and {source} allows {format_bytes(info.threshold_bytes)}. Nothing of the call ran. {fix} "
            f"(Predicted from one step of a clone at batches {' and '.join(map(str, info.probe_batches))}, "
            f"{info.seconds:.1f} s; --no-preflight skips it.)")
