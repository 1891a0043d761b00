"""The kinds of what-if basis, one class each: how a stored basis predicts the peak at other knobs, the band it
earned there, what its notes say, and what its peak is judged against (docs/design.md, 'What-if prediction').

A basis (core.report.Basis, stored on the report) is one dataclass whatever made it; `kind_of` reads which kind it is
from its fields (its name, its replay's source, its anchor) and gives the one class that predicts from it:

- `Analytic`: the model's parts alone (advise/prediction.analytic_basis), no extra run;
- `Measured`: a clone's probes (calibration.measured_basis) whose step replay did not pass, or did not run;
- `CloneReplay`: the same, with the clone's step replay passed: it moves the cell's peak with the batch;
- `OwnStep`: the cell's own saved step replayed (custom training: advise/step_export.py), no parts probes;
- `PreflightAnchored`: a call the pre-flight refused, its replay anchored on what the pre-flight predicted
  (preflight.refused_basis), and `PreflightOwnStep` where that replay ran the model's own step;
- `FromTrace`: a saved trace's own allocations replayed (analyze/saved_trace.trace_whatif): no model.

prediction.predict assembles what the kind says with what every basis shares. A new kind of basis is a new class
here, and a branch in `kind_of`. The parts' arithmetic is advise/parts.py; the bands are advise/bands.py.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import replace

from tfmem_magic.advise.bands import (
    ANALYTIC_BAND,
    CLONE_REPLAY_BAND,
    MEASURED_BAND,
    OWN_STEP_BAND,
    PREFLIGHT_ANCHORED_BAND,
    PROCESS_MARGIN,
)
from tfmem_magic.advise.parts import another_moment_below, parts_peak
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, Knobs, ReplayCurve, Report
from tfmem_magic.core.sizes import format_bytes

MOMENT_NOTE = (
    "At this batch another moment of the cell's step is the peak: one the trace saw holding fewer "
    "of the batch's tensors and more that do not shrink with it (a recurrent layer's backward pass "
    "holds gradients of its kernels' shape), so the peak falls less than the batch."
)


# ---- which kind a stored basis is ----------------------------------------------------------------------------------


def from_trace(basis: Basis | None) -> bool:
    """The basis is a saved trace's own sequence replayed (analyze/saved_trace.trace_whatif), not the cell's model:
    the batch is its only knob. Called with a report's `whatif_basis` (None: no basis stored, not a trace's)."""
    return basis is not None and basis.replay is not None and basis.replay.source == "trace"


def anchored_on_preflight(basis: Basis | None) -> bool:
    """The basis' anchor is the pre-flight's prediction for a call it refused, not a measured peak
    (advise/preflight.refused_basis). Called with a report's `whatif_basis` (None: no basis stored)."""
    return basis is not None and basis.anchor == "preflight" and basis.measured_peak is not None


def _own_step(basis: Basis) -> bool:
    """The basis' replay ran the cell's own saved step (advise/step_export.py), not a clone's."""
    return basis.replay is not None and basis.replay.source == "step"


def kind_of(basis: Basis) -> Kind:
    """The one kind that predicts from a stored basis."""
    if from_trace(basis):
        return FromTrace(basis)
    if anchored_on_preflight(basis):
        return PreflightOwnStep(basis) if _own_step(basis) else PreflightAnchored(basis)
    if _own_step(basis):
        return OwnStep(basis)
    if basis.name == "replay":
        return CloneReplay(basis)
    if basis.name == "measured":
        return Measured(basis)
    return Analytic(basis)


# ---- the kinds ------------------------------------------------------------------------------------------------------


