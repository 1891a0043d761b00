"""Pre-flight: predict a fit/evaluate/predict's (or *_on_batch's) step before it runs, and refuse one that will not fit.

Why: once TensorFlow runs, its allocator can no longer be capped, and the guard's batch-end check and watchdog act
between steps. One training step is one C++ call, so a step that outgrows the limit runs to its end (measured: a
CNN's `fit` at batch 1024 under `--limit 3GB` took the process to 5.22 GiB before the batch-end check could stop
it; on a machine with 3 GB the kernel would have died).

How: the model's own parts first: when its layer outputs, several times over, fit, no probe runs and the pre-flight
costs nothing. Otherwise the step replay (analyze/step_replay.py): a clone of the model runs its steps at two small
odd batches (about 1/14 and 1/9 of the call's) in two other processes, each traced from its allocator's first
allocation; the two sequences are aligned allocation by allocation, and replayed at the call's batch through the BFC
simulator (analyze/bfc.py). A model that trains in a step of its own (an overridden `train_step`, a model Keras
cannot clone) is not a clone's fit: its step is traced again and saved with its variables (advise/step_export.py, as
calibration does), and the probes run that. What the replay's peak holds that the kernel holds already (the weights,
the slots of a built optimizer) and the probes' own data come off it; fit's copy of numpy arrays goes on. Where the
replay cannot be used (its self-check failed, its probes could not run), the line through two probe steps' peaks at
1/16 and 1/8 of the batch stands in (`probed_step`), and the report says why. The allocator's regions already held
(RSS never shrinks: TF keeps them) absorb part of the growth. The process's memory then is compared with the guard's
threshold, with its basis' band (measured in docs/preflight.md) on what the process grows by:
- the low end does not fit: the call is refused before its first step (`PreflightRefused`), with the predicted
  peak, the room and the largest batch that fits (searched on the replay: each batch asked is replayed);
- the high end fits: the call runs, and the report compares the prediction with what was measured;
- in between: the call runs, and the guard watches it as before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import psutil

from tfmem_magic.advise import probe_runs, step_export
from tfmem_magic.advise.bands import (
    GROWTH_FRAGMENTATION,
    MODEL_MARGIN,
    PREFLIGHT_GROWTH_HIGH,
    PREFLIGHT_GROWTH_LOW,
    PROBE_LINE_BAND,
)
from tfmem_magic.advise.bases import larger_order_peak, refused_call_start
from tfmem_magic.advise.calibration import line_slope
from tfmem_magic.advise.gpu_target import (
    DEFAULT_WORKSPACE_LIMIT_MB,
    GPU_BELOW,
    conv_io_per_sample,
    first_step_allowance,
    flat_layers,
    may_convolve,
    step_convolves,
    traced_op_types,
    types_convolve,
)
from tfmem_magic.advise.parts import OPTIMIZER_SLOTS, growth_ratio, parts_at
from tfmem_magic.advise.prediction import activation_bytes, replay_moved, typeable_batch
from tfmem_magic.analyze.modelinfo import describe_model, forward_macs_per_sample
from tfmem_magic.core.errors import PreflightRefused, TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import (
    Basis,
    GpuPreflight,
    LineGroup,
    ModelInfo,
    PreflightInfo,
    ReplayCurve,
    Report,
)
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes, variable_bytes
from tfmem_magic.core.types import KerasModel
from tfmem_magic.measure import kerases
from tfmem_magic.measure.fed_shapes import FedShapes, has_open_dims
from tfmem_magic.measure.fed_shapes import scan as scan_fed_shapes
from tfmem_magic.measure.feeding import structure_leaves
from tfmem_magic.measure.holders import optimizer_variables
from tfmem_magic.measure.instrument import ModelUse
from tfmem_magic.measure.model_print import fingerprint
from tfmem_magic.measure.sampling import bytes_in_use, memory_info

if TYPE_CHECKING:  # NumPy and the simulator: imported only when a pre-flight probes
    from tfmem_magic.analyze.lines import LayerRecord
    from tfmem_magic.analyze.step_replay import CheckedReplays

_log = logging.getLogger(__name__)

REPLAY_FRACTION = 10  # the replay's probes run at about 0.7/REPLAY_FRACTION and 1.15/REPLAY_FRACTION of the batch
# ... or smaller, where that would cost the larger probe's forward pass more multiply-adds than this a step: a
# refusal's time is its probes' steps (docs/preflight.md, "Warm probes"), and the replay scales each tensor by a line
# through two probes wherever they are. Not below REPLAY_PROBE_FLOOR
REPLAY_PROBE_MACS = 1.5e9
REPLAY_PROBE_FLOOR = 24
# the step each checked call runs: what is saved for the probes when a clone cannot run it
STEP_OF_CALL = {
    "fit": "train_step",
    "evaluate": "test_step",
    "predict": "predict_step",
    "train_on_batch": "train_step",
    "test_on_batch": "test_step",
    "predict_on_batch": "predict_step",
}
TRAINING_CALLS = ("fit", "train_on_batch")
PROBE_FRACTION = 8  # the larger probe runs 1/PROBE_FRACTION of the batch, the smaller half of that


class Preflight:
    """The pre-flights of one measured cell: each fit/evaluate/predict (and train/test/predict_on_batch, whose
    batch is the one handed in) is checked before it runs, once per model, call, batch and input shape. A
    `*_on_batch` loop is checked on its first batch and on larger ones, not below one it let run with inputs of
    that shape (a loop over slices ends with a smaller one: a second probe run for it took 8 s, where the larger had
    run under the guard already); a model whose probes cannot run is not probed again in the cell. The last result
    goes into the report."""

    def __init__(self) -> None:
        self.results: list[PreflightInfo] = []
        self.notes: list[str] = []
        self._done: set[tuple[Any, ...]] = set()
        # (model, call, one sample's shape): the model (weakly: an id is reused once a model is collected) and the
        # largest batch of a *_on_batch call it let run
        self._let_run: dict[tuple[Any, ...], tuple[Any, int]] = {}
        self._unprobed: dict[tuple[int, str], Any] = {}  # (model, call) whose probes failed: its weak reference

    def armed(self) -> None:
        """The cell's calls will be checked: probe processes start ahead, so that a check that needs them does not
        wait for their imports (probe_runs.warm_up)."""
        try:
            probe_runs.warm_up(kerases.in_use())
        except Exception as exc:  # noqa: BLE001 - a probe started late is slower, not wrong
            fallback(_log, "warm probe processes could not start: the pre-flight starts its own", exc)

    def wants(self, model: KerasModel, call: str, use: ModelUse) -> bool:
        """Whether this call is to be checked (asked before the process is measured for it: a *_on_batch loop calls
        this every step)."""
        batch = use.batch_size
        if not batch:
            return True  # its note says why it is skipped
        failed = self._unprobed.get((id(model), call))
        if failed is not None and failed() is model:
            return False
        if (id(model), call, batch, use.input_shape) in self._done:
            return False
        ran = self._let_run.get((id(model), call, _sample_shape(use)))
        return not (call.endswith("_on_batch") and ran is not None and ran[0]() is model and batch <= ran[1])

    def __call__(
        self,
        model: KerasModel,
        call: str,
        use: ModelUse,
        threshold: int,
        rss: int,
        source: str,
        tf_current: int = 0,
        tf_held: int = 0,
    ) -> None:
        batch = use.batch_size
        if not batch:
            self._note(f"The pre-flight skipped {call}(): the batch size is known only once it runs ({use.feed}).")
            return
        if not self.wants(model, call, use):
            return
        self._done.add((id(model), call, batch, use.input_shape))
        started = time.perf_counter()
        try:
            info = check(model, call, use, threshold, rss, tf_current, tf_held)
        except Exception as exc:  # noqa: BLE001 - the pre-flight must never fail the user's call
            if not isinstance(exc, TfmemUsageError):  # our bug, or a model that raises where we look: say so
                fallback(_log, f"the pre-flight of {call}() failed", exc)
                exc = TfmemUsageError(f"it failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
            self._note(f"The pre-flight could not check {call}() at batch {batch}: {exc}")
            try:
                self._unprobed[(id(model), call)] = weakref.ref(model)
            except TypeError:
                pass
            return
        info.seconds = round(time.perf_counter() - started, 2)
        if info.replay is not None:  # the probe processes' time included, as a calibration's curve counts it
            info.replay.seconds = info.seconds
        self.results.append(info)
        shape = (id(model), call, _sample_shape(use))
        ran = self._let_run.get(shape)
        if info.verdict in ("fits", "uncertain") and (ran is None or ran[0]() is not model or batch > ran[1]):
            try:  # it runs (under the guard): a smaller batch of the same inputs needs less
                self._let_run[shape] = (weakref.ref(model), batch)
            except TypeError:
                pass
        if info.verdict == "refused":
            raise PreflightRefused(refusal(info, source))
        if info.verdict == "uncertain":
            self._note(
                f"Pre-flight of {call}() at batch {batch}: the predicted peak "
                f"({format_bytes(info.predicted_rss_bytes)} for the process) is within {band_words(info)} of "
                f"what {source} allows ({format_bytes(info.threshold_bytes)}): it ran, and the guard "
                "watched it." + (f" Its probes ran at {info.fed_note}." if info.fed_note else "") + gpu_words(info)
            )

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _sample_shape(use: ModelUse) -> tuple[int | None, ...] | None:
    """One sample's shape (the batch dimension left out): a loop's slices share it, another input size does not."""
    return tuple(use.input_shape[1:]) if use.input_shape else None


def check(
    model: KerasModel, call: str, use: ModelUse, threshold: int, rss: int, tf_current: int = 0, tf_held: int = 0
) -> PreflightInfo:
    """Predict `call`'s step at its batch (the model's own parts, else the step replay of a clone's probes or of the
    model's own saved step, else the probes' line), and say whether the process stays under `threshold` (bytes): a
    PreflightInfo with its verdict. Where the kernel has a GPU, the probes run on the CPU and the GPU is judged too
    (`gpu_room`, `PreflightInfo.gpu`): the stricter verdict and the smaller batch stand. Raises TfmemUsageError when
    the probes cannot run."""
    use, fed = with_fed_shapes(use)
    # the model's own parts: an upper bound that spares the probes, and a floor; open lengths: they count nothing
    # for them (layer outputs of unknown size): the probes must run
    parts = described(use, call in TRAINING_CALLS)
    gpu = gpu_room(parts)
    with probe_runs.on_cpu(probe_runs.kernel_has_gpu()):  # probes never need the GPU, its limit read or not
        info = _check(model, call, use, fed, threshold, rss, tf_current, tf_held, gpu, parts)
    return info


def _check(
    model: KerasModel,
    call: str,
    use: ModelUse,
    fed: FedShapes | None,
    threshold: int,
    rss: int,
    tf_current: int,
    tf_held: int,
    gpu: GpuPreflight | None,
    parts: ModelInfo | None,
) -> PreflightInfo:
    batch = int(use.batch_size or 0)
    train = call in TRAINING_CALLS
    copies = sum(a.copy_bytes for a in use.input_arrays)  # fit/evaluate/predict copy numpy arrays into tensors
    arrays = copies
    began = (psutil.Process().memory_info().rss, bytes_in_use() or 0)  # what the pre-flight's own work adds: from here
    slots = _slots_to_build(model) if train else 0
    generous = None if fed is not None else model_upper_bound(parts, train, batch)
    # "fits" never counts the allocator's held regions as reusable: which of the call's tensors they can hold is not
    # known (docs/preflight.md, "Held regions count only against a refusal")
    gpu_fits = gpu is None or (
        gpu.model_known and generous is not None and generous + slots + _first_step(gpu, batch) <= gpu.room
    )
    if generous is not None and rss + generous + slots + copies <= threshold and gpu_fits:
        # the model's own parts, at several times what they usually are, fit: no need to spend seconds on probes
        if gpu is not None:
            gpu.step_bytes, gpu.extra_bytes, gpu.verdict = generous, slots, "fits"
        return PreflightInfo(
            call=call,
            batch_size=batch,
            step_bytes=generous,
            extra_bytes=slots + copies,
            rss_bytes=rss,
            threshold_bytes=threshold,
            band=PROBE_LINE_BAND,
            verdict="fits",
            basis="model",
            predicted_rss_bytes=round(rss + generous + slots + copies),
            gpu=gpu,
        )
    info = PreflightInfo(
        call=call,
        batch_size=batch,
        rss_bytes=rss,
        threshold_bytes=threshold,
        tf_bytes=tf_current,
        reusable_bytes=max(0, tf_held - tf_current),
        gpu=gpu,
    )
    # a step of the model's own (an overridden train_step, a model Keras cannot clone): a clone's fit would not run it
    # evaluate/predict: a clone runs its class's own test/predict step, when Keras can write and rebuild it; else
    # the model's own, saved as train_step is
    floor = parts_floor(parts, train)  # what "fits" never counts less than, whatever the probes saw
    key = _inputs_key(model, call, use)  # before the probes change the model (an own step's export builds slots)
    kept = kept_replay(key, model, batch)
    if kept is not None and kept.line is not None:  # a refusal's probes' line: judged as that refusal judged
        info.probe_batches, info.replay_note, info.kept = kept.probes, kept.replay_note, True
        return _line_verdict(info, kept.line, slots + copies, tf_current, tf_held, floor, fed, slots)
    if kept is not None:  # this model and inputs were replayed before (a refusal): judged from it, no new probes
        _convolves_as_traced(gpu, model, kept.curve.convolves if kept.curve is not None else None)
        info.basis, info.band, info.extra_bytes = "replay", PREFLIGHT_GROWTH_HIGH, copies
        info.band_below, info.probe_batches, info.own_step = PREFLIGHT_GROWTH_LOW, kept.probes, kept.own_step
        info.kept = True
        _lower_bound_only(_judge(info, kept.step, tf_current, tf_held, floor), fed)
        if info.verdict == "refused":
            info.replay = kept.curve
        return info
    method = STEP_OF_CALL[call]
    own = step_export.sent_step(model) if train else step_export.uncloneable(model, method)
    try:
        if own is None:
            try:
                step_at, info.probe_batches = replayed_step(model, use, train, batch, generous)
            except probe_runs.NotRebuildable:  # a config its class cannot be rebuilt from: the model's own step
                own = step_export.not_rebuilt(model, method)
        if own is not None:
            step_at, info.probe_batches, built = own_replayed_step(model, use, batch, generous, method)
            info.own_step, copies = own, copies + built
            _gpu_now(gpu)  # saving the step built its slots in the kernel: on the GPU now
        # the replay's peak has the slots the call builds: only the arrays' copy is added (and, for the model's own
        # step, what saving it built in the kernel, its slots and its graph: they came after `rss` was read)
        info.basis, info.band, info.extra_bytes = "replay", PREFLIGHT_GROWTH_HIGH, copies
        info.band_below = PREFLIGHT_GROWTH_LOW
        said = types_convolve(step_at.op_types)
        if said is False and own is None and call not in TRAINING_CALLS and STEP_OF_CALL[call] != "predict_step":
            said = None  # an evaluation's clone probes predict: its loss and metrics were not traced
        _convolves_as_traced(gpu, model, said)
        # a replay that fails on the way raises NoReplay too; a refusal's restart hint waits for _as_left's judgement
        _judge(info, step_at, tf_current, tf_held, floor, hint=False)
        _lower_bound_only(info, fed)
        if info.verdict == "refused":  # the report's what-if predicts from it: nothing of the call will run
            _replay_named(info, step_at)  # the bracket's low end for _as_left's search
            info.by_line = replayed_lines(model, step_at, batch, own is None)
            _as_left(info, step_at, arrays, tf_held, began, floor)
            _replay_named(info, step_at)  # the batch named as the pre-flight leaves the kernel: in the curve too
            info.replay = step_at.curve(batch)
            info.replay.convolves = said  # the what-if's GPU model judges its workspace by it (gpu_target)
            keep_replay(key, model, call, use, info, info.replay, step_at.fixed)
        return info
    except NoReplay as exc:
        if own is not None:  # the probes' line needs a clone's fit
            raise TfmemUsageError(
                f"the model's own step, saved ({own}), ran in two probe processes, and its replay cannot be used: {exc}"
            ) from exc
        info.replay_note = str(exc)
        # what the replay's path set before it failed is not the line's (its low end, its replay and lines)
        info.band_below, info.replay, info.by_line = 0.0, None, []
    line, info.probe_batches = probed_step(model, use, train, batch)
    _line_verdict(info, line, slots + copies, tf_current, tf_held, floor, fed, slots)
    if info.verdict == "refused":  # the call at the batch it names is judged on this line, not on new probes
        keep_replay(key, model, call, use, info, line=line)
    return info


def _line_verdict(
    info: PreflightInfo,
    line: Callable[[float], float],
    extra: int,
    tf_current: int,
    tf_held: int,
    floor: float | None,
    fed: FedShapes | None,
    slots: int = 0,
) -> PreflightInfo:
    """The verdict on the probes' line, its band, with `extra` the call adds besides the step (the slots it builds,
    the arrays' copies): never "fits" (the line missed a step by up to 80%, under: docs/preflight.md, "A floor from
    the model's own parts"): the guard runs what it does not refuse."""
    info.basis, info.band, info.extra_bytes = "probes", PROBE_LINE_BAND, extra
    if info.gpu is not None:
        info.gpu.extra_bytes = slots
    _judge(info, line, tf_current, tf_held, floor)
    if info.verdict == "fits":
        info.verdict = "uncertain"
    return _lower_bound_only(info, fed)


