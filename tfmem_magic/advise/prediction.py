"""What-if: the peak a cell would have had with another batch size, precision, optimizer, accumulation or input size.

The model (docs/design.md, 'What-if prediction') splits the cell's peak into parts that scale differently:

    weights + gradients + optimizer slots + input copy        (do not depend on the batch)
    + per_sample · micro-batch (activations, the batch itself) (the batch the model sees in one step)
    + other                                                    (what the parts do not explain; kept as measured)

times the fragmentation the cell's own trace measured (allocated / requested bytes). The prediction is anchored on
the cell's measured peak: at the cell's own settings it gives back exactly what was measured, and each knob moves
only the parts it changes. Where the per-sample slope comes from is the *basis*:

- "analytic": from the Keras model alone (sum of layer outputs per sample, times a training factor), no extra run;
  measured error within 30% (benchmarks/predict_accuracy.py);
- "measured": `calibration.measured_basis()` trains a clone of the model (in a fresh process: probe_runs.py) at a
  quarter, once and four times the cell's batch, fed as the cell fed it (fit's input pipeline holds prefetched
  batches: +30% per sample on a CNN), and takes the slope of the requested bytes' peak above the cell's batch (below
  it, the analytic slope did better: see measured_basis). Requested bytes grow in a straight line with the batch; the
  allocator's chunks do not (BFC's fragmentation is 1.0x-1.5x and changes from run to run): the cell's own parts keep
  the cell's ratio, and what a larger batch adds gets the ratio the probes measured over their span (large tensors fit
  their chunks more closely: 1.04x on an attention block whose cell ran at 1.10x, where one ratio for all
  over-predicted batch 256 by 22%).

The analytic slope is the layer outputs (plus the score tensors inside attention layers) times a training factor,
checked against the cell's own peak: where they over-explain it (fused or early-freed ops), the measured point wins.
Measured errors: docs/what-if.md and benchmarks/predict_accuracy.py.

Each kind of basis (these two, the step replays, a refused call's, a saved trace's) is a class in advise/bases.py:
`predict` asks the report's basis' kind for the peak, its band and its notes, and adds what every basis shares (the
budget, the process margin on a CPU). The parts' arithmetic is advise/parts.py, the bands advise/bands.py.

This module imports no TensorFlow or Keras; the probes run in another process (probe_runs.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypedDict

from tfmem_magic.advise.bands import (
    GROWTH_FRAGMENTATION,
    MOMENT_RATIO,
    PROCESS_MARGIN,
    PROFILER_SHARE_JUDGED,
    TYPICAL_FRAGMENTATION,
)
from tfmem_magic.advise.bases import (
    Analytic,
    Kind,
    Replayable,
    anchored_on_preflight,
    from_trace,
    kind_of,
    refused_call_start,
    trace_replay_words,
)
from tfmem_magic.advise.parts import OPTIMIZER_SLOTS, POLICIES, gradient_copies, growth_ratio, parts_at
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, Knobs, ModelInfo, Prediction, Report
from tfmem_magic.core.sizes import format_bytes

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's; annotations are not evaluated at run time
    from typing import Unpack

# Training keeps each layer's output for the backward pass and makes a gradient of the same size while it runs
# backward; measured on TF 2.21 CPU (docs/design.md, 'Batch scaling and the analytic prior') the step peak is ~1.6x
# the layer outputs.
TRAIN_ACTIVATION_FACTOR = 1.6
# Inference frees each output once the next layer has it: the peak is about the largest neighbouring pair.
INFER_ACTIVATION_FACTOR = 1.0
UPPER_BOUND_SOURCE = "the cell's peak (the trace stopped before it: an upper bound)"
CALIBRATED = ("measured", "replay")  # the bases that stand on probe runs
MAX_BATCH = 1 << 20


class WhatIfKnobs(TypedDict, total=False):
    """The knobs of `predict` that a caller passes on as `**knobs` (`largest_fitting_batch`, `largest_batch`)."""

    batch_size: int | None
    policy: str | None
    optimizer: str | None
    accumulation_steps: int
    input_scale: float
    replicas: int | None


@dataclass
class WhatIf:
    """The answer of `predict()`: the predicted TF peak over the cell's baseline, its parts and its uncertainty."""

    peak_bytes: int
    basis: str
    error_band: float  # relative: 0.3 = the true peak is expected within ±30% (its high end: what "fits" judges)
    split: dict[str, int]  # weights, gradients, optimizer, activations, input, other (requested bytes)
    fragmentation_ratio: float
    knobs: Knobs  # the settings predicted for
    budget_bytes: int | None  # what the TF peak may reach: the budget minus what the process held before the cell
    fits: bool | None  # the peak with `fit_margin` fits the budget
    largest_batch: int | None  # the largest batch (same other knobs) whose upper estimate fits the budget
    notes: list[str] = field(default_factory=list)
    fit_margin: float = 0.0  # the margin `fits` judged this peak with: error_band, or process_margin above the cell's
    # a CPU's process budget: a peak above `measured_peak` (the cell's; 0 where it stopped early) is judged with this
    process_margin: float = 0.0
    measured_peak: float = 0.0
    # the band's low side where it is wider than `error_band` (a calibrated basis the analytic one predicts lower
    # than: `band_below`); 0: `error_band` both ways
    error_band_below: float = 0.0

    @property
    def below(self) -> float:
        """The band's low side: the true peak is expected down to peak × (1 - below)."""
        return max(self.error_band, self.error_band_below)

    def margin_at(self, peak: float) -> float:
        """The margin another peak of these knobs' curve (another batch) is judged with, in this band. Below the
        cell's batch a calibrated band can be wider there (`judged_band`): `predict` at that batch gives its
        `fit_margin`."""
        return judging_margin(peak, self.measured_peak, self.error_band, self.process_margin)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the basis from a report ----------------------------------------------------------------------------------------