class Kind(ABC):
    """What one kind of basis says about a prediction at `knobs`: its peak (`peak_at`), the name `predict` reports
    it under (`label`), its band (`band`) and its notes (`notes`); and what the peak is judged with: the peak the
    process was measured at (`measured`), a budget of its own (`judged_budget`), whether a CPU's process margin
    applies (`process_budget`)."""

    process_budget = True  # a CPU's peak above the measured one is judged with PROCESS_MARGIN
    unmeasured = "at no peak (it stopped early)."  # how the margin's note says the process was measured at no peak

    def __init__(self, basis: Basis) -> None:
        self.basis = basis

    def check(self, knobs: Knobs) -> None:
        """Raise TfmemUsageError where this kind cannot predict these knobs (every kind with a model predicts all)."""
        return None

    def replayed(self, knobs: Knobs) -> bool:
        """The step replay predicts the batch knob: its self-check passed, the cell's peak anchors it, and the knobs
        keep what the probes ran with (precision, input size, one replica)."""
        curve, now = self.basis.replay, self.basis.knobs
        return (
            curve is not None
            and curve.passed
            and bool(curve.peaks)
            and self.basis.measured_peak is not None
            and knobs.policy == now.policy
            and knobs.input_scale == now.input_scale
            and knobs.replicas == now.replicas
        )

    def peak_at(self, knobs: Knobs) -> int:
        """The allocator's peak at `knobs`, over the cell's baseline."""
        return parts_peak(self.basis, knobs)

    @abstractmethod
    def label(self, knobs: Knobs) -> str:
        """The basis the prediction at `knobs` reports (`WhatIf.basis`): "analytic", "measured" or "replay"."""

    @abstractmethod
    def earned_band(self) -> float:
        """The band this basis earned where it applies: the report's `prediction` block shows it."""

    def narrow_band(self, knobs: Knobs) -> float:
        """The band at `knobs` where nothing widens it: the earned one where the replay predicts, else the parts'."""
        return self.earned_band() if self.replayed(knobs) else ANALYTIC_BAND

    def band(self, knobs: Knobs) -> float:
        """The prediction's band at `knobs`: the analytic one where a note says the knobs leave what the basis
        earned its band on (`widening`)."""
        return ANALYTIC_BAND if self.widening(knobs) else self.narrow_band(knobs)

    def notes(self, report: Report, knobs: Knobs) -> list[str]:
        """The basis' notes on a prediction at `knobs`, in the order they are shown."""
        return self.how(report, knobs) + self.widening(knobs) + self.moments(knobs)

    def how(self, report: Report, knobs: Knobs) -> list[str]:
        """How the prediction is made from this basis."""
        return []

    def widening(self, knobs: Knobs) -> list[str]:
        """Why the band is the analytic one at these knobs: none, where it is the basis' own."""
        return []

    def moments(self, knobs: Knobs) -> list[str]:
        """Where the parts predict below the cell's batch: another moment of the step may be the peak there."""
        return [MOMENT_NOTE] if not self.replayed(knobs) and another_moment_below(self.basis, knobs) else []

    def measured(self) -> float:
        """The peak the process was measured at, which a peak above is judged against with the process margin: the
        cell's own, none (0) where the cell stopped before it."""
        return self.peak_at(self.basis.knobs) if self.basis.measured_peak is not None else 0.0

    def judged_budget(self, report: Report) -> tuple[int, str] | None:
        """A budget of this kind's own and the note that says so, where the report's (`budget_for_tf`) is not the
        one to judge against; None where it is."""
        return None

    def named_batch(self, knobs: Knobs, report: Report) -> tuple[bool, int | None]:
        """(whether this kind has named the largest batch at these knobs under its own budget already,
        `judged_budget`, and that batch: None where not even the smallest fits), which the what-if names again;
        (False, None) where the what-if searches its own."""
        return False, None

    def judged_peak(self, knobs: Knobs, report: Report | None = None) -> float:
        """The peak 'fits' and the largest batch judge at `knobs`: the predicted one (`peak_at`), unless the kind
        knows of a higher moment than the step it predicts (a saved trace's first step: `FromTrace`)."""
        return self.peak_at(knobs)