def _replay_named(info: PreflightInfo, step_at: ReplayedStep) -> None:
    """The batch a refusal names, replayed itself rather than between two batches: the what-if names it too."""
    if info.largest_batch:
        try:
            step_at(info.largest_batch)
        except NoReplay:  # the verdict stands; the curve interpolates there
            pass


def replayed_lines(model: KerasModel, step_at: ReplayedStep, batch: int, keras_step: bool) -> list[LineGroup]:
    """A refused call's replayed peak by the line of code that made it (`PreflightInfo.by_line`): each layer's
    tensors named by the line that made the kernel model's layer of that name (lines.layer_table). Empty where it
    cannot be made (a fallback: the refusal stands without it)."""
    from tfmem_magic.analyze.lines import layer_table

    try:
        return step_at.by_line(batch, layer_table([model]), keras_step)
    except Exception as exc:  # noqa: BLE001 - the lines are one detail of the refusal
        fallback(_log, "the lines of the refused call's replayed peak could not be named", exc)
        return []


def with_fed_shapes(use: ModelUse) -> tuple[ModelUse, FedShapes | None]:
    """The call's use with the input dimensions its spec leaves open (a padded or ragged pipeline's lengths) read
    from the batches it will feed (measure/fed_shapes.py), and what was read; (use, None) where nothing was open.
    Raises TfmemUsageError ("cannot tell": the call runs under the guard) where they cannot be read: probes fed a
    length of 1 for a Transformer's padded sentences predicted a step 48 times too small."""
    if not has_open_dims(use.structure):
        return use, None
    if use.dataset is None:
        raise TfmemUsageError(
            "its inputs have a dimension besides the batch whose size is not known before the call runs (padded or "
            "ragged batches), and the pre-flight cannot read it from what was fed: it cannot tell what a step needs"
        )
    fed = scan_fed_shapes(use.dataset, use.structure)
    if has_open_dims(fed.structure):
        raise TfmemUsageError(
            f"its inputs have a dimension besides the batch that varies, and {fed.batches} batches read did not "
            "show its size: the pre-flight cannot tell what a step needs"
        )
    first = next(iter(structure_leaves(fed.structure.get("x"))), None) if isinstance(fed.structure, dict) else None
    shape = (use.batch_size, *first[0]) if first is not None else use.input_shape
    return replace(use, structure=fed.structure, input_shape=shape), fed


