"""The parts model's arithmetic on a stored basis: the requested bytes of each part of the peak at other knobs, and
the peak they make in the allocator's chunks (docs/design.md, 'What-if prediction').

A basis (core.report.Basis) splits the cell's peak into weights, gradients, optimizer slots, fit's copy of the input,
a per-sample part and the rest; each knob moves only the parts it changes. This is the same for every kind of basis:
how a kind uses it (the parts alone, or beside a step replay) is advise/bases.py. No report, no TensorFlow.
"""

from __future__ import annotations

from tfmem_magic.core.report import Basis, Knobs

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


def gradient_copies(knobs: Knobs) -> int:
    """Sets of gradients a step holds: each replica holds all of the weights, gradients and slots, and the
    all-reduce of the gradients needs buffers of their size, counted as one more copy (without it an MLP's workers,
    whose memory is mostly gradients and slots, were under-predicted by 5-15%: benchmarks/replicas_check.py)."""
    return 2 if knobs.replicas > 1 else 1


def _bytes_per_element(policy: str | None) -> int:
    return POLICIES.get(policy or "float32", 4)


def activation_scale(now: Knobs, knobs: Knobs) -> float:
    """What one sample's activations are multiplied by at `knobs` against the cell's `now`: the compute dtype's size
    and the input's elements."""
    return _bytes_per_element(knobs.policy) / _bytes_per_element(now.policy) * knobs.input_scale / now.input_scale


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
    scale = activation_scale(now, knobs)
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


def parts_peak(basis: Basis, knobs: Knobs, micro: float | None = None) -> int:
    """The allocator's peak the parts make at `knobs` (at the micro-batch `micro` instead, when given): the cell's
    own parts in the cell's own chunks, so that its settings give back its measurement, and what the knobs change in
    the chunks measured for such changes."""
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