class Analytic(Kind):
    """The model's parts alone: the slope from the cell's trace or its layer outputs, checked against its peak."""

    def label(self, knobs: Knobs) -> str:
        return "analytic"

    def earned_band(self) -> float:
        return ANALYTIC_BAND


class Replayable(Kind):
    """A basis with a step replay (`Basis.replay`): where it passed and the knobs keep what its probes ran, the
    replay moves the anchor with the batch and the parts add what the other knobs change; elsewhere the parts
    predict alone."""

    unreplayed = "analytic"  # the label where the replay does not predict: the parts' basis
    # where the replay passed but does not predict these knobs: whose parts predict instead
    parts_words = "the probes' parts predict (the measured basis)."

    def label(self, knobs: Knobs) -> str:
        return "replay" if self.replayed(knobs) else self.unreplayed

    def peak_at(self, knobs: Knobs) -> int:
        """Where the replay applies, the anchor moved by what the replay finds between the cell's batch and the
        asked one, plus what the other knobs change (an optimizer's slots, accumulation's buffers: the parts, at the
        cell's batch). Otherwise the parts."""
        if not self.replayed(knobs):
            return parts_peak(self.basis, knobs)
        now_micro = self.basis.knobs.batch_size / self.basis.knobs.split
        others = parts_peak(self.basis, knobs, now_micro)
        return max(0, round(others + self.moved(knobs.batch_size / knobs.split, now_micro)))

    def moved(self, micro: float, now_micro: float) -> float:
        """What the replay moves the anchor by, from the cell's step batch to `micro`: on a measured anchor, the
        larger of the two op orders' changes (`replay_change`), the safe side both ways (a shrink that frees less, a
        growth that adds more)."""
        assert self.basis.replay is not None
        return replay_change(self.basis.replay, micro, now_micro)[1]

    def how(self, report: Report, knobs: Knobs) -> list[str]:
        curve, basis = self.basis.replay, self.basis
        if self.replayed(knobs):
            assert curve is not None
            micro = knobs.batch_size / knobs.split
            return [
                f"Replayed: {self.step()}, traced from a fresh allocator at batches {curve.probes[0]} and "
                f"{curve.probes[1]}, replayed at batch {micro:g} through a simulation of TensorFlow's BFC "
                f"allocator, and {self.anchor()}.{self.spread(knobs)}"
            ]
        if curve is not None and curve.passed and basis.measured_peak is not None:
            return [
                "The step replay ran at the cell's precision and input size with one replica: for these "
                "settings " + self.parts_words
            ]
        return []

    def step(self) -> str:
        """What the probes traced, in words."""
        return "the model's step"

    def anchor(self) -> str:
        """What the replay is anchored on, in words."""
        return "anchored on this cell's measured peak"

    def spread(self, knobs: Knobs) -> str:
        """What the replay note adds after its sentence: where the two probes' op orders part, by how much."""
        assert self.basis.replay is not None
        now = self.basis.knobs
        low, high = replay_change(self.basis.replay, knobs.batch_size / knobs.split, now.batch_size / now.split)
        if high - low > 0.01 * max(1, self.basis.measured_peak or 0):
            return (
                f" The two probes ran the step's ops in different orders, which moves the change by "
                f"{format_bytes(round(high - low))}: the larger change is given."
            )
        return ""

    def widening(self, knobs: Knobs) -> list[str]:
        curve = self.basis.replay
        if self.replayed(knobs) and curve is not None and knobs.batch_size / knobs.split > 2 * curve.batches[-1]:
            return [
                f"The replay's curve ends at batch {curve.batches[-1]}: beyond it the peak is extended in a "
                "line, so the analytic error band applies."
            ]
        return []