def _lower_bound_only(info: PreflightInfo, fed: FedShapes | None) -> PreflightInfo:
    """A verdict on lengths read from the first batches only (the scan stopped before the pipeline's end): a later
    batch may be longer, so "fits" becomes "uncertain" (the call runs under the guard); a refusal stands."""
    if fed is None:
        return info
    lengths = ", ".join(str(d) for d in fed.longest[:6])
    if fed.exact:
        read = "its one batch" if fed.batches == 1 else f"all {fed.batches} batches"
        info.fed_note = f"the inputs' open dimensions read from {read}: the longest are {lengths}"
        return info
    info.fed_note = (
        f"the inputs' open dimensions read from the first {fed.batches} batches (the longest: {lengths}); a later "
        "batch may be longer"
    )
    if info.verdict == "fits":
        info.verdict = "uncertain"
    return info


KEPT_GAP = 1.25  # a kept replay judges a batch it replayed, or one between two replayed batches this close


@dataclass
class KeptReplay:
    """A refused call's step replay, kept for its model and inputs (SESSION.preflight_replays): the next call of
    that model on the same inputs at a batch the replay covers is judged from it, without new probes, so the batch a
    refusal names is judged as the refusal judged it (docs/preflight.md, 'The next call at the named batch')."""

    model: weakref.ref[KerasModel]  # the model replayed (kept on the model alone: gone, its replay goes)
    curve: ReplayCurve | None  # the batches replayed (probe one's and probe two's op orders)
    fixed: int  # what the probe process held that the kernel holds already (off every replayed peak)
    probes: list[int]
    own_step: str
    by_print: bool = False  # kept for every model of its fingerprint (measure/model_print.py), not this one alone
    # where the replay could not be used: the probes' line the refusal was judged on (bytes the steps add at a
    # batch), the refused batch it judges up to, and why the replay was not used
    line: Callable[[float], float] | None = None
    refused: int = 0
    replay_note: str = ""

    def covers(self, batch: int) -> bool:
        if self.curve is None:  # a line: from the smaller probe to the refused batch (a named batch is below it)
            return self.line is not None and bool(self.probes) and self.probes[0] <= batch <= self.refused
        xs = self.curve.batches
        if batch in xs:
            return True
        below = [b for b in xs if b < batch]
        above = [b for b in xs if b > batch]
        return bool(below and above) and min(above) <= KEPT_GAP * max(below)

    def step(self, b: float) -> float:
        """The bytes the call's steps add at batch `b`: the larger op order's replayed peak (interpolated between
        the batches replayed, in a line past them), less what the kernel holds already."""
        if self.curve is None:
            return self.line(b) if self.line is not None else 0.0
        return max(0.0, larger_order_peak(self.curve, b) - self.fixed)


KEPT_MOST = 16  # replays kept at once (a session's refusals; the oldest go first)


