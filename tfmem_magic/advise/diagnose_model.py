"""Findings about what the memory was spent on: the batch, the model, the optimizer, the data, the allocator.

Each rule fires only on evidence in the report (the measured peak, its trace, the Keras model the cell used and the
what-if split of `predict`) and says it in numbers. Thresholds are named so a reader can see why a rule fired.
"""

from __future__ import annotations

from tfmem_magic.advise.bases import anchored_on_preflight, refused_call_start
from tfmem_magic.advise.fitting import fitting_batch
from tfmem_magic.advise.parts import growth_ratio, parts_at
from tfmem_magic.advise.prediction import (
    analytic_basis,
    budget_at_start,
    budget_for_tf,
    grown_outside_tf,
    replay_moved,
)
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, Finding, Report
from tfmem_magic.core.sizes import format_bytes

DOMINANT = 0.5  # share of the cell's peak at which one part "dominates"
PRESSURE = 0.25  # share of the budget from which memory is worth a finding
OPTIMIZER_SHARE = 0.25  # optimizer slots as a share of the cell's peak (or of the budget)
MIN_OPTIMIZER = 16 * 2**20
DATASET_SHARE = 0.1  # arrays handed to fit as a share of the budget left at the cell's start
MIN_DATASET = 256 * 2**20
FRAGMENTATION = 1.3  # allocated / requested at the peak
MIN_FRAGMENTATION_WASTE = 32 * 2**20
NON_TF_SHARE = 0.5  # process growth outside TF's allocator as a share of the process growth
MIN_NON_TF = 256 * 2**20


def _basis(report: Report) -> Basis | None:
    try:
        return analytic_basis(report)
    except TfmemUsageError:
        return None


def _peak(report: Report) -> int:
    """The cell's TF peak over its baseline; where its pre-flight refused a call (nothing of it ran), the step's
    peak the pre-flight predicted (the anchor of the report's what-if)."""
    stored = report.whatif_basis
    if stored is not None and anchored_on_preflight(stored):
        return max(report.tf_peak_bytes or 0, stored.measured_peak or 0)
    return report.tf_peak_bytes or 0


def _under_pressure(report: Report, amount: int) -> bool:
    budget = budget_for_tf(report)
    return report.stopped_for_memory or (budget is not None and amount >= PRESSURE * budget)


def large_batch(report: Report) -> Finding | None:
    basis = _basis(report)
    model = report.model
    if basis is None or model is None or not model.batch_size or not model.training:
        return None
    peak, measured = _peak(report), report.tf_peak_bytes or 0
    parts = parts_at(basis, basis.knobs)
    activations = parts["activations"] * basis.fragmentation
    per_sample = basis.activations_per_sample * growth_ratio(basis)
    what = f"Activations for a batch of {model.batch_text} take"
    stored = report.whatif_basis
    if stored is not None and anchored_on_preflight(stored) and model.batch_size > 1:
        # a call the pre-flight refused: its replay says what the step holds, and what of it grows with the batch
        # (the replayed peak over batch 1's: the analytic parts are a model's estimate, the replay the step's)
        batch = model.batch_size
        activations = max(0.0, replay_moved(stored, batch, 1))
        per_sample = activations / (batch - 1)
        what = f"In the pre-flight's replay of the step, what grows with a batch of {model.batch_text} takes"
    elif report.stopped_for_memory:
        # the failed cell has no peak to compare with: the model's own estimate of the step stands in
        peak = max(peak, round(sum(parts.values()) * basis.fragmentation))
    whose = "the cell's peak" if peak == measured else "the step's estimated peak"  # a step stopped or refused
    if peak <= 0 or activations < DOMINANT * peak or not _under_pressure(report, peak):
        return None
    budget = budget_for_tf(report)
    advice = ""
    if budget is not None:
        # the batch the shrink-batch fix names: the report's basis (the analytic one when the cell ends, the step
        # replay once calibrated: calibration.measured_basis writes this finding again), or the pre-flight's
        named = fitting_batch(report, budget)
        advice = (
            " Even batch 1 is predicted not to fit: the model itself needs a look."
            if named is None
            else " " + named.sentence()
        )
    return Finding(
        id="large-batch",
        severity="critical" if report.stopped_for_memory else "warn",
        title=f"The batch ({model.batch_size}) is what fills the memory",
        evidence=f"{what} ~{format_bytes(activations)}, {activations / peak:.0%} of {whose} "
        f"({format_bytes(peak)}), and it grows with the batch (~{format_bytes(round(per_sample))} per "
        f"sample).{advice}",
        bytes=round(activations),
        fixes=["shrink-batch", "grad-accumulation", "mixed-precision"],
    )


def large_model(report: Report) -> Finding | None:
    model = report.model
    if model is None or not model.params:
        return None
    state = model.param_bytes + (model.trainable_bytes + model.optimizer_bytes if model.training else 0)
    budget = budget_for_tf(report)
    peak = _peak(report)
    dominant = peak > 0 and state >= DOMINANT * (peak + (report.trace.preexisting_bytes if report.trace else 0))
    if not (dominant and _under_pressure(report, state)):
        return None
    parts = f"weights {format_bytes(model.param_bytes)}"
    if model.training:
        parts += (
            f", gradients {format_bytes(model.trainable_bytes)}, optimizer state {format_bytes(model.optimizer_bytes)}"
        )
    share = f", {state / budget:.0%} of the budget" if budget else ""
    return Finding(
        id="large-model",
        severity="warn",
        title=f"The model itself ({model.params:,} parameters) takes most of the memory",
        evidence=f"{model.name} holds {format_bytes(state)} whatever the batch ({parts}{share}). A smaller batch "
        "will not help much: freeze layers you do not train, use a lighter optimizer, or a smaller model.",
        bytes=state,
        fixes=["freeze-layers", "lighter-optimizer"],
    )