class Measured(Replayable):
    """A clone of the model trained at a few batches in fresh processes (calibration.measured_basis): the probes'
    slope above the cell's batch, the analytic one below. Its step replay did not pass, or did not run (`why_not`
    says why); where it passed, `CloneReplay`."""

    unreplayed = "measured"

    def earned_band(self) -> float:
        return MEASURED_BAND

    def narrow_band(self, knobs: Knobs) -> float:
        return self.earned_band() if self.replayed(knobs) else MEASURED_BAND

    def how(self, report: Report, knobs: Knobs) -> list[str]:
        said = super().how(report, knobs)
        curve = self.basis.replay
        if not said and not self.replayed(knobs) and curve is not None and curve.why_not:
            return [f"The step replay is not used: {curve.why_not}."]
        return said

    def widening(self, knobs: Knobs) -> list[str]:
        """Where the probes' band was not earned: another precision or input size than theirs, a batch far outside
        theirs, or below the cell's."""
        if self.replayed(knobs):
            return super().widening(knobs)
        now, notes = self.basis.knobs, []
        if knobs.policy != now.policy or knobs.input_scale != now.input_scale:
            notes.append(
                "The probes ran at the cell's precision and input size: for another, the slope is scaled "
                "from the model, so the analytic error band applies."
            )
        micro = knobs.batch_size / knobs.split
        probed = self.basis.calibration.get("batches") or []
        if probed and not (min(probed) / 2 <= micro <= 2 * max(probed)):  # a band is earned where the probes ran
            notes.append(
                f"The probes ran at batch {min(probed)}-{max(probed)}: a batch this far outside that range is "
                "extrapolated, so the analytic error band applies."
            )
        elif micro < now.batch_size:
            # measured on 14 models (benchmarks/predict_accuracy.py --zoo): above the cell's batch the measured basis
            # is within 10% on most points; below it, the cell's own run (its first step, whether fit's copy of the
            # arrays was still live at its peak) is most of a small batch's peak, and misses reached 30-60%
            notes.append(
                "Below the cell's batch, most of the peak is what the cell's own run held apart from its "
                "batch, which varies from run to run: the prediction is the analytic one (what the cell's "
                "trace says leaves with the batch), with its error band."
            )
        return notes


class CloneReplay(Measured):
    """A calibrated basis whose step replay passed: two fresh processes traced a clone's step from their allocator's
    first allocation, and the replay of those sequences moves the cell's measured peak with the batch
    (docs/bfc-replay.md). Other precisions, input sizes and replicas fall back to the probes' parts."""

    def earned_band(self) -> float:
        return CLONE_REPLAY_BAND


class OwnStep(Replayable):
    """The cell's own training step (or its loop's), saved with its variables and run by the replay's probes
    (custom training: advise/step_export.py). No parts probes ran: its parts are the analytic ones."""

    parts_words = "the parts the cell's trace measured predict (the analytic basis)."

    def earned_band(self) -> float:
        return OWN_STEP_BAND

    def peak_at(self, knobs: Knobs) -> int:
        """Below the cell's batch, the larger of the replay's and the parts' (a GAN and a distiller at half the
        batch: the replay fell 21% under the real peak where the parts did not, benchmarks/custom_step_accuracy.py):
        the saved step's probes restore the optimizers' slots before their first step, the cell built them in it,
        and an under-prediction here is a shrink-batch that runs out of memory."""
        replayed = super().peak_at(knobs)
        if self.replayed(knobs) and _below(self.basis, knobs):
            return max(replayed, parts_peak(self.basis, knobs))
        return replayed

    def step(self) -> str:
        return _own_step_words(self.basis)

    def spread(self, knobs: Knobs) -> str:
        said = super().spread(knobs) + _OWN_STEP_BAND_WORDS
        if _below(self.basis, knobs):
            said += (
                " Below the cell's batch the larger of this and the parts model's prediction is given: the "
                "saved step's probes hold the optimizers' slots before their first step, the cell built them "
                "in it, and the replay alone fell 21% short there once."
            )
        return said

    def moments(self, knobs: Knobs) -> list[str]:
        return _own_step_moments(self, knobs)