def _inputs_key(model: KerasModel, call: str, use: ModelUse) -> tuple[Any, ...]:
    """What a kept replay is valid for: the model (by its fingerprint where it has one, so that the same model built
    again is the same model; else the object), the step its call runs, and one batch's shapes and dtypes."""
    shapes = json.dumps(use.structure, sort_keys=True, default=str)
    printed = fingerprint(model)
    return (
        printed or id(model),
        STEP_OF_CALL[call],
        shapes,
        len(kerases.variables_of(model, "trainable_weights")),
    )


def keep_replay(
    key: tuple[Any, ...],
    model: KerasModel,
    call: str,
    use: ModelUse,
    info: PreflightInfo,
    curve: ReplayCurve | None = None,
    fixed: int = 0,
    line: Callable[[float], float] | None = None,
) -> None:
    """Keep the replay under `key`, the model's as the pre-flight began (a model built again is in that state), and
    under its key now (the same model, whose state the pre-flight may have moved: its own step's slots built). Where
    the replay could not be used, the probes' `line` the refusal was judged on is kept instead."""
    try:
        ref = weakref.ref(model)
    except TypeError:
        return
    kept = SESSION.preflight_replays
    for old in [k for k, v in kept.items() if v.model() is None and not v.by_print]:  # objects gone (ids reused)
        del kept[old]
    for k in dict.fromkeys([key, _inputs_key(model, call, use)]):
        kept.pop(k, None)  # a dict keeps its insertion order: the newest last
        kept[k] = KeptReplay(
            ref,
            curve,
            fixed,
            list(info.probe_batches),
            info.own_step,
            by_print=isinstance(k[0], str),
            line=line,
            refused=info.batch_size,
            replay_note=info.replay_note or "",
        )
    while len(kept) > KEPT_MOST:
        del kept[next(iter(kept))]


def kept_replay(key: tuple[Any, ...], model: KerasModel, batch: int) -> KeptReplay | None:
    """The replay kept under `key` (this model, or one of its fingerprint, on these inputs), where it covers `batch`;
    None otherwise."""
    kept = SESSION.preflight_replays.get(key)
    if kept is None or not (kept.by_print or kept.model() is model) or not kept.covers(batch):
        return None
    return cast(KeptReplay, kept)


def own_replayed_step(
    model: KerasModel, use: ModelUse, batch: int, generous: int | None, method: str = "train_step"
) -> tuple[ReplayedStep, list[int], int]:
    """replayed_step for a model that trains in a step of its own, or whose evaluate/predict step a clone cannot run
    (no config to clone it from): the call's step (`method`) is traced again and saved with its variables
    (step_export.py), and the probes run it. Before the call's first step, that trace builds what the
    step would (its optimizers' slots), and tracing and saving cost the kernel a graph: returns (batch -> bytes the
    steps add, the probe batches, what the process grew by while the step was saved: after the call's `rss`)."""
    process = psutil.Process()
    before, rss = bytes_in_use() or 0, process.memory_info().rss
    with step_export.saved_for_probes(
        lambda folder: step_export.export_step(model, use.structure, folder, method), "tfmem-preflight-step-"
    ) as saved:
        grown = max((bytes_in_use() or 0) - before, process.memory_info().rss - rss, 0)
        step_at, probes = replayed_step(model, use, method == "train_step", batch, generous, saved)
    return step_at, probes, grown


def _as_left(
    info: PreflightInfo,
    step_at: ReplayedStep,
    arrays: int,
    tf_held: int,
    began: tuple[int, int],
    floor: float | None = None,
) -> None:
    """A refusal judged again from the process as the pre-flight leaves it: the largest batch it names is judged
    where the next call will be, not where this one began. What the pre-flight did in the kernel (the model's own
    step saved: its slots and graph; the replay's arrays, which the process keeps) is held by then: judged from
    the call's start, a NER Transformer's refusal named 208 and the call at 208, judged from the kernel after the
    refusal, 144 (docs/preflight.md, 'The next call at the named batch')."""
    rss_grew = psutil.Process().memory_info().rss - began[0]
    tf_grew = (bytes_in_use() or 0) - began[1]
    info.rss_bytes, info.tf_bytes = info.rss_bytes + max(0, rss_grew), info.tf_bytes + max(0, tf_grew)
    held = max(tf_held, info.tf_bytes)
    _gpu_now(info.gpu)
    if rss_grew > 0 or tf_grew > 0:  # what saving built is held now
        info.reusable_bytes, info.extra_bytes = max(0, held - info.tf_bytes), arrays
    # judged again even where nothing grew: the first judgement left the restart hint to this one (one search of it)
    _judge(info, step_at, info.tf_bytes, held, floor, step_at.replayed, decided=True)  # near the first search


def _growth(step: float, extra: int, tf_current: int, tf_held: int) -> float:
    """What the process grows by when TF's allocator needs `step` + `extra` more: the regions it holds already (its
    peak so far) are reused first (RSS never shrinks: TF keeps them)."""
    return max(0.0, tf_current + step + extra - max(tf_held, tf_current))


def _judge(
    info: PreflightInfo,
    step_at: Callable[[float], float],
    tf_current: int,
    tf_held: int,
    floor: float | None = None,
    tried: Iterable[int] = (),
    decided: bool = False,
    hint: bool = True,
) -> PreflightInfo:
    """The verdict at the call's batch with the basis' band, and the largest batch whose upper estimate fits. The
    regions TF's allocator holds beyond what is in use count as reusable against a refusal (the low end), never
    for "fits" or the largest batch (the high end): which of the call's tensors they can hold is not known, and a
    batch named on them ran 0.6 GiB past its limit (docs/preflight.md, "Held regions count only against a
    refusal"). `floor`: the least a step holds per sample by the model's own outputs (parts_floor): "fits" and the
    largest batch never count less; a refusal is the prediction's alone. `tried`: the batches `step_at` answers
    without a replay. `decided`: the call is refused already (judged again as the pre-flight leaves the kernel):
    only the batches it names move. `hint`: a refusal searches the batch a restart would let it name (False where
    a judgement from where the pre-flight leaves the kernel follows and searches it)."""
    rss, threshold, band, batch = info.rss_bytes, info.threshold_bytes, info.band, info.batch_size

    def judged(b: float) -> float:  # what "fits" and the largest batch count: never below the model's outputs
        return max(step_at(b), (floor or 0.0) * b)

    def grows_anew(b: float) -> float:  # none of the held regions reused
        return _growth(judged(b), info.extra_bytes, tf_current, tf_current)

    info.step_bytes = round(step_at(batch))
    info.floor_bytes = round((floor or 0.0) * batch)
    growth = _growth(step_at(batch), info.extra_bytes, tf_current, tf_held)  # the held regions reused first
    info.predicted_rss_bytes = round(rss + growth)
    # the band is the prediction's error: it widens what the process grows by, not what it holds already
    if rss + growth * (1 - band_below(info)) > threshold:
        info.verdict = "refused"
    elif rss + grows_anew(batch) * (1 + band) <= threshold:
        info.verdict = "fits"
    else:
        info.verdict = "uncertain"
    if decided:
        info.verdict = "refused"
    info.largest_batch = _largest(lambda b: rss + grows_anew(b) * (1 + band), threshold, batch, tried)
    if info.gpu is not None:
        _judge_gpu(info, info.gpu, step_at, judged, tried)
    info.restart_batch, held = None, info.reusable_bytes
    # on a CPU the held regions are resident: without them the process would start that much lower, judged alike
    # (on a GPU they are the GPU's, not the process's)
    if hint and info.verdict == "refused" and held >= RESTART_HINT_BYTES and not probe_runs.kernel_has_gpu():
        known = step_at.replayed if isinstance(step_at, ReplayedStep) else tried  # the first search's, replayed
        try:
            after = _largest(lambda b: rss - held + grows_anew(b) * (1 + band), threshold, batch, known)
        except NoReplay:  # a hint: the refusal stands without it
            after = None
        if after is not None and after > (info.largest_batch or 0):
            info.restart_batch = after
    return info