def optimizer_key(name: str | None, momentum: bool = False) -> str | None:
    if not name:
        return None
    key = name.lower()
    return "sgd+momentum" if key == "sgd" and momentum else key


def activation_bytes(model: ModelInfo) -> float:
    """Activation bytes per sample the cell's step holds: all outputs when training, a neighbouring pair when not."""
    # A Flatten's output is a view of its input (TF reshapes do not copy), yet counting it is what keeps the 1.6
    # factor right: without it, a Conv+Flatten+Dense CNN's quick-mode prior at batch 512 fell 30% short (its
    # backward makes a gradient of that size, and the factor was measured with it counted)
    per_layer = [layer.activation_bytes_per_sample for layer in model.layers]
    if not per_layer:
        return 0.0
    if model.training:  # outputs and their gradients, and what recurrent layers keep per time step (measured)
        return TRAIN_ACTIVATION_FACTOR * sum(per_layer) + sum(layer.kept_bytes_per_sample for layer in model.layers)
    pairs = [a + b for a, b in zip(per_layer, per_layer[1:], strict=False)] or per_layer
    return INFER_ACTIVATION_FACTOR * max(pairs)


def current_knobs(model: ModelInfo) -> Knobs:
    return Knobs(
        batch_size=model.batch_size or 1,
        policy=model.dtype_policy or "float32",
        optimizer=optimizer_key(
            model.optimizer, model.optimizer_slots == 1 and (model.optimizer or "").lower() == "sgd"
        ),
        replicas=max(1, model.replicas),
    )


def basis_of(report: Report) -> Basis:
    """The basis the report's what-if uses: the one stored on it (analytic when it was built, measured once
    calibrated), else the analytic one derived from it (a report saved before bases were stored)."""
    return report.whatif_basis if report.whatif_basis is not None else analytic_basis(report)


def is_calibrated(report: Report) -> bool:
    """The report's what-if stands on probe runs (`calibration.measured_basis`)."""
    return report.whatif_basis is not None and report.whatif_basis.name in CALIBRATED


def analytic_basis(report: Report) -> Basis:
    """Split the cell's measured peak into the model's parts; the slope comes from the layer outputs."""
    model = report.model
    if model is None or not model.layers:
        raise TfmemUsageError(
            "this report has no Keras model to predict from: the cell must train, evaluate, "
            "predict or call a Keras model (built from layers)"
        )
    if not model.batch_size:
        raise TfmemUsageError(
            f"the cell's batch size could not be read from what it fed ({model.feed}): a "
            "prediction needs it. Batch the data with tf.data's .batch(N), pass batch_size=N, or "
            "give a PyDataset a batch_size attribute"
        )
    knobs = current_knobs(model)
    training = model.training
    weights = model.new_weight_bytes
    gradients = model.trainable_bytes if training else 0
    optimizer = model.optimizer_bytes if training and model.optimizer_built_in_cell else 0
    per_replica = knobs.batch_size / knobs.split  # the samples this process's tensors carry
    input_copy, missing = _input_copy(report)
    samples = model.samples or 0
    input_per_sample = model.copy_bytes / samples if samples else 0.0
    fragmentation = _fragmentation(report)
    measured = report.tf_peak_bytes if report.tf_peak_bytes and report.status == "ok" else None
    prior = activation_bytes(model)
    static = weights + gradients * gradient_copies(knobs) + optimizer + input_copy
    activations, other, source = prior, 0, "layer outputs"
    traced = traced_per_sample(report)
    below: float | None = None
    gap = 0
    lines_below: list[list[float]] = []
    if traced is not None:  # measured per tensor: recurrent states, attention scores, nested models' insides
        activations, source = max(0.0, traced - input_per_sample), "the trace (tensors with the batch dimension)"
        busiest = traced_per_sample(report, at_peak=False)
        if busiest is not None and busiest > traced * MOMENT_RATIO:
            # the peak came at a moment that holds few of the batch's tensors: above the cell's batch another
            # moment, with more of them, overtakes it; its slope above (drawn from that moment's own total, by
            # `moment_gap` below the peak: parts_at), the peak's below
            below, activations = activations, max(0.0, busiest - input_per_sample)
            source = "the trace (tensors with the batch dimension, at the moment that holds most of them)"
            gap = _moment_gap(report, fragmentation)
    if measured is not None:
        anchor = measured / fragmentation + missing  # the run as it usually goes: with fit's copy at the peak
        # one measured point: what the batch-dependent part must be if nothing else were there
        one_point = max(0.0, (anchor - static) / per_replica - input_per_sample)
        # ... and at most, when the gradients are not there yet: the peak of a training step comes during the
        # backward pass, while gradients are being made and activations freed (ResNet50 at batch 8/32/256 peaks at
        # 292/472/2013 MiB: a line whose intercept, 232 MiB, is below its Adam slots and gradients, 294 MiB)
        unborn = gradients if training else 0
        most = max(0.0, (anchor - static + unborn) / per_replica - input_per_sample)
        if below is not None:  # the two moments' slopes: the peak's is bounded as a single slope is (below)
            below = min(below, most)
        elif activations > most:  # the slope over-explains the peak (fused or freed ops): trust the measurement
            activations, source = most, "the cell's peak (layer outputs over-explain it)"
        elif traced is None and report.trace is not None and report.trace.events and report.trace.budget_spent:
            # traced, but the trace stopped before the peak (its budget): the layer outputs miss what a recurrent
            # layer or an attention block keeps inside; the cell's own point is an upper bound, the safe side
            activations, source = one_point, UPPER_BOUND_SOURCE
        other = round(anchor - static - (activations + input_per_sample) * per_replica)
        if traced is not None and training:  # the peak's slope below as bounded above
            lines_below = _lines_below(report, fragmentation, input_per_sample, activations if below is None else below)
    # a ratio the trace measured (not the typical one assumed without it, which the slopes above divided by)
    growth = GROWTH_FRAGMENTATION if fragmentation > GROWTH_FRAGMENTATION and _measured_fragmentation(report) else None
    return Basis(
        "analytic",
        weights,
        gradients,
        optimizer,
        input_copy,
        activations,
        input_per_sample,
        other,
        fragmentation,
        measured,
        knobs,
        slope_source=source,
        copy_missing=missing,
        growth_fragmentation=growth,
        activations_per_sample_below=below,
        moment_gap=gap,
        lines_below=lines_below,
    )