class PreflightAnchored(Replayable):
    """A call the pre-flight refused on its replay of a clone's step: nothing of the step ran, so the replay is
    anchored on what the pre-flight predicted for the call's batch (preflight.refused_basis), its whole peak is
    predicted, and the peak is judged as the pre-flight judged the call. The model's parts predict the knobs the
    replay did not run, anchored on the same prediction."""

    unmeasured = "at no peak (its pre-flight refused the call)."
    parts_words = (
        "the model's parts predict (the analytic basis), from the pre-flight's prediction at the cell's batch."
    )

    def earned_band(self) -> float:
        return PREFLIGHT_ANCHORED_BAND

    def moved(self, micro: float, now_micro: float) -> float:
        """The larger order's replayed peak at `micro` less its peak at the refused batch, the anchor: so the
        what-if gives what the pre-flight judged at every batch (each order from itself would add the orders'
        spread at the refused batch, 50 MB on a CNN at 1024, to every other)."""
        assert self.basis.replay is not None
        return larger_order_peak(self.basis.replay, micro) - larger_order_peak(self.basis.replay, now_micro)

    def anchor(self) -> str:
        return (
            f"anchored on what the pre-flight predicted for the {self.basis.knobs.batch_size} batch it refused (TF's "
            "allocator as the call began, plus the replayed step: nothing of the step ran to be "
            "measured)"
        )

    def spread(self, knobs: Knobs) -> str:
        return (
            f" The band is ±{PREFLIGHT_ANCHORED_BAND:.0%}: the whole peak is predicted, and the pre-flight's "
            "replay of TF's allocator was -1% to +34% off the step measured on six models "
            "(docs/preflight.md)."
        )

    def measured(self) -> float:
        return 0.0  # nothing of the call ran: the process was measured at no peak

    def judged_budget(self, report: Report) -> tuple[int, str] | None:
        """Where the report holds the refusal and the process was measured (a CPU): the budget as the pre-flight
        judged the call (preflight._judge: the process as the call began, plus PROCESS_MARGIN on what it grows by,
        under the guard's threshold). What TensorFlow's allocator held in use as the call began (the process holds
        it already) is taken back with the margin, which widens only the growth; the regions it held beyond that
        are not counted as room, as the pre-flight's "fits" does not count them. So the refusal and the what-if
        name one largest batch."""
        pre, start = report.preflight, refused_call_start(report)
        if pre is None or report.on_gpu or report.rss.peak_bytes <= 0:
            return None
        assert start is not None
        budget = max(0, pre.threshold_bytes - pre.rss_bytes + round((1 + PROCESS_MARGIN) * start[1]))
        return budget, (
            f"Judged as the pre-flight judged the call: against the {format_bytes(pre.threshold_bytes)} "
            f"the guard allows, from the {format_bytes(pre.rss_bytes)} the process held as the call "
            "began, with what TensorFlow's allocator held in use then taken as held already"
            + (
                f" (the {format_bytes(pre.reusable_bytes)} of regions it held beyond that are not counted as "
                "room: whether the step's tensors fit in them is not known, docs/preflight.md)."
                if pre.reusable_bytes >= 1 << 20
                else "."
            )
        )

    def named_batch(self, knobs: Knobs, report: Report) -> tuple[bool, int | None]:
        """The batch the refusal named (None: not even the smallest), where the what-if is asked the refusal's
        question (the call's knobs but its batch, under the budget the pre-flight judged it against): the refusal
        searched the replay itself, the what-if has it between the batches replayed, and where a probe's staircase
        is not monotone two searches can name two batches (docs/preflight.md, "One answer")."""
        pre = report.preflight
        same = replace(knobs, batch_size=self.basis.knobs.batch_size) == self.basis.knobs
        if pre is None or not same or self.judged_budget(report) is None:
            return False, None
        return True, pre.largest_batch