def _judge_gpu(
    info: PreflightInfo,
    gpu: GpuPreflight,
    step_at: Callable[[float], float],
    judged: Callable[[float], float],
    tried: Iterable[int],
) -> None:
    """The GPU's verdict (the probes ran on the CPU; their step modelled for the GPU as advise/gpu_target.py models a
    CPU report): refused where the step's lower estimate alone passes the GPU's room (its limit less what TensorFlow
    holds there now), "fits" only where its upper estimate and a whole cuDNN workspace cap fit (the first step's
    autotuning included); the call's verdict and largest batch are then the stricter of the two."""
    batch, band, room, extra = info.batch_size, info.band, gpu.room, gpu.extra_bytes
    gpu.step_bytes = round(step_at(batch))
    if (step_at(batch) + extra) * (1 - gpu_band_below(info)) > room:
        gpu.verdict = "refused"
    elif (judged(batch) + extra) * (1 + band) + _first_step(gpu, batch) <= room and gpu.model_known:
        gpu.verdict = "fits"
    else:
        gpu.verdict = "uncertain"
    gpu.largest_batch = _largest(lambda b: (judged(b) + extra) * (1 + band) + _first_step(gpu, b), room, batch, tried)
    order = ("fits", "uncertain", "refused")
    info.verdict = max(info.verdict, gpu.verdict, key=order.index)
    if info.largest_batch is None or gpu.largest_batch is None:
        info.largest_batch = None
    else:
        info.largest_batch = min(info.largest_batch, gpu.largest_batch)


def gpu_band_below(info: PreflightInfo) -> float:
    """How far under the prediction the GPU's step may be: the probes' band, or what the CPU-to-GPU model earned on
    the public T4 traces where that is wider (gpu_target.GPU_BELOW)."""
    return max(band_below(info), GPU_BELOW)


def _gpu_now(gpu: GpuPreflight | None) -> None:
    """What TensorFlow holds on the GPU now (the pre-flight's own work can have built slots there)."""
    if gpu is None:
        return
    now = memory_info(gpu.device)
    if now is not None:
        gpu.in_use_bytes = max(gpu.in_use_bytes, int(now["current"]))


def gpu_room(parts: ModelInfo | None) -> GpuPreflight | None:
    """The GPU the call's steps run on, as the pre-flight judges it: its allocator's limit and what TensorFlow holds
    there now, and the cuDNN workspace cap where the model has convolutions (this process's
    TF_CUDNN_WORKSPACE_LIMIT_IN_MB, 4 GiB unless set). None on a CPU, and where the GPU's limit cannot be read (the
    process is then judged alone, as before)."""
    if not probe_runs.kernel_has_gpu():
        return None
    device = "GPU:0"
    limit = gpu_limit_bytes(device)
    current = memory_info(device)
    if limit is None or current is None:
        return None
    convolves = may_convolve(parts)
    return GpuPreflight(
        device=device,
        limit_bytes=limit,
        in_use_bytes=int(current["current"]),
        workspace_cap_bytes=workspace_cap_bytes() if convolves else 0,
        convolves=convolves,
        conv_io_bytes_per_sample=conv_io_per_sample(parts, convolving=True),
        model_known=parts is not None,
    )


def _convolves_as_traced(gpu: GpuPreflight | None, model: KerasModel, said: bool | None) -> None:
    """Whether the step convolves on the GPU, judged again once the probes ran: from the model's layers walked as
    Keras walks them and what the op types of the probes' graphs said (`said`: `gpu_target.types_convolve`, or a
    kept replay's; `step_convolves`): a step with no convolution gets no first-step allowance there, one whose
    graphs hold one (a custom layer's, a loss's) gets it."""
    if gpu is not None:
        convolves = step_convolves(flat_layers(model), said)
        if convolves != gpu.convolves:
            gpu.convolves, gpu.workspace_cap_bytes = convolves, workspace_cap_bytes() if convolves else 0


def _first_step(gpu: GpuPreflight, batch: float) -> float:
    """What the first step's autotuning may hold beside the step's tensors at `batch` (gpu_target.first_step_allowance):
    a trial's workspace, its copy of the output and redzones; 0 where the model runs no convolution."""
    if not gpu.convolves:
        return 0.0
    return first_step_allowance(gpu.workspace_cap_bytes, gpu.conv_io_bytes_per_sample * batch)


def gpu_limit_bytes(device: str) -> int | None:
    """TensorFlow's allocator limit on `device`: the memory limit the user gave its logical device, else the one
    TensorFlow set at start-up (its device attributes' memory_limit); None where neither can be read."""
    import tensorflow as tf

    try:
        index = int(device.split(":")[1])
        configs = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("GPU")[index])
        if configs and configs[0].memory_limit:
            return int(configs[0].memory_limit) * 2**20
        from tensorflow.python.client import device_lib  # noqa: PLC0415 - TensorFlow's own device list

        for d in device_lib.list_local_devices():
            if d.device_type == "GPU" and d.name.endswith(f"GPU:{index}"):
                return int(d.memory_limit)
    except Exception as exc:  # noqa: BLE001 - no limit known: the GPU is not judged
        fallback(_log, f"{device}'s memory limit could not be read: the pre-flight judges the process alone", exc)
    return None


def workspace_cap_bytes() -> int:
    """TF_CUDNN_WORKSPACE_LIMIT_IN_MB as this process has it (TensorFlow reads it at its first GPU convolution)."""
    try:
        return int(os.environ.get("TF_CUDNN_WORKSPACE_LIMIT_IN_MB", DEFAULT_WORKSPACE_LIMIT_MB)) * 2**20
    except ValueError:
        return DEFAULT_WORKSPACE_LIMIT_MB * 2**20


# the least of held regions a refusal names a batch without: below it, what a restart gives back is too little to
# change the batch much (docs/preflight.md, "After a restart")
RESTART_HINT_BYTES = 64 << 20


class NoReplay(Exception):
    """The step replay could not predict the call (its self-check failed, its traces could not be read, or the batch
    is too small for probes below it): says why. The probes' line stands in."""