def _lines_below(report: Report, fragmentation: float, input_per_sample: float, peak_slope: float) -> list[list[float]]:
    """The lines of the trace's other moments that could be the step's peak at a smaller batch (analysis.
    _moments_below), each [slope per sample, gap below the peak at the cell's batch] in requested bytes: only those
    that shrink slower than the peak's own line (the others are below it at every smaller batch). Each stands below
    the allocator's own peak, not the trace's: where the peak came while the trace was paused (a higher moment of
    the cell's batch, 1.4 MB over the traced one in an LSTM's cell), a moment's line drawn from the traced peak
    kept that excess at every smaller batch (+24% at a quarter of the batch).
    Only for a cell whose peak was measured (the anchor the gaps hang from) and that trains a recurrent layer (one
    that keeps its time steps for the backward pass): its backward loop holds gradients of its kernels' shape per
    time step in flight, the moment these lines are for.
    On the zoo's other models a moment's line predicted up to +44% at a quarter of the batch (MobileNetV2) where the
    peak's line gave +17%: what a moment holds beside the tensors the trace can tell carry the batch is not all
    bytes that stay (docs/what-if.md, "Below the batch: the step's other moments")."""
    trace, device, model = report.trace, report.main_device, report.model
    if trace is None or not trace.replica_batch_size or model is None:
        return []
    if not any(layer.kept_bytes_per_sample for layer in model.layers):
        return []
    top = max(trace.peak_live_bytes, device.peak_bytes if device is not None else 0)
    lines = []
    for batch_bytes, live in trace.moments_below:
        slope = max(0.0, batch_bytes / trace.replica_batch_size - input_per_sample)
        if slope < peak_slope:
            lines.append([slope, max(0, round((top - live) / fragmentation))])
    return lines


def _moment_gap(report: Report, fragmentation: float) -> int:
    """How far below the peak, in requested bytes, the trace's busiest moment (the one holding the most tensors with
    the batch dimension) stood at the cell's batch. The busiest moment's slope is drawn from there, not from the
    peak: drawn from the peak it over-predicted a GRU's larger batches by 27-51% (docs/what-if.md). 0 when the trace
    did not record that moment's total. Measured from the traced peak, where the lines below the batch are
    measured from the allocator's own (`_lines_below`): above the batch this line was measured as it is (+2..+5%
    on the GRU) and a larger gap would lower it, the unsafe side for "will a bigger batch fit?"."""
    trace = report.trace
    if trace is None or trace.live_at_batch_most_bytes is None:
        return 0
    return max(0, round((trace.peak_live_bytes - trace.live_at_batch_most_bytes) / fragmentation))


def traced_per_sample(report: Report, at_peak: bool = True) -> float | None:
    """Bytes per sample of the tensors that carried the batch dimension at the traced peak (requested bytes), when
    the trace saw the cell's batch and its peak; None otherwise. `at_peak=False`: at the moment that held most of
    them, as traced."""
    trace, model = report.trace, report.model
    if (
        trace is None
        or model is None
        or not trace.batch_bytes_at_peak
        or trace.replica_batch_size != model.replica_batch
    ):
        return None
    if trace.budget_spent and not _trace_saw_peak(report):
        return None  # the budget ran out before the peak: the step that made it may not have been traced at all
    assert trace.replica_batch_size is not None  # set whenever batch_bytes_at_peak is (analysis._batch_bytes)
    # a peak outside a window the steps rule closed is another run of the steps traced (plus what fit copied or
    # freed late, which the cell's own point gives the static part): their tensors are the slope
    # what the step allocated while the trace was paused is live at the peak but unseen: it is the same step's
    # tensors, so it carries the batch in the proportion the traced ones do (as long as most of it was seen)
    # ... except fit's copy of the arrays, which does not: made while a segment restarted, it is untraced too
    untraced = max(0, _untraced_at_peak(report) - _copy_in_untraced(report))
    seen = trace.requested_at_peak_bytes
    if untraced > 3 * seen:
        return None
    if not at_peak:  # as traced: what the trace did not see at the peak says nothing of another moment (a VAE's
        # peak held 33 MB allocated while the trace was paused: scaled by it, its busiest moment predicted +84%)
        return None if trace.batch_bytes_most is None else trace.batch_bytes_most / trace.replica_batch_size
    # the proportion is the step's own tensors': fit's copy of the arrays and the optimizer's tensors live at the
    # peak are traced but never carry the batch, and counted in they diluted it (a MobileNetV2 cell at 8x its batch:
    # -20%, +4% with the step's: docs/what-if.md, "Where the trace missed the peak's tensors")
    step = seen - sum(c.requested_bytes for c in trace.input_copies if c.live_at_peak)
    step -= _requested_in_phase(report, "optimizer")
    share = trace.batch_bytes_at_peak / max(step, trace.batch_bytes_at_peak, 1)
    return (trace.batch_bytes_at_peak + share * untraced) / trace.replica_batch_size


