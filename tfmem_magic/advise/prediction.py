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
- "measured": `calibration.measured_basis()` trains a clone of the model (in a fresh process: calibrate.py) at a
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

This module imports no TensorFlow or Keras; the probes run in another process (calibrate.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, Knobs, ModelInfo, Prediction, ReplayCurve, Report
from tfmem_magic.core.sizes import format_bytes

# Training keeps each layer's output for the backward pass and makes a gradient of the same size while it runs
# backward; measured on TF 2.21 CPU (docs/design.md, 'Batch scaling and the analytic prior') the step peak is ~1.6x
# the layer outputs.
TRAIN_ACTIVATION_FACTOR = 1.6
# Inference frees each output once the next layer has it: the peak is about the largest neighbouring pair.
INFER_ACTIVATION_FACTOR = 1.0
TYPICAL_FRAGMENTATION = 1.3
# What a larger batch adds gets closer-fitting chunks than the cell's mix (its small tensors and the chunks BFC did
# not split for them): over their span (batch 8 to 128) the probes measured 1.03x-1.23x on the nine zoo models
# whose probe traces saw every free, median 1.09 (benchmarks/predict_accuracy.py --zoo), while the cells' own
# ratios were 1.01x-1.44x. The analytic basis uses it, when below the cell's measured ratio, for what a knob adds;
# what a knob removes keeps the cell's ratio.
GROWTH_FRAGMENTATION = 1.10
ANALYTIC_BAND = 0.30
UPPER_BOUND_SOURCE = "the cell's peak (the trace stopped before it: an upper bound)"
MEASURED_BAND = 0.10
# the step replay's band (analyze/step_replay.py), as measured on the zoo (benchmarks/predict_accuracy.py --zoo,
# docs/what-if.md): in two runs, 69 and 67 of 70 points within 15% of the range of three fresh runs (63 and 60
# within 10%), on both sides of the cell's batch
REPLAY_BAND = 0.15
# the band of the cell's own training step replayed (custom training: advise/step_export.py), as measured by
# benchmarks/custom_step_accuracy.py on four programs (a GAN, keras-io's DCGAN at 32x32, a distiller, TensorFlow's
# GradientTape quickstart) at half and twice the cell's batch: errors up to 49% (the DCGAN, whose real peak itself
# took 77 or 100 MiB at one batch in two sets of fresh runs), most within 15%: not the clone replay's band, the
# analytic one (docs/bfc-replay.md, "The cell's own step, saved")
OWN_STEP_BAND = ANALYTIC_BAND
# the band of a refused call's replay (advise/preflight.refused_basis): the whole peak is predicted, not a change from
# a measured one. The pre-flight's replay of TF's allocator at the call's batch against the step measured, in two runs
# of benchmarks/preflight_accuracy.py: -1.4% to +34.1% (an MLP over in both, +25.0% and +34.1%; docs/preflight.md)
PREFLIGHT_BAND = 0.35
# On a CPU the budget is the process's, and the process grows by more than TensorFlow's bytes in use at some batches:
# oneDNN's own buffers appear at a size threshold, and the allocator's regions count as their pages are touched (a
# CNN fit at batch 568 grew the process by 2.14 GiB where the allocator's peak in use was 1.74 GiB: +21% in two
# runs; +7% at 512, -2% at 544). What the cell's process grew by at its own batch is measured (`outside_tf_bytes`);
# a peak above the cell's is judged with this margin where the band is narrower: the replay's high end in the
# pre-flight, which judges the same process (advise/preflight.py). docs/what-if.md, "The budget is the process's"
PROCESS_MARGIN = 0.40
# the trace's busiest moment (most bytes in tensors with the batch dimension) sets the slope above the cell's batch
# when it holds this much more of them than the peak did (the GRU of tests/integration/test_largest_batch.py: 3.5x)
MOMENT_RATIO = 1.2
CALIBRATED = ("measured", "replay")  # the bases that stand on probe runs
OPTIMIZER_SLOTS = {
    "sgd": 0,
    "sgd+momentum": 1,
    "rmsprop": 1,
    "adagrad": 1,
    "adam": 2,
    "adamw": 2,
    "nadam": 2,
    "adamax": 2,
    "lion": 1,
    "adafactor": 1,
    "ftrl": 2,
    "lamb": 2,
}
POLICIES = {"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2, "bfloat16": 2, "float16": 2, "float64": 8}
MAX_BATCH = 1 << 20


@dataclass
class WhatIf:
    """The answer of `predict()`: the predicted TF peak over the cell's baseline, its parts and its uncertainty."""

    peak_bytes: int
    basis: str
    error_band: float  # relative: 0.3 = the true peak is expected within ±30%
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

    def margin_at(self, peak: float) -> float:
        """The margin another peak of these knobs' curve (another batch) is judged with."""
        return judging_margin(peak, self.measured_peak, self.error_band, self.process_margin)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the basis from a report ----------------------------------------------------------------------------------------


def optimizer_key(name: str | None, momentum: bool = False) -> str | None:
    if not name:
        return None
    key = name.lower()
    return "sgd+momentum" if key == "sgd" and momentum else key


def _bytes_per_element(policy: str | None) -> int:
    return POLICIES.get(policy or "float32", 4)


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
    return trace.batch_bytes_at_peak * (seen + untraced) / max(seen, 1) / trace.replica_batch_size


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
    trace = report.trace
    return 0 if trace is None else sum(g.requested_bytes for g in trace.by_phase if g.phase == "untraced")


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


def parts_at(basis: Basis, knobs: Knobs, micro: float | None = None) -> dict[str, float]:
    """The requested-bytes parts of the peak at `knobs` (at the micro-batch `micro` instead of the knobs' own, when
    given: the step replay's share of a prediction, see peak_at)."""
    now = basis.knobs
    micro = knobs.batch_size / knobs.split if micro is None else micro
    dtype_ratio = _bytes_per_element(knobs.policy) / _bytes_per_element(now.policy)
    below = basis.activations_per_sample_below
    now_micro = now.batch_size / now.split  # the cell's own step: one replica's share when it ran under a strategy
    shortfall = 0.0
    if below is not None and basis.moment_gap and micro > now_micro:
        # two moments of the step: the peak's, growing by the slope below from the cell's peak, and the busiest
        # one's, growing faster from `moment_gap` lower; the step's peak is whichever is higher at this batch
        per_batch = max(
            basis.activations_per_sample * now_micro + below * (micro - now_micro),
            basis.activations_per_sample * micro - basis.moment_gap,
        )
    elif micro >= now_micro or (below is None and not basis.lines_below):
        per_batch = basis.activations_per_sample * micro
    else:  # below the cell's batch, the highest of the peak's line (a slope of its own there: a measured basis' is
        # the analytic one; an analytic basis' its trace's peak's, where the busiest moment set the slope above)
        # and the lines of the step's other moments (a recurrent model's backward loop: _lines_below)
        per_batch = max(_lines_at(basis, micro, now_micro))
        # a measured basis whose slope below (the cell's trace's) is steeper than its probes' above takes more out
        # of the cell's peak than the activations it put in: the rest comes off "other", so that the total is the
        # cell's peak less what leaves with the batch (clamped here, a GRU's batch 8 was predicted 0 bytes)
        shortfall, per_batch = min(0.0, per_batch), max(0.0, per_batch)
    scale = dtype_ratio * knobs.input_scale / now.input_scale
    activations = per_batch * scale
    batch_input = basis.input_per_sample * knobs.input_scale / now.input_scale * micro
    optimizer = float(basis.optimizer)
    changed_optimizer = knobs.optimizer != now.optimizer or knobs.accumulation_steps != now.accumulation_steps
    if basis.gradients and changed_optimizer:
        # a new optimizer (or one with accumulation) is built in the re-run cell: its slots are the cell's memory
        slots = OPTIMIZER_SLOTS.get(knobs.optimizer or "", 2)
        optimizer = basis.gradients * (slots + (1 if knobs.accumulation_steps > 1 else 0))
    weights = float(basis.weights)
    if dtype_ratio < 1 and basis.gradients:
        # mixed precision keeps float32 variables and casts them to the compute dtype for each step
        weights += basis.weights * dtype_ratio if basis.weights else 0.0
    gradients = float(basis.gradients) * gradient_copies(knobs)
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": activations,
        "input": basis.input_copy * knobs.input_scale / now.input_scale + batch_input,
        "other": float(basis.other) + shortfall * scale,
    }


def _lines_at(basis: Basis, micro: float, now_micro: float) -> list[float]:
    """Below the cell's batch: the batch-dependent bytes at `micro` on the peak's line, then on the line of each of
    the step's other moments that shrink less (`Basis.lines_below`); the step's peak is on the highest."""
    top = basis.activations_per_sample * now_micro
    below = basis.activations_per_sample_below
    peak_line = top - (basis.activations_per_sample if below is None else below) * (now_micro - micro)
    return [peak_line] + [top - slope * (now_micro - micro) - gap for slope, gap in basis.lines_below]


def another_moment_below(basis: Basis, knobs: Knobs) -> bool:
    """At this smaller batch another moment of the step than the cell's peak is predicted to be the peak."""
    now_micro, micro = basis.knobs.batch_size / basis.knobs.split, knobs.batch_size / knobs.split
    if micro >= now_micro or not basis.lines_below:
        return False
    lines = _lines_at(basis, micro, now_micro)
    return max(lines[1:]) > lines[0]


def gradient_copies(knobs: Knobs) -> int:
    """Sets of gradients a step holds: each replica holds all of the weights, gradients and slots, and the
    all-reduce of the gradients needs buffers of their size, counted as one more copy (without it an MLP's workers,
    whose memory is mostly gradients and slots, were under-predicted by 5-15%: benchmarks/replicas_check.py)."""
    return 2 if knobs.replicas > 1 else 1


def peak_at(basis: Basis, knobs: Knobs) -> int:
    """The allocator's peak at `knobs`. Where the step replay applies (`replay_applies`), the cell's measured peak
    moved by what the replay finds between the cell's batch and the asked one, plus what the other knobs change (an
    optimizer's slots, accumulation's buffers: the parts below, at the cell's batch). Otherwise the parts: the
    cell's in the cell's own chunks (so its settings give back its measurement), and what the knobs change in the
    chunks the probes measured for such changes."""
    if not replay_applies(basis, knobs):
        return _parts_peak(basis, knobs)
    assert basis.replay is not None
    now_micro = basis.knobs.batch_size / basis.knobs.split
    others = _parts_peak(basis, knobs, now_micro)
    micro = knobs.batch_size / knobs.split
    moved = replay_moved(basis, micro, now_micro)
    replayed = max(0, round(others + moved))
    if own_step_replayed(basis) and micro < now_micro and not anchored_on_preflight(basis):
        # below the cell's batch, the cell's own step replayed fell 21% under the real peak where the parts model
        # did not (a GAN and a distiller at half the batch, benchmarks/custom_step_accuracy.py): the saved step's
        # probes restore the optimizers' slots before their first step, the cell built them in it. An
        # under-prediction here is a shrink-batch that runs out of memory: the larger of the two
        # (a refused call's anchor is the same probes' replay: no cell that built them in its step to differ from)
        return max(replayed, _parts_peak(basis, knobs))
    return replayed


def own_step_replayed(basis: Basis) -> bool:
    """The basis's replay ran the cell's own saved step (custom training: advise/step_export.py), not a clone's:
    no parts probes ran, so its parts are the analytic ones."""
    return basis.replay is not None and basis.replay.source == "step"


def from_trace(basis: Basis) -> bool:
    """The basis is a saved trace's own sequence replayed (analyze/saved_trace.trace_whatif), not the cell's model."""
    return basis.replay is not None and basis.replay.source == "trace"


def is_from_trace(report: Report) -> bool:
    """The report's what-if stands on a saved trace's own sequence (no model: the batch is its only knob)."""
    return report.whatif_basis is not None and from_trace(report.whatif_basis)


def anchored_on_preflight(basis: Basis) -> bool:
    """The basis' anchor is the pre-flight's prediction for a call it refused, not a measured peak."""
    return basis.anchor == "preflight" and basis.measured_peak is not None


def is_preflight_anchored(report: Report) -> bool:
    """The report's what-if stands on the pre-flight's replay of a call it refused (advise/preflight.refused_basis)."""
    return report.whatif_basis is not None and anchored_on_preflight(report.whatif_basis)


def refused_call_start(report: Report) -> tuple[int, int] | None:
    """Where a call the pre-flight refused on its replay began, over the cell's baseline: (what the process had grown
    by, what TF's allocator had). Nothing of the call ran, so what the process grew by after it is the pre-flight's
    own memory (its replay's arrays: 78 MiB for a GRU's), tfmem's, as the profiler's is. None for any other report
    (and for one saved before a refusal kept its replay)."""
    pre, device = report.preflight, report.main_device
    if pre is None or pre.verdict != "refused" or pre.replay is None or device is None:
        return None
    return pre.rss_bytes - report.rss.baseline_bytes, max(0, pre.tf_bytes - device.baseline_bytes)


def basis_band(basis: Basis) -> float:
    """The error band a basis earned: the replay's on the zoo (two probes aligned; a refused call's, whose whole peak
    is predicted, the pre-flight's), the measured basis', or the analytic one (also a saved trace's, whose
    allocations are scaled by their shapes alone)."""
    if from_trace(basis):
        return ANALYTIC_BAND
    if basis.name == "replay" and own_step_replayed(basis):
        return OWN_STEP_BAND
    if basis.name == "replay" and anchored_on_preflight(basis):
        return PREFLIGHT_BAND
    return {"replay": REPLAY_BAND, "measured": MEASURED_BAND}.get(basis.name, ANALYTIC_BAND)


def trace_replay_words(report: Report, curve: ReplayCurve) -> str:
    """How a saved trace's what-if is made, in words (the start of a sentence)."""
    device = report.main_device_name or "its device"
    kind = "a GPU trace" if device.startswith("GPU") else "a saved trace"
    return (
        f"Predicted from {kind} ({device}, {report.env.allocator}): the trace's own {curve.events} memory "
        f"events, the {curve.scaled} allocations whose shape carries batch {curve.probes[0]} (one step of "
        "this device, per replica) scaled, through a simulation of TensorFlow's BFC allocator with the trace's "
        "settings, anchored on the trace's peak"
    )


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


def replay_applies(basis: Basis, knobs: Knobs) -> bool:
    """The step replay predicts the batch knob: its self-check passed, the cell's peak anchors it, and the knobs keep
    what the probes ran with (precision, input size, one replica)."""
    curve, now = basis.replay, basis.knobs
    return (
        curve is not None
        and curve.passed
        and bool(curve.peaks)
        and basis.measured_peak is not None
        and knobs.policy == now.policy
        and knobs.input_scale == now.input_scale
        and knobs.replicas == now.replicas
    )


def replay_change(curve: ReplayCurve, micro: float, now_micro: float) -> tuple[float, float]:
    """What the replay finds between the cell's step batch and `micro`, in each of the two probes' op orders: (the
    smaller change, the larger). Each order is compared with itself: a spike one order has at the cell's batch
    (MobileNetV2's orders differ by 19 MiB there) must not become a drop at every other batch."""
    changes = sorted(replay_peak(curve, micro, order) - replay_peak(curve, now_micro, order) for order in (0, 1))
    return changes[0], changes[1]


def replay_moved(basis: Basis, micro: float, now_micro: float) -> float:
    """What the basis' replay moves its anchor by, from the cell's step batch to `micro`. On a measured anchor, the
    larger of the two op orders' changes (`replay_change`): the safe side both ways (a shrink that frees less, a
    growth that adds more). On the pre-flight's (a refused call), whose anchor is the larger order's replayed
    peak: the larger order's peak at `micro` less that, so that the what-if gives what the pre-flight judged at every
    batch (each order from itself would add the orders' spread at the refused batch, 50 MB on a CNN at 1024, to
    every other)."""
    assert basis.replay is not None
    if anchored_on_preflight(basis):
        return larger_order_peak(basis.replay, micro) - larger_order_peak(basis.replay, now_micro)
    return replay_change(basis.replay, micro, now_micro)[1]


def larger_order_peak(curve: ReplayCurve, micro: float) -> float:
    """The replayed peak at `micro` in whichever of the two probes' op orders holds more there."""
    return max(replay_peak(curve, micro, order) for order in (0, 1))


def replay_peak(curve: ReplayCurve, micro: float, order: int = 0) -> float:
    """The replayed peak at a step's batch `micro` in probe one's op order (`order` 1: probe two's): interpolated
    between the curve's batches, extended in a line past its ends."""
    xs, ys = curve.batches, (curve.second_peaks if order and curve.second_peaks else curve.peaks)
    if len(xs) == 1:
        return float(ys[0])
    k = min(max(bisect.bisect_left(xs, micro), 1), len(xs) - 1)  # the segment [k-1, k] holding micro (or the end)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return max(0.0, y0 + (y1 - y0) * (micro - x0) / (x1 - x0))


def _parts_peak(basis: Basis, knobs: Knobs, micro: float | None = None) -> int:
    total = sum(parts_at(basis, knobs, micro).values())
    own = sum(parts_at(basis, basis.knobs).values())
    # growth in the chunks large tensors get (measured: GROWTH_FRAGMENTATION, or the probes'); a shrink frees the
    # cell's own (below the cell's batch the growth ratio over-predicted: benchmarks/predict_accuracy.py --zoo),
    # except after an OOM, where the probes' line is all there is
    shrink_own = basis.increment_fragmentation is None or basis.measured_peak is not None
    ratio = growth_ratio(basis) if total > own or not shrink_own else basis.fragmentation
    return max(0, round(own * basis.fragmentation + (total - own) * ratio))


def growth_ratio(basis: Basis) -> float:
    """Allocator chunk bytes per requested byte of what a larger batch adds."""
    return basis.increment_fragmentation or basis.growth_fragmentation or basis.fragmentation


def judging_margin(peak: float, measured: float, band: float, process_margin: float = 0.0) -> float:
    """The margin a peak is judged with against a budget: its band, and `process_margin` in all above `measured`
    (the highest peak the process was measured at; 0 where none was: a CPU's process budget, PROCESS_MARGIN)."""
    return max(band, process_margin) if peak > measured else band


def fits_within(peak: float, budget: float, measured: float, band: float, process_margin: float = 0.0) -> bool:
    """The peak, with the margin it is judged with (`judging_margin`), fits the budget."""
    return peak * (1 + judging_margin(peak, measured, band, process_margin)) <= budget


def largest_batch(
    basis: Basis, knobs: Knobs, budget: int, band: float, process_margin: float = 0.0, measured: float = 0.0
) -> int | None:
    """The largest batch (other knobs fixed) whose upper estimate stays within the budget; None if none does."""

    def fits(batch: int) -> bool:
        return fits_within(peak_at(basis, replace(knobs, batch_size=batch)), budget, measured, band, process_margin)

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


def preflight_budget(report: Report) -> int:
    """What the TF peak over the cell's baseline may reach, judged as the pre-flight judged the call it refused
    (preflight._judge: the process as the call began, plus PROCESS_MARGIN on what it grows by, under the guard's
    threshold): what TensorFlow's allocator held as the call began (the process holds it already) and the regions it
    held beyond that (filled before the process grows) are taken back with the margin, which widens only the
    growth. So the refusal and the what-if name one largest batch."""
    pre, start = report.preflight, refused_call_start(report)
    assert pre is not None and start is not None
    return max(0, pre.threshold_bytes - pre.rss_bytes + round((1 + PROCESS_MARGIN) * (pre.reusable_bytes + start[1])))


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


def grown_outside_tf(report: Report) -> int:
    """What the cell's process grew by besides TensorFlow's allocator and tfmem's own profiler (whose memory is
    tfmem's, not the user's: `TraceInfo.profiler_rss_bytes`): the RSS peak over the baseline less TF's peak over
    it. Negative where TF reused regions the process held already."""
    start = refused_call_start(report)
    if start is not None:  # up to the refused call: the cell's code; after it, the pre-flight's own memory
        return start[0] - start[1]
    profiler = report.trace.profiler_rss_bytes if report.trace is not None else 0
    return (report.rss.peak_bytes - report.rss.baseline_bytes) - max(0, report.tf_peak_bytes or 0) - profiler


def outside_tf_bytes(report: Report) -> int:
    """What a run of the cell needs besides TensorFlow's allocator, on a CPU (0 on a GPU, whose budget is its
    allocator's): `grown_outside_tf`. NumPy arrays the cell made, the graphs fit traced, oneDNN's scratch outside
    the allocator: a run at another batch needs them again, and a process limit (the guard) counts them. Measured on
    a CNN, a GRU and an MLP fit on CPU in quick mode, it hardly moves with the batch (32-45 MiB at batches 32 to
    512), so it comes off the budget whole, not scaled (docs/what-if.md, "The budget is the process's")."""
    if report.on_gpu or report.main_device is None or report.rss.peak_bytes <= 0:
        return 0
    return max(0, grown_outside_tf(report))


def tf_budget_within(report: Report, total: int) -> int:
    """What TF's peak over the cell's baseline may reach when the memory the cell may use in all is `total`: a
    GPU's memory for TensorFlow (less what the GPU held at the cell's start), or the process's memory on a CPU (less
    what the process held at the start and what the cell grew by besides TensorFlow's allocator)."""
    mem = report.main_device
    if report.on_gpu and mem is not None:
        return max(0, total - mem.baseline_bytes)
    return max(0, total - report.rss.baseline_bytes - outside_tf_bytes(report))


def largest_fitting_batch(report: Report, budget: int | None = None, **knobs: Any) -> int | None:
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
) -> WhatIf:
    """The TF peak over the cell's baseline had the cell run with these knobs (the quantity the report measured).

    `batch_size` is the batch the model learns from; with `accumulation_steps=k` each step runs batch_size / k
    samples. With `replicas=n` (a data-parallel tf.distribute strategy over n GPUs or workers) it is the global
    batch, and the answer is one replica's peak: all the weights, gradients and slots, the activations of
    batch_size / n samples, and all-reduce buffers. The basis is the report's (`basis_of`: the measured one once
    calibration.measured_basis ran, which `tfmem_magic.predict(..., calibrate=True)` does). `tf_budget` replaces
    what the TF peak may reach (default: the report's budget less what was held at the cell's start,
    `budget_for_tf`).
    """
    basis = basis_of(report)
    now = basis.knobs
    knobs = Knobs(
        batch_size=int(now.batch_size if batch_size is None else batch_size),
        policy=policy or now.policy,
        optimizer=optimizer_key(optimizer) or now.optimizer,
        accumulation_steps=int(accumulation_steps),
        input_scale=float(input_scale),
        replicas=int(now.replicas if replicas is None else replicas),
    )
    _check(knobs)
    if from_trace(basis) and replace(knobs, batch_size=now.batch_size) != now:
        raise TfmemUsageError(
            "a saved trace predicts the batch only (it holds TensorFlow's allocations, not the "
            "model): give batch_size, and profile the model itself (%%tfmem) for precision, "
            "optimizer, accumulation, input size or replicas"
        )
    notes = []
    if knobs.replicas > 1:
        notes.append(
            f"One replica of {knobs.replicas}: each holds the weights, the gradients and the optimizer's "
            f"slots, and the activations of {knobs.batch_size / knobs.replicas:g} samples (the global batch "
            f"{knobs.batch_size} shared), plus one more copy of the gradients for the all-reduce. "
            "Checked against MultiWorkerMirroredStrategy workers on CPU (2 and 3, the same fit): the "
            "prediction was 1% below to 30% above each worker's peak."
        )
    replayed = replay_applies(basis, knobs)
    curve = basis.replay
    own_step = own_step_replayed(basis)
    # no parts probes ran for the cell's own step, nor for a refused call's pre-flight: their parts are the analytic
    name = (
        "replay"
        if replayed
        else "analytic"
        if own_step or anchored_on_preflight(basis)
        else "measured"
        if basis.name in CALIBRATED
        else basis.name
    )
    band = basis_band(basis) if replayed else MEASURED_BAND if name == "measured" else ANALYTIC_BAND
    micro = knobs.batch_size / knobs.split
    if replayed and from_trace(basis):
        assert curve is not None
        notes.append(
            trace_replay_words(report, curve) + f", replayed at batch {micro:g}. The band is the analytic "
            "one: scaling by shape alone misses what carries the batch without a batch dimension "
            "(measured on CPU models: docs/bfc-replay.md)."
        )
    elif replayed:
        assert curve is not None
        now_micro = now.batch_size / now.split
        low, high = replay_change(curve, micro, now_micro)
        spread = ""
        if high - low > 0.01 * max(1, basis.measured_peak or 0) and not anchored_on_preflight(basis):
            spread = (
                f" The two probes ran the step's ops in different orders, which moves the change by "
                f"{format_bytes(round(high - low))}: the larger change is given."
            )
        saved = basis.calibration.get("step", "train_step")
        kind = "step" if "predict_step" in saved or "test_step" in saved else "training step"
        step = "the model's step" if not own_step else f"this model's own {kind} ({saved}, saved with its variables)"
        if own_step:
            spread += (
                f" The band is ±{OWN_STEP_BAND:.0%}: a custom step replayed was measured on four programs "
                "only, up to 49% off where the real peak itself took two values (docs/bfc-replay.md)."
            )
        if own_step and micro < now_micro and not anchored_on_preflight(basis):
            spread += (
                " Below the cell's batch the larger of this and the parts model's prediction is given: the "
                "saved step's probes hold the optimizers' slots before their first step, the cell built them "
                "in it, and the replay alone fell 21% short there once."
            )
        if anchored_on_preflight(basis):
            anchor = (
                f"anchored on what the pre-flight predicted for the {now.batch_size} batch it refused (TF's "
                "allocator as the call began, plus the replayed step: nothing of the step ran to be "
                "measured)"
            )
            if not own_step:
                spread += (
                    f" The band is ±{PREFLIGHT_BAND:.0%}: the whole peak is predicted, and the pre-flight's "
                    "replay of TF's allocator was -1% to +34% off the step measured on six models "
                    "(docs/preflight.md)."
                )
        else:
            anchor = "anchored on this cell's measured peak"
        notes.append(
            f"Replayed: {step}, traced from a fresh allocator at batches {curve.probes[0]} and "
            f"{curve.probes[1]}, replayed at batch {micro:g} through a simulation of TensorFlow's BFC "
            f"allocator, and {anchor}.{spread}"
        )
        if micro > 2 * curve.batches[-1]:
            band = ANALYTIC_BAND
            notes.append(
                f"The replay's curve ends at batch {curve.batches[-1]}: beyond it the peak is extended in a "
                "line, so the analytic error band applies."
            )
    elif curve is not None and curve.passed and basis.measured_peak is not None:
        notes.append(
            "The step replay ran at the cell's precision and input size with one replica: for these "
            "settings "
            + (
                "the parts the cell's trace measured predict (the analytic basis)."
                if own_step
                else "the model's parts predict (the analytic basis), from the pre-flight's "
                "prediction at the cell's batch."
                if anchored_on_preflight(basis)
                else "the probes' parts predict (the measured basis)."
            )
        )
    elif curve is not None and curve.why_not and name == "measured":
        notes.append(f"The step replay is not used: {curve.why_not}.")
    if name == "measured" and (knobs.policy != now.policy or knobs.input_scale != now.input_scale):
        band = ANALYTIC_BAND
        notes.append(
            "The probes ran at the cell's precision and input size: for another, the slope is scaled "
            "from the model, so the analytic error band applies."
        )
    probed = basis.calibration.get("batches") or []
    if name == "measured" and probed and not (min(probed) / 2 <= micro <= 2 * max(probed)):
        band = ANALYTIC_BAND  # a band is earned where the probes ran, not far outside it
        notes.append(
            f"The probes ran at batch {min(probed)}-{max(probed)}: a batch this far outside that range is "
            "extrapolated, so the analytic error band applies."
        )
    elif name == "measured" and micro < now.batch_size:
        # measured on 14 models (benchmarks/predict_accuracy.py --zoo): above the cell's batch the measured basis is
        # within 10% on most points; below it, the cell's own run (its first step, whether fit's copy of the
        # arrays was still live at its peak) is most of a small batch's peak, and misses reached 30-60%
        band = ANALYTIC_BAND
        notes.append(
            "Below the cell's batch, most of the peak is what the cell's own run held apart from its "
            "batch, which varies from run to run: the prediction is the analytic one (what the cell's "
            "trace says leaves with the batch), with its error band."
        )
    if (not replayed or (own_step and micro < now.batch_size / now.split)) and another_moment_below(basis, knobs):
        notes.append(
            "At this batch another moment of the cell's step is the peak: one the trace saw holding fewer "
            "of the batch's tensors and more that do not shrink with it (a recurrent layer's backward pass "
            "holds gradients of its kernels' shape), so the peak falls less than the batch."
        )
    if basis.slope_source == UPPER_BOUND_SOURCE and knobs.batch_size > now.batch_size:
        notes.append(
            "The trace stopped before the cell's peak, so the slope is the cell's whole peak over its "
            "batch: an upper bound (calibrate to measure it)."
        )
    if basis.copy_missing > 0.05 * max(basis.measured_peak or 0, 1):
        notes.append(
            f"Includes the {format_bytes(basis.copy_missing)} copy fit() makes of the numpy arrays: this run "
            "had freed it before its peak, most runs keep it through the peak (tf.data streaming removes "
            "it)."
        )
    if basis.measured_peak is None and report.status in ("oom", "error", "interrupted"):
        notes.append(
            f"The cell stopped early ({report.status}), so its peak is not the full step's: the prediction "
            "comes from the model (and the trace up to the stop), without a measured peak to anchor it."
        )
    elif basis.measured_peak is None:
        notes.append(
            "TensorFlow's allocator was not measured in this cell: the prediction comes from the model "
            "alone, without the cell's peak to anchor it."
        )
    if knobs.policy == "mixed_float16" and "GPU" not in " ".join(report.env.devices):
        notes.append("mixed_float16 runs 74-260x slower on CPU (TF 2.21): use mixed_bfloat16 there.")
    parts = parts_at(basis, knobs)
    peak = peak_at(basis, knobs)
    budget = budget_for_tf(report) if tf_budget is None else tf_budget
    pre = report.preflight
    as_preflight = (
        tf_budget is None
        and pre is not None
        and anchored_on_preflight(basis)
        and not report.on_gpu
        and report.rss.peak_bytes > 0
    )
    if as_preflight:
        assert pre is not None
        budget = preflight_budget(report)
        notes.append(
            f"Judged as the pre-flight judged the call: against the {format_bytes(pre.threshold_bytes)} "
            f"the guard allows, from the {format_bytes(pre.rss_bytes)} the process held as the call "
            "began, with what TensorFlow's allocator held then"
            + (
                f" and the {format_bytes(pre.reusable_bytes)} of regions it held beyond that (filled first, "
                "before the process grows; whether the step's tensors fit in them is not known: "
                "docs/preflight.md)"
                if pre.reusable_bytes >= 1 << 20
                else ""
            )
            + " taken as held already."
        )
    outside = 0 if as_preflight else outside_tf_bytes(report)
    if tf_budget is None and budget is not None and outside >= 1 << 20:
        runtime = (
            " (TensorFlow's runtime started in this cell: about 0.5 GiB of it the first time)"
            if report.env.tensorflow_started_in_cell
            else ""
        )
        notes.append(
            f"The {format_bytes(budget)} left for TensorFlow's peak leave out the "
            f"{format_bytes(outside)} this cell's process grew by besides TensorFlow's allocator{runtime}: "
            "NumPy arrays, traced graphs, oneDNN's scratch (tfmem's own profiler not counted). A run at "
            "another batch takes them again, and a process limit counts them."
        )
    above = knobs.batch_size / knobs.split > now.batch_size / now.split
    held = min(report.rss.end_bytes - report.rss.baseline_bytes, report.tf_peak_bytes or 0)
    if budget is not None and not report.on_gpu and held >= 1 << 20 and above:
        notes.append(
            f"From where the cell started (a fresh kernel, or this one before the cell): after it, this "
            f"process keeps the ~{format_bytes(held)} of regions TensorFlow's allocator grew, and a larger "
            "batch reuses only part of them (a CNN fit at batch 568 after one at 256 grew the process by "
            "94% of its peak). Restart the kernel first, or let the pre-flight judge it (--limit)."
        )
    # a CPU's process budget, where the process was measured: above the cell's peak (or anywhere, where the cell
    # stopped before its peak) the process can grow by more than the allocator's bytes in use
    process = budget is not None and not report.on_gpu and report.rss.peak_bytes > 0 and not from_trace(basis)
    extra = PROCESS_MARGIN if process else 0.0
    # the peak the process was measured at: none where the cell stopped early, or its pre-flight refused the call
    measured = (
        peak_at(basis, basis.knobs) if basis.measured_peak is not None and not anchored_on_preflight(basis) else 0.0
    )
    margin = judging_margin(peak, measured, band, extra)
    fits = None if budget is None else fits_within(peak, budget, measured, band, extra)
    biggest = None if budget is None else largest_batch(basis, knobs, budget, band, extra, measured)
    if margin > band:
        notes.append(
            f"Whether this fits is judged with +{margin:.0%}, not ±{band:.0%}: on a CPU the budget is the "
            "process's, which can grow by more than the allocator's bytes in use (oneDNN's buffers, the "
            "regions' pages: +21% on a CNN at batch 568), and this cell measured the process "
            + (
                "at its own peak only."
                if measured
                else "at no peak (its pre-flight refused the call)."
                if anchored_on_preflight(basis)
                else "at no peak (it stopped early)."
            )
        )
    requested = sum(parts.values())  # the ratio shown is the one the peak has: the cell's and what a knob adds
    return WhatIf(
        peak_bytes=peak,
        basis=name,
        error_band=band,
        split={k: max(0, round(v)) if k != "other" else round(v) for k, v in parts.items()},
        fragmentation_ratio=round(peak / requested if requested > 0 else basis.fragmentation, 3),
        knobs=knobs,
        budget_bytes=budget,
        fits=fits,
        largest_batch=biggest,
        notes=notes,
        fit_margin=margin,
        process_margin=extra,
        measured_peak=measured,
    )


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
    band = basis_band(basis)
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