def replayed_step(
    model: KerasModel,
    use: ModelUse,
    train: bool,
    batch: int,
    generous: int | None = None,
    saved: step_export.SavedStep | None = None,
) -> tuple[ReplayedStep, list[int]]:
    """The call's step at any batch, by the step replay (analyze/step_replay.py): a clone's allocation sequence,
    traced from a fresh allocator at two small odd batches (about 1/14 and 1/9 of the call's), replayed through
    the BFC simulator at batches up to the call's. What the probe process held that the kernel holds already (the
    model's weights, the optimizer's variables it has made) and the probes' own data are taken off: the rest is what
    the call's steps add (the slots when it builds them, gradients, the step's tensors and workspaces, in BFC's
    chunks). With `saved` (the model's own step, step_export.py) the probes run that step instead of a clone's fit.
    Returns (batch -> bytes the steps add: a ReplayedStep, the probe batches). Raises NoReplay where the probes'
    line is to stand in, and TfmemUsageError where the probes themselves cannot run (the line's would not
    either)."""
    from tfmem_magic.analyze import step_replay  # NumPy and the simulator: only when a pre-flight probes

    probes = step_replay.odd_probes(replay_probe_target(model, use, batch), probe_runs.weight_dims(model))
    if probes[1] >= batch:
        raise NoReplay(f"batch {batch} is too small for two odd probe batches below it")
    one_probe = probe_runs.PROBE_PROCESS_BYTES + (generous or 0) * probes[1] / max(batch, 1)
    # a GPU's room is not RAM (a pre-flight's probes run on the CPU: on_cpu)
    parallel = not probe_runs.probes_use_gpu() and 2 * one_probe < 0.5 * psutil.virtual_memory().available
    growth = probe_runs.probes_grow_gpu()
    folder = tempfile.mkdtemp(prefix="tfmem-preflight-")
    try:
        paths = probe_runs.replay_traces(
            model,
            list(probes),
            train,
            use.structure,
            folder,
            pipeline=use.feed == "arrays",
            parallel=parallel,
            feed=use.feed or "",
            saved=saved.folder if saved else None,
        )
        try:
            low, high = (step_replay.load_events(paths[b]) for b in probes)
            fed = step_replay.fed_bytes(paths[probes[0]])
            graphs = [step_replay.graph_of(paths[b]) for b in probes]
            check = step_replay.checked(low, high, *probes, gpu_growth=growth)
        except Exception as exc:  # noqa: BLE001 - an empty or unreadable trace: the two probe steps' line stands in
            raise NoReplay(f"its traces could not be replayed ({type(exc).__name__}: {str(exc)[:200]})") from exc
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if check.curve.why_not:
        raise NoReplay(check.curve.why_not)
    if saved is not None:  # every variable the saved step holds: the kernel holds them now (its trace built them)
        held = saved.variable_bytes
    else:
        held = variable_bytes(kerases.variables_of(model))
        if train:  # the optimizer's variables the kernel holds already (none before its first step)
            held += variable_bytes(optimizer_variables(getattr(model, "optimizer", None)))
    return ReplayedStep(
        check, held + fed, "step" if saved is not None else "probes", traced_op_types(model, graphs, saved is not None)
    ), list(probes)


def replay_probe_target(model: KerasModel, use: ModelUse, batch: int) -> int:
    """The batch the replay's two probes are placed around: 1/REPLAY_FRACTION of the call's, capped by what a
    probe's step costs (REPLAY_PROBE_MACS; a model whose cost per sample is unknown is not capped)."""
    target = max(3, round(batch / REPLAY_FRACTION))
    macs = forward_macs_per_sample(model, use.structure)
    if macs:
        target = min(target, max(REPLAY_PROBE_FLOOR, int(REPLAY_PROBE_MACS / (1.15 * macs))))
    return target


# what a refused call's replay may spend on more batches for the report's what-if (advise/preflight.refused_basis):
# the batches the verdict and the largest batch asked are replayed already; the what-if's slope at the refused batch
# needs SLOPE_POINTS of them from a quarter to twice it, which the curve replays whatever the time
CURVE_BUDGET_S = 0.5
SLOPE_POINTS = 3


class ReplayedStep:
    """The call's step at any batch by the step replay: called with a batch, the bytes the call's steps add to what
    the kernel holds (the larger of the two probes' op orders: they meet at the peak differently). Each batch is
    replayed once, where asked (a long sequence, an LSTM's, takes ~0.3 s a replay); `curve` gives the batches
    replayed as the report's ReplayCurve."""

    def __init__(self, check: CheckedReplays, fixed: int, source: str, op_types: list[str] | None = None) -> None:
        self._check = check  # step_replay.CheckedReplays whose self-check passed
        self.fixed = fixed  # what the probe process held that the kernel holds already, and the probes' own data
        self._source = source
        self.op_types = op_types  # every op type in the probes' graphs (step_replay.op_types; None: not read)
        self._peaks: dict[int, tuple[int, int, int]] = {}  # batch: (probe one's order, probe two's, regions)

    def __call__(self, b: float) -> float:
        return max(0.0, max(self._replayed(b)[:2]) - self.fixed)

    @property
    def replayed(self) -> list[int]:
        """The batches replayed so far (answered again without a replay)."""
        return list(self._peaks)

    def _replayed(self, b: float) -> tuple[int, int, int]:
        n = max(1, round(b))
        if n not in self._peaks:
            try:
                results = self._check.peaks(n)
            except Exception as exc:  # noqa: BLE001 - a bug of ours must not reach the user's fit: the probes' line stands in
                raise NoReplay(f"its replay at batch {n} failed ({type(exc).__name__}: {str(exc)[:200]})") from exc
            self._peaks[n] = (results[0][0], results[1][0], max(regions for _, regions in results))
        return self._peaks[n]

    def by_line(self, batch: int, layers: dict[str, LayerRecord], keras_step: bool) -> list[LineGroup]:
        """What the larger op order held at its peak at `batch`, by the line of code that made it
        (analysis.replayed_by_line: `layers` are the kernel model's, `keras_step` whether the probes ran Keras' own
        step). That order is replayed once more: the verdict's replays kept their peaks only."""
        from tfmem_magic.analyze.analysis import replayed_by_line

        n = max(1, round(batch))
        peaks = self._replayed(n)
        replay = self._check.replays[0 if peaks[0] >= peaks[1] else 1]
        if replay.events is None:
            return []
        result = replay.run(n)
        return replayed_by_line(
            replay.events, result.live_at_peak, replay.batch, n, replay.lines.slope, layers, keras_step
        )

    def curve(self, batch: int, budget_s: float = CURVE_BUDGET_S) -> ReplayCurve:
        """The replay as the report keeps it: the batches replayed so far, and as many more of the calibration's
        grid up to twice `batch` as `budget_s` allows, nearest `batch` first (where shrink-batch and the sliders
        look; the largest batch's bisection has replayed around its answer already). A replay that fails here
        leaves the batch out: the verdict was made without it."""
        from tfmem_magic.analyze import step_replay

        started = time.perf_counter()
        probes = (self._check.curve.probes[0], self._check.curve.probes[1])
        wanted = [b for b in step_replay.grid(batch, probes, top=2 * batch) if b not in self._peaks]
        for b in sorted(wanted, key=lambda b: abs(math.log(b / batch))):
            if time.perf_counter() - started > budget_s:  # past the budget, only the slope's missing batches
                if len(slope_batches(self._peaks, batch)) >= SLOPE_POINTS:
                    break
                if not slope_batches([b], batch):  # (the window is not even in log distance: go on past it)
                    continue
            try:
                self._replayed(b)
            except NoReplay:
                continue
        batches = sorted(self._peaks)
        curve: ReplayCurve = self._check.curve
        return replace(
            curve,
            batches=batches,
            peaks=[self._peaks[b][0] for b in batches],
            second_peaks=[self._peaks[b][1] for b in batches],
            region_peaks=[self._peaks[b][2] for b in batches],
            passed=True,
            source=self._source,
            seconds=round(time.perf_counter() - self._check.started, 2),
        )


