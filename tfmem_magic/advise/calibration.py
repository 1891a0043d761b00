"""Calibration: a clone of the cell's model trains at three batch sizes in a fresh process (probe_runs.py runs the
probes), and the slopes measured there replace the analytic basis' (advise/prediction.py). The measured basis is
stored on the report, so a saved and reloaded report predicts what the live panel did."""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tfmem_magic.advise import fixes, probe_runs, step_export
from tfmem_magic.advise.bases import from_trace
from tfmem_magic.advise.diagnose_model import large_batch
from tfmem_magic.advise.gpu_target import traced_op_types, types_convolve
from tfmem_magic.advise.prediction import CALIBRATED, analytic_basis, budget_for_tf, peak_at, summary
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, ReplayCurve, Report
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.core.types import KerasModel
from tfmem_magic.measure import guard


def remember_model(
    report: Report,
    model: KerasModel,
    structure: dict[str, Any] | None = None,
    fix_context: fixes.FixContext | None = None,
) -> None:
    """Keep a weak link from a report to the live Keras model it measured (for calibrate), what one of its
    batches held (feeding.spec_of: the probes make synthetic batches like it), and what its fixes were written from
    (a calibration writes them again on its basis)."""
    _forget_dead()
    try:
        SESSION.models[id(report)] = (weakref.ref(report), weakref.ref(model), structure, fix_context)
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
    inputs = 2 * probe_runs.PIPELINE_STEPS * 4 * batch * basis.input_per_sample
    roomy = budget is None or peak_at(basis, replace(basis.knobs, batch_size=4 * batch)) * 1.5 + inputs < 0.8 * budget
    if report.status == "ok" and roomy:
        return sorted({max(1, batch // 4), batch, 4 * batch})
    high = batch if report.status == "ok" else max(2, batch // 2)
    return sorted({max(1, high // 4), max(1, high // 2), high})


def kernel_bytes(report: Report) -> int | None:
    """What a calibration takes in the kernel, which a limit must have room for before it starts: the clone's export
    copies the model's weights (docs/preflight.md, "tfmem's own work counts"), plus the watch's reserve. None: no
    model to export."""
    return report.model.param_bytes + guard.OWN_WORK_RESERVE if report.model is not None else None


def calibrate_asked(report: Report, progress: Callable[[str, float], None] | None = None) -> Basis:
    """`measured_basis` asked for after the cell (`predict(..., calibrate=True)`, `largest_batch(calibrate=True)`,
    the panel's Calibrate button). Under `%tfmem limit` tfmem's work in the kernel counts against the limit as it
    does at a cell's end (docs/preflight.md, "tfmem's own work counts"): it does not start without room for the
    clone's export of the weights, and it is stopped before the process passes the limit. Either raises
    TfmemUsageError, and the report keeps the basis it had."""
    limit = guard.session_limit()
    try:
        with guard.own_work_within(limit.bytes if limit is not None else None) as watch:
            needed = kernel_bytes(report)
            if watch is not None and needed is not None and watch.room() < needed:
                raise TfmemUsageError(
                    f"calibration works in the kernel too (~{format_bytes(needed)} for this model), and the "
                    f"process has {format_bytes(max(0, watch.room()))} left under the memory limit "
                    f"({format_bytes(watch.limit)}) of %tfmem limit: free memory first (%tfmem free) or raise "
                    "the limit; the what-if keeps its basis"
                )
            return measured_basis(report, progress)
    except guard.OwnWorkStopped as exc:
        raise TfmemUsageError(
            f"calibration stopped: it brought the process to the memory limit "
            f"({format_bytes(limit.bytes) if limit is not None else '?'}) of %tfmem limit; the what-if keeps its "
            "basis"
        ) from exc


def measured_basis(report: Report, progress: Callable[[str, float], None] | None = None, replay: bool = True) -> Basis:
    """Calibrate: a clone of the cell's model trains on synthetic data at three batch sizes; the slopes of the
    requested bytes' peak between them replace the analytic one. Then (with `replay`) the step replay: two more
    probes, each in a fresh process, trace the clone's allocations from the start at two odd batches, and the
    replay of those sequences at other batches (analyze/step_replay.py) predicts the batch knob wherever its
    self-check passed (the basis is then named "replay"). The result is the report's basis from then on
    (`Report.whatif_basis`, saved with it), and its `prediction` block is redone on it."""
    stored = report.whatif_basis
    if from_trace(stored):
        raise TfmemUsageError(
            "this report is a saved trace's: it has no model to calibrate, and its what-if is "
            "already the trace's own allocations replayed (predict without calibrate=True)"
        )
    if stored is not None and stored.name in CALIBRATED:
        return stored
    basis = analytic_basis(report)
    if basis.knobs.replicas > 1:
        raise TfmemUsageError(
            f"calibration trains a clone of the model in one process; this cell ran it as one of "
            f"{basis.knobs.replicas} replicas of a tf.distribute strategy, which the probes cannot "
            "replay: the analytic basis stays"
        )
    entry = SESSION.models.get(id(report))
    model = entry[1]() if entry is not None and entry[0]() is report else None
    if entry is None or model is None:
        raise TfmemUsageError(
            "calibration needs the live Keras model of this cell: run the cell again in this "
            "kernel (a report loaded from a file can only use the analytic basis)"
        )
    calls = report.model.calls if report.model else []
    if "optimizer.apply" in calls and not any(c in calls for c in ("fit", "train_on_batch")):  # a loop's cell
        loop = step_export.loop_step(model) if replay else None
        if loop is None:
            raise TfmemUsageError(
                "calibration replays the cell's fit() on a clone, and this cell trained in a loop "
                "of its own (optimizer.apply) whose step tfmem did not find as a tf.function "
                "with batched tensor arguments: the probes cannot replay that loop. The analytic "
                "basis (from this cell's trace) stays in use, with its wider band."
            )
        function, name, structure = loop
        return own_step_basis(
            report,
            basis,
            model,
            structure,
            f"{name}, a GradientTape loop's step",
            entry[3],
            progress,
            lambda folder: step_export.export_loop_step(function, structure, folder),
        )

    training = report.model.training if report.model else True
    # the step the cell ran, saved for the probes where a clone cannot run it: training's, or evaluate's or
    # predict's (a model Keras cannot clone; None: a cell that only called the model, whose step is not Keras')
    last = next((c for c in reversed(calls) if c in ("evaluate", "predict")), None)  # of a cell that ran both
    method = "train_step" if training else {"evaluate": "test_step", "predict": "predict_step"}.get(last or "")

    def keras_step(own: str) -> Basis:  # the model's step (its own or Keras'), saved for the probes
        assert method is not None
        return own_step_basis(
            report,
            basis,
            model,
            entry[2],
            own,
            entry[3],
            progress,
            lambda folder: step_export.export_step(model, entry[2], folder, method),
            # a predict step is the whole of a cell that computed no loss
            whole_step=method != "predict_step" or not any(c in calls for c in ("evaluate", "test_on_batch")),
        )

    own = (
        step_export.sent_step(model)
        if training
        else step_export.uncloneable(model, method)
        if method is not None
        else None
    )
    if own is not None and replay:
        return keras_step(own)
    batches = probe_batches(report, basis)
    started = time.perf_counter()
    pipeline = report.model.fed_arrays if report.model else False
    share = 0.5 if replay else 1.0  # of the progress bar: the replay's probes take about as long
    try:
        peaks = probe_runs.probe_peaks(
            model,
            batches,
            training,
            entry[2],
            pipeline,
            None if progress is None else lambda text, done: progress(text, share * done),
        )
    except probe_runs.NotRebuildable:  # a config its class cannot be rebuilt from: the cell's step instead
        if not (replay and method is not None):
            raise
        return keras_step(step_export.not_rebuilt(model, method))
    curve = (
        replay_curve(
            model,
            basis,
            training,
            entry[2],
            pipeline,
            None if progress is None else lambda text, done: progress(text, 0.5 + 0.5 * done),
            report.model.feed if report.model else "",
            report.model.samples if report.model else None,
            report.on_gpu,
        )
        if replay
        else None
    )
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
        above, below = max(0.0, line_slope(batches, line) - basis.input_per_sample), None
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
        # chunk reuse). Where the cell's trace found a busier moment than its peak, the analytic slope above the
        # cell's batch is that moment's and its slope below is the peak's: the one below (the busier slope took a
        # GRU's batch 8 to a predicted 0 bytes in a zoo run)
        below = (
            basis.activations_per_sample_below
            if basis.activations_per_sample_below is not None
            else basis.activations_per_sample
        )
    parts = (
        basis.weights + basis.gradients + basis.optimizer + basis.input_copy + (above + basis.input_per_sample) * anchor
    )
    other = (
        round(basis.measured_peak / basis.fragmentation + basis.copy_missing - parts)
        if basis.measured_peak is not None
        else 0
    )
    name = "replay" if curve is not None and curve.passed else "measured"
    # the probes' slope above is one line from the cell's peak: the analytic basis' second moment is not theirs
    measured = replace(
        basis,
        name=name,
        replay=curve,
        activations_per_sample=above,
        activations_per_sample_below=below,
        moment_gap=0,
        other=other,
        slope_source="probe runs",
        increment_fragmentation=min(2.0, max(1.0, chunks)),
        calibration={
            "batches": batches,
            "peak_bytes": [peaks[b][0] for b in batches],
            "requested_bytes": [peaks[b][1] for b in batches],
            "seconds": round(time.perf_counter() - started, 2),
        },
    )
    _adopt(report, measured, entry[3])
    return measured


def _adopt(report: Report, basis: Basis, fix_context: fixes.FixContext | None) -> None:
    """Make `basis` the report's: its prediction block, its fixes and its large-batch finding are redone on it."""
    report.whatif_basis = basis
    report.prediction = summary(report)
    if fix_context is not None:  # shrink-batch's batch and every fix's predicted peak, on this basis
        report.fixes = fixes.build(report, fix_context)
    # the large-batch finding names the largest batch that fits, as the shrink-batch fix does: on this basis too
    report.findings = [(large_batch(report) or f) if f.id == "large-batch" else f for f in report.findings]


def own_step_basis(
    report: Report,
    basis: Basis,
    model: KerasModel,
    structure: dict[str, Any] | None,
    own: str,
    fix_context: fixes.FixContext | None,
    progress: Callable[[str, float], None] | None,
    export: Callable[[str], step_export.SavedStep],
    whole_step: bool = True,
) -> Basis:
    """Calibrate a model that trains in a step of its own (`own`: the method it overrides, e.g. GAN.train_step, or
    a GradientTape loop's tf.function): that step is saved with its variables (`export(folder)`, step_export.py)
    and run by the step replay's two probe processes, so
    the replay follows the allocations of the step the cell ran, not of Keras' default one on a clone. There are
    no parts probes (they need a clone): the replay predicts the batch, the cell's parts the other knobs. Raises a
    TfmemUsageError that says why when the step cannot be saved or its replay's self-check fails (the analytic
    basis stays). `whole_step`: the saved step is all the cell ran (not a predict step of a cell that evaluated too),
    so that its graphs' "no convolution" stands (`_convolves`)."""
    if report.model is None or basis.measured_peak is None:  # before saving anything: the replay is anchored on it
        raise TfmemUsageError(
            "calibration replays the cell's own step anchored on the cell's measured peak, and "
            "this cell has none (it stopped early, or TensorFlow's allocator statistics were "
            "missing): the analytic basis stays in use"
        )
    if progress:
        progress(f"saving {own} for the probes", 0.02)
    with step_export.saved_for_probes(export, "tfmem-step-") as saved:
        curve = replay_curve(
            model,
            basis,
            True,
            structure,
            report.model.fed_arrays,
            progress,
            report.model.feed,
            report.model.samples,
            report.on_gpu,
            saved=saved.folder,
            whole_step=whole_step,
        )
    if progress:
        progress("done", 1.0)
    if not curve.passed:
        raise TfmemUsageError(
            f"calibration ran this model's own step ({own}) in two probe processes, and "
            f"its step replay cannot be used: {curve.why_not}. The analytic basis stays in use."
        )
    curve.source = "step"
    replayed = replace(
        basis,
        name="replay",
        replay=curve,
        slope_source=f"{own}, replayed",
        calibration={"step": own, "seconds": curve.seconds},
    )
    _adopt(report, replayed, fix_context)
    return replayed


def replay_curve(
    model: KerasModel,
    basis: Basis,
    train: bool,
    structure: dict[str, Any] | None,
    pipeline: bool,
    progress: Callable[[str, float], None] | None = None,
    feed: str = "",
    samples: int | None = None,
    on_gpu: bool = False,
    saved: str | None = None,
    whole_step: bool | None = None,
) -> ReplayCurve:
    """The step replay's curve for the cell's model: two probe processes trace it at two odd batches around the
    cell's (probe_runs.replay_traces), fed as the cell was (`feed`; `samples`: the rows of the cell's arrays), and
    their sequences are replayed at a grid of batches (step_replay.curve). A curve that could not be made says why
    (`why_not`); it is not used then. `saved`: the cell's own step (step_export.py) for the probes to run."""
    from tfmem_magic.analyze import step_replay  # NumPy and the simulator: only when a calibration runs

    cell = basis.knobs.batch_size
    probes = step_replay.odd_probes(cell, probe_runs.weight_dims(model))
    if basis.measured_peak is None:
        return _unused(
            probes,
            "the cell's own peak was not measured (it stopped early, or TensorFlow's allocator "
            "statistics were missing): the replay is anchored on it",
        )
    started = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="tfmem-replay-")
    tries, first = 0, ""
    try:
        parallel = not on_gpu and _room_for_two(basis, probes[1])  # a GPU's room is not the host's RAM
        rows = _affordable_rows(basis, samples) if pipeline else None
        growth = probe_runs.probes_grow_gpu()
        while True:
            tries += 1
            paths = probe_runs.replay_traces(
                model, list(probes), train, structure, folder, pipeline, progress, parallel, feed, rows, saved
            )
            if progress:
                progress("replaying the step through the allocator", 0.95)
            low, high = (step_replay.load_events(paths[b]) for b in probes)
            out = step_replay.curve(low, high, *probes, cell, gpu_growth=growth)
            graphs = [step_replay.graph_of(paths[b]) for b in probes]
            out.convolves = _convolves(model, graphs, train if whole_step is None else whole_step, saved)
            # about one large model's probe trace in twenty does not replay to the byte (docs/bfc-replay.md); the
            # next run of the same probes does: one more try, not more (a model that never replays says why)
            if out.passed or out.own_error <= step_replay.OWN_TOLERANCE or tries == 2:
                break
            first = out.why_not
    except TfmemUsageError as exc:
        out = _unused(probes, f"its probes failed: {exc}")
    except Exception as exc:  # noqa: BLE001 - an empty or unreadable trace: the replay is an addition, the probes' parts stand
        out = _unused(probes, f"its traces could not be replayed ({type(exc).__name__}: {str(exc)[:200]})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if tries == 2:  # the first try's self-check failed: say so, and why the second failed too if it did
        out.retried = True
        out.why_not = f"{out.why_not} (second try; the first: {first})" if not out.passed else ""
    out.seconds = round(time.perf_counter() - started, 2)
    return out


def _convolves(
    model: KerasModel, graphs: list[dict[str, list[str] | None]], whole_step: bool, saved: str | None
) -> bool | None:
    """What the probes' graphs say of the step's convolutions (`ReplayCurve.convolves`). A "none" only where their
    step is the whole of what the cell ran (`whole_step`): a predict step's probes did not trace an evaluation's
    loss and metrics."""
    said = types_convolve(traced_op_types(model, graphs, saved is not None))
    return None if said is False and not whole_step else said


def _unused(probes: tuple[int, int], why: str) -> ReplayCurve:
    """A curve that was not made: no peaks, and the reason every prediction's notes give."""
    return ReplayCurve(
        probes=list(probes),
        events=0,
        allocations=0,
        aligned=0,
        own_error=0.0,
        cross_error=0.0,
        traced_peaks=[],
        why_not=why,
    )


# the most memory a replay probe's synthetic copy of the cell's arrays may take (with at most an eighth of what the
# machine has available): past it, the probes train on a few batches' worth of rows
ROWS_BYTES = 1 << 30


def _affordable_rows(basis: Basis, samples: int | None) -> int | None:
    """The cell's own row count for the replay probes' arrays, when a synthetic copy of them is affordable: the
    allocator's regions then grow as the cell's did (a probe on fewer rows grew other regions, and its staircase of
    chunks moved: docs/bfc-replay.md). None otherwise (the probes use a few batches' worth)."""
    import psutil

    if not samples:
        return None
    size = samples * basis.input_per_sample
    return samples if size <= min(ROWS_BYTES, psutil.virtual_memory().available / 8) else None


def auto_calibration(report: Report) -> tuple[bool, str] | None:
    """`%tfmem calibrate auto` (the default): whether this report calibrates as its cell ends. None where it is not
    wanted: only a report that names the largest batch that fits is (its large-batch finding, its shrink-batch fix),
    since that batch is a prediction at another batch than the cell's, most often a smaller one, where the analytic
    basis has missed most and an under-prediction runs out of memory. Only a cell that ran: the replay is anchored
    on the cell's measured peak, which a cell that ran out of memory (or whose pre-flight refused it) does not have,
    and its probes would run at batches that just failed. (True, why) to calibrate; (False, why not) where it is
    wanted but the machine's free memory is too little for a probe process."""
    import psutil

    names_a_batch = any(f.id == "shrink-batch" for f in report.fixes) or any(
        f.id == "large-batch" for f in report.findings
    )
    if report.status != "ok" or report.whatif_basis is None or not names_a_batch:
        return None
    pre = report.preflight
    if pre is not None and pre.kept and pre.basis == "replay" and pre.verdict in ("fits", "uncertain"):
        # the batch an earlier refusal named, judged on that refusal's replay: new probes would judge it a third time
        return False, (
            "the pre-flight replayed this call's step already (an earlier refusal's replay) and judged its batch on "
            "it; --calibrate runs the probes anyway"
        )
    basis = report.whatif_basis
    one = peak_at(basis, basis.knobs) + probe_runs.PROBE_PROCESS_BYTES
    available = psutil.virtual_memory().available
    if one > AUTO_ROOM * available:
        return False, (
            f"the report names the largest batch that fits, but a probe process needs "
            f"~{format_bytes(one)} and the machine has {format_bytes(available)} available; --calibrate "
            "runs it anyway"
        )
    return True, AUTO_REASON


AUTO_REASON = "the report names the largest batch that fits"
# auto calibration starts a probe process only where it takes at most this share of the memory available
AUTO_ROOM = 0.5


def _room_for_two(basis: Basis, batch: int) -> bool:
    """Whether the machine's available memory holds both replay probes at once with room to spare (then they run
    in parallel: half the wait on two cores). A user near the end of their memory gets them one after the other."""
    import psutil

    one = peak_at(basis, replace(basis.knobs, batch_size=batch)) + probe_runs.PROBE_PROCESS_BYTES
    return bool(2 * one < 0.5 * psutil.virtual_memory().available)


def line_slope(xs: list[int], ys: Sequence[float]) -> float:
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