class PreflightOwnStep(PreflightAnchored):
    """A refused call whose pre-flight replayed the model's own step (a step Keras cannot run on a clone): anchored
    as `PreflightAnchored`, with the own step's band and words."""

    parts_words = OwnStep.parts_words

    def earned_band(self) -> float:
        return OWN_STEP_BAND

    def step(self) -> str:
        return _own_step_words(self.basis)

    def spread(self, knobs: Knobs) -> str:
        return _OWN_STEP_BAND_WORDS

    def moments(self, knobs: Knobs) -> list[str]:
        return _own_step_moments(self, knobs)


class FromTrace(Replayable):
    """A saved trace's own allocation sequence (analyze/saved_trace.trace_whatif), its batch-shaped allocations
    scaled and replayed: no model, so the batch is its only knob (`check`), and its band is the analytic one
    (scaling by shape alone misses what carries the batch without a batch dimension). Its replay always predicts: a
    trace's basis is made only from a replay whose self-check passed, anchored on the trace's peak. It judges the
    trace's device, not a process it never measured."""

    process_budget = False

    def check(self, knobs: Knobs) -> None:
        if replace(knobs, batch_size=self.basis.knobs.batch_size) != self.basis.knobs:
            raise TfmemUsageError(
                "a saved trace predicts the batch only (it holds TensorFlow's allocations, not the "
                "model): give batch_size, and profile the model itself (%%tfmem) for precision, "
                "optimizer, accumulation, input size or replicas"
            )

    def label(self, knobs: Knobs) -> str:
        return "replay"

    def earned_band(self) -> float:
        return ANALYTIC_BAND

    def narrow_band(self, knobs: Knobs) -> float:
        return ANALYTIC_BAND

    def how(self, report: Report, knobs: Knobs) -> list[str]:
        assert self.basis.replay is not None
        return [
            trace_replay_words(report, self.basis.replay) + f", replayed at batch {knobs.batch_size / knobs.split:g}. "
            "The band is the analytic one: scaling by shape alone misses what carries the batch without a batch "
            "dimension (measured on CPU models: docs/bfc-replay.md)."
        ]

    def widening(self, knobs: Knobs) -> list[str]:
        return []  # past the curve's end the peak is extended in a line, at the band it has already

    def judged_peak(self, knobs: Knobs, report: Report | None = None) -> float:
        """The higher of the trace's step and its allocator's peak since the process started, where the report
        holds one above the trace's (a first step's autotuning, on a GPU: docs/gpu.md, "The first step"): that
        earlier moment, moved with the batch as the step is: by the bytes it held more (`first_step_excess`), or in
        proportion to the step's peak over the start, whichever is higher at `knobs`."""
        step = self.peak_at(knobs)
        excess = first_step_excess(report)
        if excess is None:
            return step
        extra, ratio = excess
        return max(step + extra, step * ratio)


_OWN_STEP_BAND_WORDS = (
    f" The band is ±{OWN_STEP_BAND:.0%}: a custom step replayed was measured on four programs "
    "only, up to 49% off where the real peak itself took two values (docs/bfc-replay.md)."
)


def _own_step_words(basis: Basis) -> str:
    """The cell's own saved step, in words: "this model's own training step (GAN.train_step, saved with ...)"."""
    saved = basis.calibration.get("step", "train_step")
    kind = "step" if "predict_step" in saved or "test_step" in saved else "training step"
    return f"this model's own {kind} ({saved}, saved with its variables)"


def _own_step_moments(kind: Kind, knobs: Knobs) -> list[str]:
    """An own step's note on the step's other moments: below the cell's batch too, where the parts may be the
    prediction (`OwnStep.peak_at`)."""
    where = not kind.replayed(knobs) or _below(kind.basis, knobs)
    return [MOMENT_NOTE] if where and another_moment_below(kind.basis, knobs) else []