def refused_basis(report: Report, basis: Basis) -> Basis | None:
    """The what-if's basis for a report whose pre-flight refused its call on the step replay: that replay (the
    batches it replayed: `PreflightInfo.replay`), anchored on what it predicted for TF's allocator at the call's
    batch (TF in use as the call began, over the cell's baseline, plus the replayed step and what the call adds),
    since nothing of the step ran to measure. The parts of `basis` (the analytic one) predict the other knobs, as
    they do on a calibrated basis. None where the pre-flight did not refuse on a replay, or its call is not the
    step the report's model describes (another batch, a strategy's replicas)."""
    info, start = report.preflight, refused_call_start(report)
    if (
        info is None
        or start is None
        or info.replay is None
        or not info.replay.batches
        or basis.measured_peak is not None
        or basis.knobs.split != 1
        or basis.knobs.batch_size != info.batch_size
    ):
        return None
    anchor = start[1] + info.step_bytes + info.extra_bytes
    replayed = replace(
        basis,
        name="replay",
        replay=info.replay,
        measured_peak=anchor,
        anchor="preflight",
        other=0,
        slope_source="the pre-flight's step replay",
        activations_per_sample_below=None,
        moment_gap=0,
        lines_below=[],
        calibration={"seconds": info.seconds, **({"step": info.own_step} if info.own_step else {})},
    )
    # what grows with the batch is the replay's, not the layer outputs': the knobs the replay does not predict
    # (precision, input size) scale it, and the rest stays as `other` (requested bytes). Its slope is a line through
    # the replayed peaks from a quarter to twice the batch: BFC's staircase makes any two of them a poor guide (the
    # recorded CNN's: 1.9 MiB a sample from batch 1 to 320, where a region had just doubled, 1.1 from 320 to 640)
    batch = basis.knobs.batch_size
    near = slope_batches(info.replay.batches, batch)
    if len(near) >= SLOPE_POINTS:
        grows = line_slope(near, [larger_order_peak(info.replay, b) for b in near])
    else:
        grows = replay_moved(replayed, batch, 1) / max(1, batch - 1)
    # in requested bytes, which a knob's growth gets back in the chunks _parts_peak gives it (growth_ratio)
    replayed.activations_per_sample = max(0.0, max(0.0, grows) / growth_ratio(replayed) - basis.input_per_sample)
    replayed.other = round(anchor / basis.fragmentation - sum(parts_at(replayed, basis.knobs).values()))
    return replayed


def slope_batches(batches: Iterable[int], batch: int) -> list[int]:
    """The replayed batches the what-if's slope at `batch` is drawn through (refused_basis): a quarter to twice it."""
    return [b for b in batches if batch / 4 <= b <= 2 * batch]