def optimizer_state(report: Report) -> Finding | None:
    model = report.model
    if model is None or not model.training or model.optimizer_slots < 1:
        return None
    slots = model.optimizer_bytes
    peak = _peak(report) + (report.trace.preexisting_bytes if report.trace else 0)
    budget = budget_for_tf(report)
    large = slots >= OPTIMIZER_SHARE * peak if peak else False
    used = (
        "the step's predicted peak"
        if anchored_on_preflight(report.whatif_basis)
        else "the memory the model used in this cell"
    )
    if slots < MIN_OPTIMIZER or not (large or (budget and slots >= OPTIMIZER_SHARE * budget)):
        return None
    return Finding(
        id="optimizer-state",
        severity="info" if report.status == "ok" else "warn",
        title=f"{model.optimizer} keeps {model.optimizer_slots} extra copies of every trainable weight",
        evidence=f"The optimizer's state is {format_bytes(slots)} ({model.optimizer_slots} slot(s) per trainable "
        f"weight, {format_bytes(model.trainable_bytes)} each): "
        f"{slots / peak:.0%} of {used}. SGD with momentum keeps one slot, "
        "plain SGD none.",
        bytes=slots,
        fixes=["lighter-optimizer"],
    )


def in_memory_dataset(report: Report) -> Finding | None:
    model = report.model
    if model is None or not model.input_array_bytes:
        return None
    budget = budget_at_start(report)  # what the cell had to spend: the budget minus what the process held
    size = model.input_array_bytes
    if size < MIN_DATASET or (budget and size < DATASET_SHARE * budget):
        return None
    copy = sum(c.bytes for c in report.trace.input_copies) if report.trace else 0
    held = f"; TensorFlow copied {format_bytes(copy)} of it into tensors as well" if copy else ""
    return Finding(
        id="in-memory-dataset",
        severity="warn",
        title=f"The whole dataset ({format_bytes(size)}) sits in memory",
        evidence=f"The cell handed {format_bytes(size)} of numpy arrays ({model.samples or '?'} samples) to "
        f"{'/'.join(c for c in model.calls if c != '__call__')}{held}. Streaming it with tf.data "
        "(from files, or a generator) keeps only a few batches in memory.",
        bytes=size,
        fixes=["tf-data-streaming"],
    )


def fragmentation(report: Report) -> Finding | None:
    trace = report.trace
    if trace is None or trace.requested_at_peak_bytes <= 0:
        return None
    ratio = trace.allocated_at_peak_bytes / trace.requested_at_peak_bytes
    waste = trace.allocated_at_peak_bytes - trace.requested_at_peak_bytes
    if ratio < FRAGMENTATION or waste < MIN_FRAGMENTATION_WASTE:
        return None
    return Finding(
        id="fragmentation",
        severity="info",
        title=f"The allocator reserved {ratio:.2f}x what the tensors asked for",
        evidence=f"At the peak the cell's tensors requested {format_bytes(trace.requested_at_peak_bytes)} and the "
        f"allocator held {format_bytes(trace.allocated_at_peak_bytes)} for them ({format_bytes(waste)} of "
        "rounding and split chunks). The gap grows with tensor size: it counts against your memory like "
        "any tensor. CPU has no allocator setting that removes it; smaller batches shrink it with the rest.",
        bytes=waste,
        fixes=["shrink-batch"],
    )


def non_tf_growth(report: Report) -> Finding | None:
    rss = report.rss
    growth = rss.peak_bytes - rss.baseline_bytes
    tf_growth = max(0, report.tf_peak_bytes or 0)
    profiler = report.trace.profiler_rss_bytes if report.trace is not None else 0
    start = refused_call_start(report)
    if start is not None:  # up to the refused call (grown_outside_tf): what came after is the pre-flight's own memory
        (growth, tf_growth), profiler = start, 0
    outside = grown_outside_tf(report)  # the profiler's own memory is tfmem's, not the user's
    if outside < MIN_NON_TF or outside < NON_TF_SHARE * (growth - profiler):
        return None
    tracer = (
        f" (tfmem's profiler took up to {format_bytes(profiler)} of the growth itself, not counted here)"
        if profiler >= 2**20
        else ""
    )
    runtime = (
        " TensorFlow's runtime started in this cell: its libraries, kernels and caches alone add about "
        "0.5 GiB the first time."
        if report.env.tensorflow_started_in_cell
        else ""
    )
    return Finding(
        id="non-tf-growth",
        severity="info" if report.env.tensorflow_started_in_cell else "warn",
        title=f"{format_bytes(outside)} of the process growth is outside TensorFlow's allocator",
        evidence=f"The process grew by {format_bytes(growth)}{tracer} while TensorFlow's allocator grew by "
        f"{format_bytes(tf_growth)}: the rest is numpy arrays, Python objects, `.numpy()` copies or "
        f"library caches, which TensorFlow's statistics cannot see.{runtime}",
        bytes=outside,
    )


MODEL_RULES = [large_batch, large_model, optimizer_state, in_memory_dataset, fragmentation, non_tf_growth]