def _input_copy(report: Report) -> tuple[int, int]:
    """The whole-array copy fit/evaluate/predict make of numpy inputs (the arrays' size), and how much of it this
    cell's trace did not find live at its peak. Keras usually keeps the copy through the peak but not always (run
    to run, in fresh processes: docs/design.md, 'Facts found while building tfmem'): predictions count it, so they
    describe the usual run."""
    model = report.model
    if model is None or not model.fed_arrays:
        return 0, 0
    trace = report.trace
    if trace is None or not trace.events or report.status != "ok":
        return model.copy_bytes, 0
    if not any(c.role == "training" for c in trace.input_copies) and (report.tf_peak_bytes or 0) < model.copy_bytes:
        # the trace saw no copy, and TF's whole peak is smaller than it: it never was in TF's allocator (host
        # memory), and the cell's growth outside TF counts it already (budget_for_tf): counted once, there
        return 0, 0
    seen = sum(c.requested_bytes for c in trace.input_copies if c.live_at_peak and c.role == "training")
    # a copy made while the trace was paused (a segment restarting as fit began: seen in CI) is live at the peak
    # but not seen as the copy: the untraced bytes at the peak hold it, and the peak already counts it
    return model.copy_bytes, max(0, model.copy_bytes - seen - _copy_in_untraced(report))


def _copy_in_untraced(report: Report) -> int:
    """Bytes of fit's copy of the training arrays that were most likely allocated while the trace was paused: only
    when the trace saw no training copy at all (a copy it saw and saw freed was freed), as much of it as the
    untraced bytes at the peak can hold."""
    model, trace = report.model, report.trace
    if model is None or not model.fed_arrays or trace is None or not trace.events or report.status != "ok":
        return 0
    if any(c.role == "training" for c in trace.input_copies):
        return 0
    return min(model.copy_bytes, _untraced_at_peak(report))


def _untraced_at_peak(report: Report) -> int:
    """Bytes live at the traced peak that were allocated while the trace was paused."""
    return _requested_in_phase(report, "untraced")


def _requested_in_phase(report: Report, phase: str) -> int:
    """Requested bytes live at the traced peak in one phase of the trace's breakdown (0 without a trace)."""
    trace = report.trace
    return 0 if trace is None else sum(g.requested_bytes for g in trace.by_phase if g.phase == phase)


def _fragmentation(report: Report) -> float:
    """Allocated / requested bytes at the cell's peak, from its trace; without a trace (quick mode, a failed cell)
    the typical ratio of a training step's peak under BFC (1.2x-1.5x measured:
    docs/design.md, 'Allocator statistics and BFC')."""
    trace = report.trace
    if trace is not None and _measured_fragmentation(report):
        return max(1.0, trace.allocated_at_peak_bytes / trace.requested_at_peak_bytes)
    return TYPICAL_FRAGMENTATION  # also when the trace stopped before the peak: its moment says nothing of the step


def _measured_fragmentation(report: Report) -> bool:
    trace = report.trace
    return trace is not None and trace.requested_at_peak_bytes > 0 and _trace_saw_peak(report)


def _trace_saw_peak(report: Report) -> bool:
    trace, device = report.trace, report.main_device
    return trace is not None and (trace.complete or device is None or trace.peak_live_bytes >= 0.9 * device.peak_bytes)


# ---- prediction -----------------------------------------------------------------------------------------------------


def peak_at(basis: Basis, knobs: Knobs) -> int:
    """The allocator's peak at `knobs`, as the basis' kind predicts it (advise/bases.py)."""
    return kind_of(basis).peak_at(knobs)