def probed_step(
    model: KerasModel, use: ModelUse, train: bool, batch: int
) -> tuple[Callable[[float], float], list[int]]:
    """The call's step at any batch from one step of a clone at 1/16 and 1/8 of the batch (`line_through`): what
    stands in where the replay cannot be used."""
    high = max(2, batch // PROBE_FRACTION)
    low = max(1, high // 2)
    if high >= batch:  # a tiny batch: probing it is as cheap as running it, and it is guarded anyway
        high, low = batch, max(1, batch // 2)
    batches = sorted({low, high})
    if len(batches) < 2:
        raise TfmemUsageError(f"batch {batch} is too small to extrapolate from (it is guarded as it runs)")
    peaks = probe_runs.probe_peaks(model, batches, train, use.structure, pipeline=use.feed == "arrays")
    return line_through(peaks), batches


def described(use: ModelUse, train: bool) -> ModelInfo | None:
    """The model's own parts, as the call will use them (training counts the gradients and slots); None when the model
    cannot be described, or a layer's output is not known yet (a subclassed model before its first call: its parts
    would count nothing)."""
    info = describe_model(replace(use, calls=[*use.calls, "fit"] if train and "fit" not in use.calls else use.calls))
    if info is None or not info.layers or any(_open_output(layer.output_shape) for layer in info.layers):
        return None
    return info


def model_upper_bound(info: ModelInfo | None, train: bool, batch: int) -> int | None:
    """A generous upper bound of one step's allocator growth from the model's own parts, no run: the layer outputs
    (training: with their gradients, TRAIN_ACTIVATION_FACTOR) at MODEL_MARGIN times, in chunks up to 1.5x, plus
    the gradients. The analytic basis misses by up to 73% on the benchmark's zoo (a recurrent layer's insides):
    only a step far inside the limit is let through on it. None where `described` gave none."""
    if info is None:
        return None
    per_sample = activation_bytes(info)
    gradients = info.trainable_bytes if train else 0
    return round(MODEL_MARGIN * (1.5 * per_sample * batch + gradients))


# the share of its layers' outputs (and of what recurrent layers keep per time step) a training step holds at its
# least: each output is a later layer's input, kept for its backward pass, but a fused or in-place op keeps fewer
# (MobileNetV2's step held 79% of the sum). A prediction below it missed part of the step (docs/preflight.md, "A
# floor from the model's own parts"). Layers whose output is a view of their input hold nothing of their own
PARTS_FLOOR_TRAIN = 0.6
_VIEWS = ("Flatten", "Reshape", "InputLayer", "Dropout", "Identity")


def parts_floor(info: ModelInfo | None, train: bool) -> float | None:
    """The least one step holds per sample by the model's own layer outputs, no run: training keeps most of them
    for its backward pass (PARTS_FLOOR_TRAIN of their sum with what recurrent layers keep per time step), and any
    call makes at least its largest output. None where `described` gave none."""
    if info is None:
        return None
    outputs = [layer.activation_bytes_per_sample for layer in info.layers if layer.type.split(" ")[0] not in _VIEWS]
    if not outputs:
        return None
    if not train:
        return float(max(outputs))
    return PARTS_FLOOR_TRAIN * (sum(outputs) + sum(layer.kept_bytes_per_sample for layer in info.layers))


def _open_output(shape: str | None) -> bool:
    """A layer's output shape (modelinfo's text, "(None, 40, 64)") unknown, or with a dimension besides the batch
    that is not known: its bytes per sample were counted as 0."""
    tuples = re.findall(r"\(([^()]*)\)", shape or "")  # one per output: "[(None, 4), (None, 5)]" has two
    if not tuples:
        return True
    return any(not d.strip().isdigit() for dims in tuples for d in dims.split(",")[1:] if d.strip())


def line_through(peaks: dict[int, tuple[int, int]]) -> Callable[[float], float]:
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


def _slots_to_build(model: KerasModel) -> int:
    """The optimizer's slot variables fit will make in its first step, when the optimizer has not made them yet
    (fewer variables than half its slots: an optimizer's own counters are a few scalars; tf_keras' legacy
    optimizers have no `built` and give their variables by a method)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return 0
    slots = OPTIMIZER_SLOTS.get(type(optimizer).__name__.lower(), 2)
    # a tf_keras model not built yet has no variables yet (kerases.variables_of): nothing to expect
    expected = slots * variable_bytes(kerases.variables_of(model, "trainable_variables"))
    return expected if variable_bytes(optimizer_variables(optimizer)) < expected / 2 else 0


def _largest(need: Callable[[int], float], room: float, batch: int, tried: Iterable[int] = ()) -> int | None:
    """The largest batch below `batch` whose `need` (growing with the batch) is within `room`, as people type it;
    None if not even 1 is. Each `need` may be a replay of the whole step, so the next batch tried is where the line
    through the bracket's two ends meets `room` (a step grows about linearly with the batch), aimed a little past
    it toward the end that has not moved, and halved where one end moved twice in a row: the same answers as
    halving the bracket, with 5 replays where that took 12 (a mean over 2,000 staircases: docs/preflight.md).
    `tried`: batches whose `need` costs nothing now (replayed already): the bracket starts from the closest of them,
    so a search again under a little less room (a refusal judged as the pre-flight leaves the kernel) costs about
    half the replays of the first (docs/preflight.md)."""
    above = need(batch) - room
    if above <= 0:
        return batch
    known = {b: need(b) - room for b in set(tried) if 1 <= b < batch}
    high = min((b for b, at in known.items() if at > 0), default=batch)
    above = known.get(high, above)
    low = max((b for b, at in known.items() if at <= 0 and b < high), default=None)
    if low is None:
        low, below = 1, need(1) - room
        if below > 0:
            return None
    else:
        below = known[low]
    moved = 0  # need(low) fits, need(high) does not; moved: -1 low last, 1 high, 2 twice
    # until every batch left between them is typed as the same one (from 16 up, typeable_batch rounds to 8s)
    while high - low > 1 and typeable_batch(high - 1) != typeable_batch(low):
        if moved == 2:
            mid = (low + high) // 2
        else:
            mid = round(low + (high - low) * -below / (above - below) + {-1: 4, 1: -4}.get(moved, 0))
        mid = min(max(mid, low + 1), high - 1)
        at = need(mid) - room
        if at <= 0:
            low, below, moved = mid, at, 2 if moved == -1 else -1
        else:
            high, above, moved = mid, at, 2 if moved == 1 else 1
    return typeable_batch(low)


def refusal(info: PreflightInfo, source: str) -> str:
    """The message of a refused call: what was predicted against what is allowed, and what to do."""
    fix = (
        f"Lower the batch size to {info.largest_batch} (the largest whose upper estimate fits), or run "
        "%tfmem fix shrink-batch for a ready cell."
        if info.largest_batch
        else "Not even batch 1 fits: free memory first (del large arrays, restart the kernel to give back a model's "
        "memory), or raise the limit."
    )
    gpu = info.gpu
    if gpu is not None and gpu.verdict == "refused":
        return (
            f"tfmem's pre-flight stopped {info.call}() before its first step: at batch {info.batch_size} the step "
            f"needs ~{format_bytes(gpu.step_bytes)} on {gpu.device} (-{gpu_band_below(info):.0%}/+{info.band:.0%}), "
            "where TensorFlow holds "
            f"{format_bytes(gpu.in_use_bytes)} of its {format_bytes(gpu.limit_bytes)} limit now. Nothing of the call "
            f"ran. {held_words(info)}{fix}{_cap_words(gpu)} (The probes ran on the CPU, never on the GPU the kernel "
            f"holds, and their step is modelled for it; {how_predicted(info)}; --no-preflight skips it.)"
        )
    return (
        f"tfmem's pre-flight stopped {info.call}() before its first step: at batch {info.batch_size} the process "
        f"would reach ~{format_bytes(info.predicted_rss_bytes)} ({band_words(info)}: it holds "
        f"{format_bytes(info.rss_bytes)} now, the step needs ~{format_bytes(info.step_bytes)}"
        + (f", plus {format_bytes(info.extra_bytes)} the call adds ({_extra_words(info)})" if info.extra_bytes else "")
        + f"), and {source} allows {format_bytes(info.threshold_bytes)}. Nothing of the call ran. {held_words(info)}"
        f"{fix}{restart_words(info)} ({how_predicted(info)}; --no-preflight skips it.)"
    )


def gpu_words(info: PreflightInfo) -> str:
    """The GPU's judgement in a sentence (with its leading space), or "" on a CPU."""
    gpu = info.gpu
    if gpu is None or not gpu.verdict:
        return ""
    said = {"fits": "fits", "uncertain": "within the band: cannot tell", "refused": "does not fit"}[gpu.verdict]
    allowance = (
        " with the first step's cuDNN workspace allowance beside it"
        if gpu.convolves
        else " (it runs no convolution: no cuDNN workspace beside it)"
    )
    return (
        f" On {gpu.device} (probes on the CPU, modelled for it): the step's ~{format_bytes(gpu.step_bytes)}"
        f"{allowance} against {format_bytes(gpu.room)} free of its {format_bytes(gpu.limit_bytes)} limit: {said}."
    )


def _cap_words(gpu: GpuPreflight) -> str:
    """What the batch named leaves beside the step on a GPU (with its leading space), or ""."""
    if not gpu.convolves:
        return " Its step runs no convolution: no cuDNN workspace is counted beside it."
    if not gpu.workspace_cap_bytes:
        return ""
    return (
        f" The batch named leaves room for one cuDNN workspace of up to {format_bytes(gpu.workspace_cap_bytes)} "
        "(TF_CUDNN_WORKSPACE_LIMIT_IN_MB, read at TensorFlow's first convolution: lower it in a fresh kernel for a "
        "larger batch, at the price of slower convolutions)."
    )


def restart_words(info: PreflightInfo) -> str:
    """Where the held regions cost the named batch: what a restart gives back and the batch judged without them
    (with its leading space), or ""."""
    if not info.restart_batch:
        return ""
    then = (
        f"this call's batch ({info.batch_size})"
        if info.restart_batch >= info.batch_size
        else f"about {info.restart_batch}"
    )
    return (
        f" TensorFlow's allocator holds {format_bytes(info.reusable_bytes)} of regions from earlier steps beyond "
        "what it uses now, and the batch named does not count on them (which of the step's tensors they could "
        f"hold is not known); a kernel restart gives them back, and then {then} would be judged to fit, as this "
        "call was judged."
    )


REFUSAL_LINES = 3  # lines of code a refusal names
REFUSAL_CODE = 60  # characters of a line's text in a refusal


def held_words(info: PreflightInfo) -> str:
    """The lines of code that held the most at the replay's peak, in one sentence (with its trailing space), or ""
    where no line is named."""
    named = [g for g in info.by_line if g.kind == "line"][:REFUSAL_LINES]
    if not named:
        return ""

    def one(g: LineGroup) -> str:
        code = g.code or ""
        code = code if len(code) <= REFUSAL_CODE else code[: REFUSAL_CODE - 1] + "…"
        return f"{g.label}" + (f" (`{code}`)" if code else "") + f" {format_bytes(g.bytes)}"

    return f"At the replay's peak: {', '.join(one(g) for g in named)}. "


def band_below(info: PreflightInfo) -> float:
    """How far under the prediction the process may grow (a report saved before the two ends differed has 0)."""
    return info.band_below or info.band


def band_words(info: PreflightInfo) -> str:
    """The prediction's band on what the process grows by: "±50%", or "-20%/+40%" where its two ends differ."""
    below = band_below(info)
    return f"±{info.band:.0%}" if below == info.band else f"-{below:.0%}/+{info.band:.0%}"


def _extra_words(info: PreflightInfo) -> str:
    """What `extra_bytes` holds: fit's copy of numpy arrays, and on the probes' line the slots to build (the
    replay's peak has them; the model's own step built its slots in the kernel while it was saved)."""
    if info.basis != "replay":
        return "optimizer slots, copies of numpy arrays"
    if not info.own_step:
        return "its copy of numpy arrays"
    built = "the slots and the graph" if info.call in TRAINING_CALLS else "the graph"  # no slots to evaluate/predict
    return f"its copy of numpy arrays; {built} of its step, saved for the probes"


def how_predicted(info: PreflightInfo) -> str:
    """How a pre-flight came to its prediction, and what it cost, in words."""
    batches = " and ".join(map(str, info.probe_batches))
    fed = f" ({info.fed_note})" if info.fed_note else ""
    floor = (
        f"; the step is judged at no less than the {format_bytes(info.floor_bytes)} the model's layer outputs alone "
        f"hold at batch {info.batch_size}, more than the prediction: the probes missed part of the step"
        if info.floor_bytes > info.step_bytes
        else ""
    )
    if info.basis == "model":
        return "no probes needed: the model's own parts, taken several times over, fit"
    if info.basis == "replay":
        steps = f"the model's own step, saved ({info.own_step}), traced" if info.own_step else "a clone's steps traced"
        again = " (the replay kept from this model's earlier refusal: no new probes)" if info.kept else ""
        return (
            f"{steps} at batches {batches}{fed} and replayed at batch {info.batch_size} through a "
            f"simulation of TensorFlow's allocator{again}, {info.seconds:.1f} s{floor}"
        )
    why = f"; the replay was not used: {info.replay_note}" if info.replay_note else ""
    again = " (the line kept from this model's earlier refusal: no new probes)" if info.kept else ""
    return f"predicted from one step of a clone at batches {batches}{fed}{again}, {info.seconds:.1f} s{why}{floor}"