def _below(basis: Basis, knobs: Knobs) -> bool:
    """`knobs` ask for a smaller step batch than the cell's."""
    return knobs.batch_size / knobs.split < basis.knobs.batch_size / basis.knobs.split


# ---- the step replay's curve ----------------------------------------------------------------------------------------


def replay_peak(curve: ReplayCurve, micro: float, order: int = 0) -> float:
    """The replayed peak at a step's batch `micro` in probe one's op order (`order` 1: probe two's): interpolated
    between the curve's batches, extended in a line past its ends."""
    xs, ys = curve.batches, (curve.second_peaks if order and curve.second_peaks else curve.peaks)
    if len(xs) == 1:
        return float(ys[0])
    k = min(max(bisect.bisect_left(xs, micro), 1), len(xs) - 1)  # the segment [k-1, k] holding micro (or the end)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return max(0.0, y0 + (y1 - y0) * (micro - x0) / (x1 - x0))


def replay_change(curve: ReplayCurve, micro: float, now_micro: float) -> tuple[float, float]:
    """What the replay finds between the cell's step batch and `micro`, in each of the two probes' op orders: (the
    smaller change, the larger). Each order is compared with itself: a spike one order has at the cell's batch
    (MobileNetV2's orders differ by 19 MiB there) must not become a drop at every other batch."""
    changes = sorted(replay_peak(curve, micro, order) - replay_peak(curve, now_micro, order) for order in (0, 1))
    return changes[0], changes[1]


def larger_order_peak(curve: ReplayCurve, micro: float) -> float:
    """The replayed peak at `micro` in whichever of the two probes' op orders holds more there."""
    return max(replay_peak(curve, micro, order) for order in (0, 1))


def first_step_excess(report: Report | None) -> tuple[int, float] | None:
    """What a saved trace's allocator held at its peak since the process started (`DeviceMemory.lifetime_peak_bytes`)
    more than at the trace's peak: (the bytes, the ratio of the two peaks over the trace's start). None where the
    report holds no such peak above the trace's."""
    mem = report.main_device if report is not None else None
    if mem is None or mem.lifetime_peak_bytes is None or mem.lifetime_peak_bytes <= mem.peak_bytes:
        return None
    over = mem.peak_bytes - mem.baseline_bytes
    if over <= 0:
        return None
    return mem.lifetime_peak_bytes - mem.peak_bytes, (mem.lifetime_peak_bytes - mem.baseline_bytes) / over


def trace_replay_words(report: Report, curve: ReplayCurve) -> str:
    """How a saved trace's what-if is made, in words (the start of a sentence)."""
    device = report.main_device_name or "its device"
    kind = "a GPU trace" if device.startswith("GPU") else "a saved trace"
    how = (
        "their chunks summed over the bytes in use at the trace's start (it begins mid-run: docs/gpu.md), without "
        "the allocator's placement"
        if curve.summed
        else "through a simulation of TensorFlow's BFC allocator with the trace's settings"
    )
    return (
        f"Predicted from {kind} ({device}, {report.env.allocator}): the trace's own {curve.events} memory "
        f"events, the {curve.scaled} allocations whose shape carries batch {curve.probes[0]} (one step of "
        f"this device, per replica) scaled, {how}, anchored on the trace's peak"
    )


def refused_call_start(report: Report) -> tuple[int, int] | None:
    """Where a call the pre-flight refused on its replay began, over the cell's baseline: (what the process had grown
    by, what TF's allocator had). Nothing of the call ran, so what the process grew by after it is the pre-flight's
    own memory (its replay's arrays: 78 MiB for a GRU's), tfmem's, as the profiler's is. None for any other report
    (and for one saved before a refusal kept its replay)."""
    pre, device = report.preflight, report.main_device
    if pre is None or pre.verdict != "refused" or pre.replay is None or device is None:
        return None
    return pre.rss_bytes - report.rss.baseline_bytes, max(0, pre.tf_bytes - device.baseline_bytes)