def trace_whatif_note(report: Report) -> str:
    """The report's note on a saved trace's what-if: how it is made, the peak at a few batches, the largest batch."""
    basis = basis_of(report)
    assert basis.replay is not None
    batch = basis.knobs.batch_size
    asked = sorted(b for b in {max(1, batch // 2), 2 * batch, 4 * batch} - {batch} if b <= MAX_BATCH)
    at = ", ".join(f"batch {b}: {format_bytes(predict(report, batch_size=b).peak_bytes)}" for b in asked)
    now = predict(report)
    budget = (
        ""
        if now.budget_bytes is None
        else f"; the largest batch whose upper estimate fits the {format_bytes(now.budget_bytes)} left on "
        f"{report.main_device_name}: {now.largest_batch if now.largest_batch else 'none'}"
    )
    return (
        f"{trace_replay_words(report, basis.replay)}. Over the trace's start, at ±{now.error_band:.0%}: "
        f"{at}{budget}. tfmem_magic.predict(report, batch_size=N) asks for others."
    )


def replay_moved(basis: Basis, micro: float, now_micro: float) -> float:
    """What the basis' step replay moves its anchor by, from the cell's step batch to `micro` (`Replayable.moved`: a
    measured anchor by the larger of the two op orders' changes, a refused call's by the larger order's peak)."""
    kind = kind_of(basis)
    assert isinstance(kind, Replayable)
    return kind.moved(micro, now_micro)


def judging_margin(peak: float, measured: float, band: float, process_margin: float = 0.0) -> float:
    """The margin a peak is judged with against a budget: its band, and `process_margin` in all above `measured`
    (the highest peak the process was measured at; 0 where none was: a CPU's process budget, PROCESS_MARGIN)."""
    return max(band, process_margin) if peak > measured else band


def fits_within(peak: float, budget: float, measured: float, band: float, process_margin: float = 0.0) -> bool:
    """The peak, with the margin it is judged with (`judging_margin`), fits the budget."""
    return peak * (1 + judging_margin(peak, measured, band, process_margin)) <= budget


def largest_batch(
    basis: Basis,
    knobs: Knobs,
    budget: int,
    band: float,
    process_margin: float = 0.0,
    measured: float = 0.0,
    report: Report | None = None,
    beside: Analytic | None = None,
) -> int | None:
    """The largest batch (other knobs fixed) whose upper estimate stays within the budget; None if none does. The
    peak judged is the kind's (`Kind.judged_peak`: a saved trace's first step, where `report` holds a higher one),
    with the band `predict` gives at that batch (`judged_band`: below the cell's batch, the analytic high end of the
    basis `beside` a calibrated one, where higher)."""

    kind = kind_of(basis)

    def fits(batch: int) -> bool:
        at = replace(knobs, batch_size=batch)
        # the judged peak is the predicted one wherever a basis stands `beside` (a saved trace's, which has none,
        # is the only kind that judges a higher moment)
        peak = kind.judged_peak(at, report)
        return fits_within(peak, budget, measured, judged_band(band, peak, beside, basis, at), process_margin)

    step = knobs.split
    if not fits(step):
        return None
    low, high = step, step * 2
    while high < MAX_BATCH and fits(high):
        low, high = high, high * 2
    if high >= MAX_BATCH and fits(MAX_BATCH):
        return MAX_BATCH
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return typeable_batch(low, step)


def typeable_batch(n: int, step: int = 1) -> int:
    """`n` rounded down to a batch size people type: a multiple of 8 from 16 up, of 2 below (and always a multiple
    of the accumulation `step`): 152, not 159; 12, not 13."""
    unit = 8 if n >= 16 else 2 if n >= 2 else 1
    unit = unit * step // math.gcd(unit, step)
    rounded = n // unit * unit
    return rounded if rounded >= step else max(step, n // step * step)


def budget_at_start(report: Report) -> int | None:
    """What the cell had to spend: on a GPU with a known limit, that limit minus what the GPU held at the start (the
    host's RAM is another budget); else the host's budget minus what the process held."""
    device = report.device_budget
    if device is not None:
        name, limit = device
        return max(0, limit - report.tf[name].baseline_bytes)
    if report.on_gpu:
        return None  # a GPU whose limit was not traced (quick mode): the host's RAM is not its budget
    env = report.env
    if env.budget_bytes <= 0:
        return None
    return max(0, env.budget_bytes - report.rss.baseline_bytes)


def budget_for_tf(report: Report) -> int | None:
    """What TF's peak over the cell's baseline may reach: `budget_at_start`, less on a CPU what the cell grew by
    besides TensorFlow's allocator (`outside_tf_bytes`), which a run at another batch needs again."""
    budget = budget_at_start(report)
    return None if budget is None else max(0, budget - outside_tf_bytes(report))


def grown_outside_tf(report: Report, profiler_share: float = 1.0) -> int:
    """What the cell's process grew by besides TensorFlow's allocator and tfmem's own profiler (whose memory is
    tfmem's, not the user's: `TraceInfo.profiler_rss_bytes`, an upper estimate, of which `profiler_share` is taken
    off): the RSS peak over the baseline less TF's peak over it. Negative where TF reused regions the process held
    already."""
    start = refused_call_start(report)
    if start is not None:  # up to the refused call: the cell's code; after it, the pre-flight's own memory
        return start[0] - start[1]
    profiler = report.trace.profiler_rss_bytes if report.trace is not None else 0
    grown = (report.rss.peak_bytes - report.rss.baseline_bytes) - max(0, report.tf_peak_bytes or 0)
    return grown - round(profiler_share * profiler)


def outside_tf_bytes(report: Report) -> int:
    """What a run of the cell needs besides TensorFlow's allocator, on a CPU (0 on a GPU, whose budget is its
    allocator's): `grown_outside_tf`. NumPy arrays the cell made, the graphs fit traced, oneDNN's scratch outside
    the allocator: a run at another batch needs them again, and a process limit (the guard) counts them. Measured on
    a CNN, a GRU and an MLP fit on CPU in quick mode, it hardly moves with the batch (32-45 MiB at batches 32 to
    512), so it comes off the budget whole, not scaled (docs/what-if.md, "The budget is the process's")."""
    if report.on_gpu or report.main_device is None or report.rss.peak_bytes <= 0:
        return 0
    return max(0, grown_outside_tf(report, PROFILER_SHARE_JUDGED), _outside_as_tf_peaked(report))


# how far from the traced peak (seconds, on the cell's clock) an RSS sample still shows the process as TF peaked: a
# few of the sampler's 20-50 ms intervals
NEAR_PEAK_S = 0.1


def _outside_as_tf_peaked(report: Report) -> int:
    """What the process held besides TensorFlow's allocator as the traced peak came, where the profiler's upper
    estimate exceeds all the cell grew by besides TF (it then says nothing of the profiler's share): its RSS samples
    within NEAR_PEAK_S of the peak, less TF's peak; 0 elsewhere, and without a traced peak or samples there. Half
    such an estimate left a GRU cell 19 MiB where its fresh runs grow 52 MiB besides TF, and the batch it named ran 9%
    over its budget (docs/what-if.md, "The budget is the process's"). As TF peaked the export had not run; the
    recorder's memory is in it, the safe side."""
    trace = report.trace
    if trace is None or not trace.events or report.tf_peak_bytes is None or refused_call_start(report) is not None:
        return 0
    if trace.profiler_rss_bytes <= grown_outside_tf(report, 0.0):
        return 0
    near = [rss for t, rss in report.rss.samples if abs(t - trace.peak_time_s) <= NEAR_PEAK_S]
    return round(max(near)) - report.rss.baseline_bytes - max(0, report.tf_peak_bytes) if near else 0


def tf_budget_within(report: Report, total: int) -> int:
    """What TF's peak over the cell's baseline may reach when the memory the cell may use in all is `total`: a
    GPU's memory for TensorFlow (less what the GPU held at the cell's start), or the process's memory on a CPU (less
    what the process held at the start and what the cell grew by besides TensorFlow's allocator)."""
    mem = report.main_device
    if report.on_gpu and mem is not None:
        return max(0, total - mem.baseline_bytes)
    return max(0, total - report.rss.baseline_bytes - outside_tf_bytes(report))


def largest_fitting_batch(report: Report, budget: int | None = None, **knobs: Unpack[WhatIfKnobs]) -> int | None:
    """The largest batch (as people type it) whose upper estimate fits: `budget` is the memory the cell may use in
    all (the process's on a CPU, the GPU's for TensorFlow on a GPU; default: the report's own budget). The other
    knobs are `predict`'s. None when not even the smallest batch fits, or the report has no budget. A batch larger
    than the rows the cell trained on is those rows: fit runs them as one batch."""
    tf_budget = None if budget is None else tf_budget_within(report, budget)
    batch = predict(report, tf_budget=tf_budget, **knobs).largest_batch
    rows = report.model.samples if report.model is not None else None
    return min(batch, rows) if batch is not None and rows else batch


def predict(
    report: Report,
    batch_size: int | None = None,
    policy: str | None = None,
    optimizer: str | None = None,
    accumulation_steps: int = 1,
    input_scale: float = 1.0,
    replicas: int | None = None,
    tf_budget: int | None = None,
    host: bool = True,
) -> WhatIf:
    """The TF peak over the cell's baseline had the cell run with these knobs (the quantity the report measured).

    `batch_size` is the batch the model learns from; with `accumulation_steps=k` each step runs batch_size / k
    samples. With `replicas=n` (a data-parallel tf.distribute strategy over n GPUs or workers) it is the global
    batch, and the answer is one replica's peak: all the weights, gradients and slots, the activations of
    batch_size / n samples, and all-reduce buffers. The basis is the report's (`basis_of`: the measured one once
    calibration.measured_basis ran, which `tfmem_magic.predict(..., calibrate=True)` does); its kind
    (advise/bases.py) gives the peak, the band and its notes. `tf_budget` replaces what the TF peak may reach
    (default: the report's budget less what was held at the cell's start, `budget_for_tf`). `host=False`: the budget
    is a GPU's a CPU report is modelled for (advise/gpu_target.py): no process margin, no note on this process, no
    largest batch (the GPU model judges its own)."""
    basis = basis_of(report)
    kind = kind_of(basis)
    knobs = _asked(basis.knobs, batch_size, policy, optimizer, accumulation_steps, input_scale, replicas)
    kind.check(knobs)
    notes = _replica_notes(knobs) + kind.notes(report, knobs) + _basis_notes(report, basis, knobs, host)
    peak, own_band = kind.peak_at(knobs), kind.band(knobs)
    beside = analytic_beside(report, basis)
    band = judged_band(own_band, peak, beside, basis, knobs)  # below the cell's batch: the analytic high end too
    notes += _spanned_notes(band, own_band)
    judged = kind.judged_peak(knobs, report)  # what 'fits' judges: a saved trace's first step, where it is higher
    budget, judged_notes = _budget(report, kind, tf_budget)
    notes += judged_notes + (_restart_notes(report, basis, knobs, budget) if host else [])
    notes += _first_step_notes(peak, judged)
    # a CPU's process budget, where the process was measured: above the cell's peak (or anywhere, where the cell
    # stopped before its peak) the process can grow by more than the allocator's bytes in use
    process = host and budget is not None and kind.process_budget and not report.on_gpu and report.rss.peak_bytes > 0
    extra = PROCESS_MARGIN if process else 0.0
    measured = kind.measured()  # the peak the process was measured at: none where the cell stopped early, or refused
    margin = judging_margin(peak, measured, band, extra)
    notes += _margin_notes(kind, margin, band, measured)
    parts = parts_at(basis, knobs)
    requested = sum(parts.values())  # the ratio shown is the one the peak has: the cell's and what a knob adds
    named, largest = kind.named_batch(knobs, report) if tf_budget is None else (False, None)  # a refusal's
    if budget is None or not host:  # host=False: the GPU model judges its own largest batch (gpu_target._largest)
        largest = None
    elif not named:
        largest = largest_batch(basis, knobs, budget, own_band, extra, measured, report, beside)
    return WhatIf(
        peak_bytes=peak,
        basis=kind.label(knobs),
        error_band=band,
        error_band_below=band_below(beside, knobs, peak, band),
        split={k: max(0, round(v)) if k != "other" else round(v) for k, v in parts.items()},
        fragmentation_ratio=round(peak / requested if requested > 0 else basis.fragmentation, 3),
        knobs=knobs,
        budget_bytes=budget,
        fits=None if budget is None else fits_within(judged, budget, measured, band, extra),
        largest_batch=largest,
        notes=notes,
        fit_margin=margin,
        process_margin=extra,
        measured_peak=measured,
    )


def analytic_beside(report: Report, basis: Basis) -> Analytic | None:
    """The analytic basis beside a calibrated one (measured, replay, the cell's own step): a second estimate of the
    same step. Where the two disagree, the truth can be anywhere between them: the band spans both on the low side
    everywhere (`band_below`) and on the high side below the cell's batch (`judged_band`). None for the other bases,
    and where the report gives no analytic basis."""
    if basis.name not in CALIBRATED or anchored_on_preflight(basis) or from_trace(basis):
        return None
    try:
        return Analytic(analytic_basis(report))
    except TfmemUsageError:
        return None


def judged_band(band: float, peak: float, beside: Analytic | None, basis: Basis, knobs: Knobs) -> float:
    """The band a calibrated peak is shown and judged with at `knobs`: its kind's, and below the cell's batch, where
    the analytic basis beside it reaches higher, up to the analytic high end. Below the cell's batch a replay moves
    one run's measured peak down by what it finds between the batches, so that run's own spread is a growing share of
    a shrinking peak: the zoo's U-Net at a quarter of its batch was 37% over in one run and 15% under in the next,
    where the analytic basis was within +11% to +27% (docs/accuracy.md). Above the cell's batch the band stays the
    kind's (on a CPU the process margin judges there)."""
    now = basis.knobs
    if beside is None or peak <= 0 or knobs.batch_size / knobs.split >= now.batch_size / now.split:
        return band
    high = beside.peak_at(knobs) * (1 + beside.band(knobs))
    return max(band, round(high / peak - 1, 4))


def _spanned_notes(band: float, own: float) -> list[str]:
    """Where the band's high end spans the analytic basis' below the cell's batch."""
    if band <= own:
        return []
    return [
        f"Below the cell's batch the analytic basis predicts higher: the band reaches up to its high end (+{band:.0%} "
        f"here, ±{own:.0%} where the two agree), and 'fits' and the largest batch judge with it (docs/what-if.md, "
        "'The bases')."
    ]


def band_below(beside: Analytic | None, knobs: Knobs, peak: int, band: float) -> float:
    """The low side of a calibrated prediction's band: where the analytic basis beside it predicts lower, down to the
    analytic low end. The calibrated basis' misses on the zoo were all above the fresh runs, where the analytic one
    was closer (docs/accuracy.md). 0 where the band is the same both ways."""
    if beside is None or peak <= 0:
        return 0.0
    low = beside.peak_at(knobs) * (1 - beside.band(knobs))
    below = 1 - low / peak
    return round(below, 4) if below > band else 0.0


def _asked(
    now: Knobs,
    batch_size: int | None,
    policy: str | None,
    optimizer: str | None,
    accumulation_steps: int,
    input_scale: float,
    replicas: int | None,
) -> Knobs:
    """The knobs `predict` was asked for, the cell's own where one is not given; checked."""
    knobs = Knobs(
        batch_size=int(now.batch_size if batch_size is None else batch_size),
        policy=policy or now.policy,
        optimizer=optimizer_key(optimizer) or now.optimizer,
        accumulation_steps=int(accumulation_steps),
        input_scale=float(input_scale),
        replicas=int(now.replicas if replicas is None else replicas),
    )
    _check(knobs)
    return knobs


def _replica_notes(knobs: Knobs) -> list[str]:
    """What one replica of several holds."""
    if knobs.replicas <= 1:
        return []
    return [
        f"One replica of {knobs.replicas}: each holds the weights, the gradients and the optimizer's "
        f"slots, and the activations of {knobs.batch_size / knobs.replicas:g} samples (the global batch "
        f"{knobs.batch_size} shared), plus one more copy of the gradients for the all-reduce. "
        "Checked against MultiWorkerMirroredStrategy workers on CPU (2 and 3, the same fit): the "
        "prediction was 1% below to 30% above each worker's peak."
    ]


def _basis_notes(report: Report, basis: Basis, knobs: Knobs, host: bool = True) -> list[str]:
    """What any kind of basis notes: a slope that is an upper bound, fit's copy counted in, a cell with no peak to
    anchor on, mixed_float16 on a CPU. `host=False` (a GPU the report is modelled for): neither fit's copy, which
    stays in host memory there, nor mixed_float16's speed on a CPU, the GPU's own policy."""
    notes = []
    if basis.slope_source == UPPER_BOUND_SOURCE and knobs.batch_size > basis.knobs.batch_size:
        notes.append(
            "The trace stopped before the cell's peak, so the slope is the cell's whole peak over its "
            "batch: an upper bound (calibrate to measure it)."
        )
    if host and basis.copy_missing > 0.05 * max(basis.measured_peak or 0, 1):
        notes.append(
            f"Includes the {format_bytes(basis.copy_missing)} copy fit() makes of the numpy arrays: this run "
            "had freed it before its peak, most runs keep it through the peak (tf.data streaming removes "
            "it)."
        )
    if basis.measured_peak is None and report.status in ("oom", "refused", "error", "interrupted"):
        notes.append(
            f"The cell stopped early ({report.status}), so its peak is not the full step's: the prediction "
            "comes from the model (and the trace up to the stop), without a measured peak to anchor it."
        )
    elif basis.measured_peak is None:
        notes.append(
            "TensorFlow's allocator was not measured in this cell: the prediction comes from the model "
            "alone, without the cell's peak to anchor it."
        )
    if host and knobs.policy == "mixed_float16" and "GPU" not in " ".join(report.env.devices):
        notes.append("mixed_float16 runs 74-260x slower on CPU (TF 2.21): use mixed_bfloat16 there.")
    return notes


def _budget(report: Report, kind: Kind, tf_budget: int | None) -> tuple[int | None, list[str]]:
    """What the TF peak may reach, and the notes on how it was reckoned: `tf_budget` where given; else the kind's
    own (`Kind.judged_budget`: a refused call's, as its pre-flight judged it), or the report's (`budget_for_tf`:
    less what the cell's process grew by besides TensorFlow's allocator, which a run at another batch takes again)."""
    own = kind.judged_budget(report) if tf_budget is None else None
    if own is not None:
        return own[0], [own[1]]
    budget = budget_for_tf(report) if tf_budget is None else tf_budget
    outside = outside_tf_bytes(report)
    if tf_budget is not None or budget is None or outside < 1 << 20:
        return budget, []
    runtime = (
        " (TensorFlow's runtime started in this cell: about 0.5 GiB of it the first time)"
        if report.env.tensorflow_started_in_cell
        else ""
    )
    return budget, [
        f"The {format_bytes(budget)} left for TensorFlow's peak leave out the "
        f"{format_bytes(outside)} this cell's process grew by besides TensorFlow's allocator{runtime}: "
        "NumPy arrays, traced graphs, oneDNN's scratch (of tfmem's own profiler, only the part it surely held is "
        "left out of them). A run at another batch takes them again, and a process limit counts them."
    ]


def _restart_notes(report: Report, basis: Basis, knobs: Knobs, budget: int | None) -> list[str]:
    """Above the cell's batch on a CPU: the prediction is from where the cell started, not this kernel as it is."""
    now = basis.knobs
    above = knobs.batch_size / knobs.split > now.batch_size / now.split
    held = min(report.rss.end_bytes - report.rss.baseline_bytes, report.tf_peak_bytes or 0)
    if budget is None or report.on_gpu or held < 1 << 20 or not above:
        return []
    return [
        f"From where the cell started (a fresh kernel, or this one before the cell): after it, this "
        f"process keeps the ~{format_bytes(held)} of regions TensorFlow's allocator grew, and a larger "
        "batch reuses only part of them (a CNN fit at batch 568 after one at 256 grew the process by "
        "94% of its peak). Restart the kernel first, or let the pre-flight judge it (--limit)."
    ]


def _first_step_notes(peak: float, judged: float) -> list[str]:
    """Where 'fits' judges a higher moment than the predicted step: the trace's first step (docs/gpu.md)."""
    if judged <= peak:
        return []
    return [
        f"'Fits' and the largest batch are judged at {format_bytes(judged)}, not the step's "
        f"{format_bytes(peak)}: the allocator's peak since the process started is above the trace's (a first "
        "step's, on a GPU its convolutions' autotuning), moved with the batch as the step is (docs/gpu.md, "
        "'The first step')."
    ]


def _margin_notes(kind: Kind, margin: float, band: float, measured: float) -> list[str]:
    """Where the process margin, not the band, judges whether the peak fits."""
    if margin <= band:
        return []
    return [
        f"Whether this fits is judged with +{margin:.0%}, not ±{band:.0%}: on a CPU the budget is the "
        "process's, which can grow by more than the allocator's bytes in use (oneDNN's buffers, the "
        "regions' pages: +21% on a CNN at batch 568), and this cell measured the process "
        + ("at its own peak only." if measured else kind.unmeasured)
    ]


def _check(knobs: Knobs) -> None:
    if knobs.batch_size < 1 or knobs.batch_size > MAX_BATCH:
        raise TfmemUsageError(f"batch_size={knobs.batch_size}: give a batch of 1 to {MAX_BATCH}")
    if knobs.policy not in POLICIES:
        raise TfmemUsageError(f"policy={knobs.policy!r}: use one of {', '.join(POLICIES)}")
    if knobs.optimizer is not None and knobs.optimizer not in OPTIMIZER_SLOTS:
        raise TfmemUsageError(f"optimizer={knobs.optimizer!r}: use one of {', '.join(OPTIMIZER_SLOTS)}")
    if knobs.accumulation_steps < 1 or knobs.accumulation_steps > knobs.batch_size:
        raise TfmemUsageError(f"accumulation_steps={knobs.accumulation_steps}: give 1 to the batch size")
    if knobs.replicas < 1 or knobs.split > knobs.batch_size:
        raise TfmemUsageError(
            f"replicas={knobs.replicas}: give 1 to the batch size (with accumulation_steps="
            f"{knobs.accumulation_steps}, at most {knobs.batch_size // knobs.accumulation_steps})"
        )
    if not 0.05 <= knobs.input_scale <= 64:
        raise TfmemUsageError(f"input_scale={knobs.input_scale:g}: give a factor between 0.05 and 64")


def summary(report: Report) -> Prediction | None:
    """The report's `prediction` block: the analytic basis at the cell's own settings (None without a model)."""
    try:
        basis = basis_of(report)
    except TfmemUsageError:
        return None
    band = kind_of(basis).earned_band()
    parts = parts_at(basis, basis.knobs)  # with a replica's all-reduce copy of the gradients
    fixed = parts["weights"] + parts["gradients"] + parts["optimizer"] + basis.input_copy + max(0, basis.other)
    # per sample of the batch the model line names (the global one: a replica runs 1/replicas of it)
    per_sample = (basis.activations_per_sample + basis.input_per_sample) * growth_ratio(basis) / basis.knobs.split
    return Prediction(
        basis=basis.name,
        static_bytes=round(fixed * basis.fragmentation),
        per_sample_bytes=round(per_sample),
        fragmentation_ratio=round(basis.fragmentation, 3),
        error_band=band,
    )
