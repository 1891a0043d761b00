"""A report from an XSpace recorded elsewhere: a GPU machine, TensorBoard's `plugins/profile/<run>/` folder, a remote
capture (`tfmem show PATH.xplane.pb`, `tfmem_magic.analyze_xplane(path)`).

What a saved trace holds is TensorFlow's allocator events, not the process around them: the report has the
breakdown, the timeline and every allocator's peak and limit, and no process memory (RSS) and no model (the model
was never in this process). Its device is the allocator's (`GPU_4_bfc` -> GPU:4), never assumed to be GPU:0."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from tfmem_magic.analyze import analysis, bfc
from tfmem_magic.analyze.build import gpu_limits, xla_note
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Basis, DeviceMemory, EnvInfo, Knobs, Report
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import xplane

SUFFIXES = (".xplane.pb", ".xplane.pb.gz")
# TensorFlow's CPU allocators other than BFC: oneDNN's traces only requests of 256 KiB or more (measured: 5,162
# events where BFC gave 68,623 for the same 2 s of training), the plain one nothing
PARTIAL_CPU_ALLOCATORS = ("mklcpu", "cpu")
HOST_DEVICE = "CPU:0"  # the device a host allocator's figures are listed under


def is_xspace_path(path: str | Path) -> bool:
    """A saved trace (or a folder of them, as TensorBoard's profile plugin keeps them), not a saved report."""
    p = Path(path)
    return p.is_dir() or p.name.endswith(SUFFIXES)


class NoMemoryEvents(TfmemUsageError):
    """A profiler trace with no allocation in it: one segment of a paused trace can hold none (tfmem show skips it
    among a folder's others)."""


def xspace_files(path: str | Path) -> list[Path]:
    """The XSpace files at `path`: the file itself, or every one under a folder (one per host and capture)."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    found = sorted(f for suffix in SUFFIXES for f in p.rglob(f"*{suffix}"))
    if not found:
        raise TfmemUsageError(
            f"{p} holds no *.xplane.pb file (TensorBoard keeps them under LOGDIR/plugins/profile/<run>/)"
        )
    return found


def bare_report(
    path: str | os.PathLike[str], device: str | None = None, label: str | None = None, batch_size: int | None = None
) -> Report:
    """The report of one saved XSpace file (`.xplane.pb`, or gzipped). `device` picks the allocator ("GPU:1"); by
    default the busiest GPU's, else the CPU's. `batch_size`: the batch one step of that device ran (per replica),
    for the what-if from the trace (`trace_whatif`); by default read from the tensors' shapes."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TfmemUsageError(f"cannot read {p}: {exc.strerror or exc}") from exc
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        trace = xplane.read_segments([(data, 0)], device)
    except ImportError as exc:
        raise TfmemUsageError(f"reading {p} needs protobuf (pip install protobuf): {exc}") from exc
    except Exception as exc:  # a file that is not an XSpace: the protobuf reader's own error says what is wrong
        raise TfmemUsageError(f"{p} is not a TensorFlow profiler trace (XSpace): {exc}") from exc
    if not len(trace.events) and trace.unreadable_planes:
        raise TfmemUsageError(
            f"{p} was written in a format our own decoder does not read (an older TensorFlow "
            "stores its strings inline); reading it needs TensorFlow's protobuf classes: install "
            "tensorflow (or tensorflow-cpu) here, or read it where TensorFlow is installed"
        )
    if not len(trace.events):
        raise NoMemoryEvents(
            f"{p} has no memory events: record it with the TensorFlow profiler on a host with "
            "TensorFlow 2.x (tf.profiler.experimental.start or TensorBoard's capture), which "
            "records allocations by default"
        )
    if device is not None and (not trace.allocators or trace.allocators[0].device != device):
        named = ", ".join(sorted(a.device for a in trace.allocators if a.device)) or "none"
        raise TfmemUsageError(f"device={device!r}: the trace has no allocator for it (devices in it: {named})")
    info = analysis.summarize(trace, analysis.TraceContext())
    report = Report(label=label or p.name, mode="trace", status="ok", trace=info)
    # the headline is the allocator the breakdown is about (the other GPUs are listed in the trace and the notes)
    main = trace.allocators[0] if trace.allocators else None
    if main is not None:
        # an allocator that serves no TF device of its own (`gpu_host_bfc`: pinned host memory) is the host's. Every
        # other device's allocator follows the main one (each GPU of a multi-GPU trace: its own figures, for the
        # panel and a per-GPU replay); the main one first, which also settles a tie between two GPUs' growths
        report.tf = {main.device or HOST_DEVICE: device_memory(main)}
        for other in trace.allocators[1:] if device is None else []:  # a device asked for: the report is its own
            if other.device is not None and other.device not in report.tf:
                report.tf[other.device] = device_memory(other)
    else:  # events without an allocator name (an older TensorFlow): one series
        end = int(trace.events.live[-1])
        report.tf = {"CPU:0": DeviceMemory(int(info.preexisting_bytes), info.peak_live_bytes, end)}
    # a CPU process that did not switch to BFC before its first op traces only oneDNN's large allocations
    partial = main is not None and main.device == "CPU:0" and main.name in PARTIAL_CPU_ALLOCATORS
    report.env = EnvInfo(
        allocator=info.allocator or "unknown",
        allocator_complete=not partial,
        devices=sorted({a.device for a in trace.allocators if a.device} | set(report.tf)),
        device_limit_bytes=gpu_limits(info),
    )
    report.notes.append(
        f"Built from a saved trace ({p.name}): TensorFlow's allocator events only; the process's "
        "memory (RSS) and the model were not recorded in it."
    )
    report.notes.append(
        "No by-line view (the line of code that made each tensor): a saved trace has the ops' names, not the "
        "Python stacks TensorFlow keeps for each graph op in the process that traced it. Profile the cell with "
        "%%tfmem (or tfmem_magic.profile) in that process to have them (docs/lines.md)."
    )
    if main is not None and main.device is None:
        what = (
            "the pinned host memory that copies to and from a GPU go through"
            if "host" in main.name.lower()
            else "an allocator whose name ties it to no device"
        )
        report.notes.append(
            f"The trace's memory events are {main.name}'s only ({what}), listed as {HOST_DEVICE} "
            "(host memory). No GPU's own allocator (GPU_<n>_bfc) recorded events in it."
        )
    xla = xla_note(report)
    if xla:
        report.notes.append(xla)
    if main is not None:
        report.notes.append(first_step_note(report, main))
    if 0 < len(trace.events) <= REPLAY_CHECK_MAX_EVENTS:
        check = bfc.self_check(trace.events)  # once: the note says what it gave back, the what-if stands on it
        report.notes.append(replay_check_note(check, trace.events))
        report.whatif_basis = trace_whatif(report, trace.events, check, batch_size)
    elif len(trace.events) > REPLAY_CHECK_MAX_EVENTS:
        report.notes.append(
            f"No what-if from this trace: its {len(trace.events):,} memory events are more than "
            f"tfmem replays for a saved trace ({REPLAY_CHECK_MAX_EVENTS:,}, about 12 µs each, many "
            "times): record a few steps (tf.profiler.experimental.start / stop around them)."
        )
    if len(info.allocators) > 1:
        report.notes.append(
            "Other allocators in the trace: "
            + "; ".join(
                f"{a.name} ({a.device or 'pinned host memory'}): peak {format_bytes(a.peak_bytes)} in {a.events} events"
                for a in info.allocators[1:]
            )
            + f". The breakdown is about {info.allocator}."
        )
    return report


def device_memory(series: xplane.AllocatorSeries) -> DeviceMemory:
    """One allocator's figures in the report: its start, peak and end in the trace, and its peak since its process
    started as the trace's events state it."""
    return DeviceMemory(
        series.start_bytes, series.peak_bytes, series.end_bytes, lifetime_peak_bytes=series.lifetime_peak_bytes
    )


# what a GPU's first step holds that a later step does not, in words (docs/gpu.md, "The first step")
AUTOTUNE_WORDS = (
    "on a GPU, a process's first step times cuDNN's convolution algorithms (TensorFlow's autotuner), each "
    "with the workspace it asks for, up to TF_CUDNN_WORKSPACE_LIMIT_IN_MB (4 GiB per convolution unless set); "
    "in public Keras CNN traces from a Tesla T4, the peak since the process started was 2.0x and 2.5x the "
    "profiled step's"
)


def first_step_note(report: Report, main: xplane.AllocatorSeries) -> str:
    """The trace's peak beside its allocator's peak since the process started (`lifetime_peak_bytes`): which is
    higher and by how much, and that the what-if judges against the higher; where the trace does not record it,
    that it cannot tell, with the autotuning caveat on a GPU (docs/gpu.md, "The first step")."""
    where = main.device or main.name
    gpu = (main.device or "").startswith("GPU")
    lifetime, peak = main.lifetime_peak_bytes, main.peak_bytes
    if lifetime is None:
        return (
            f"The trace does not record {main.name}'s peak since its process started (BFC's peak_bytes_in_use), "
            f"so whether a moment before it (a first step) held more than its {format_bytes(peak)} is not known"
            + (f": {AUTOTUNE_WORDS}. Leave room for it, or judge by a trace that holds the first step." if gpu else ".")
        )
    if lifetime <= peak:
        return (
            f"The trace holds {where}'s peak since its process started ({format_bytes(lifetime)}, {main.name}'s "
            "peak_bytes_in_use): no moment before it held more."
        )
    return (
        f"{where}'s peak since its process started, {format_bytes(lifetime)} ({main.name}'s peak_bytes_in_use), "
        f"is {format_bytes(lifetime - peak)} above this trace's {format_bytes(peak)} ({lifetime / max(1, peak):.1f}x "
        "it): a moment before the trace held more"
        + (f" ({AUTOTUNE_WORDS})" if gpu else "")
        + ". The verdict judges that higher peak, and the what-if judges 'fits' and the largest batch against it, "
        "moved with the batch as the trace's step is."
    )


def trace_whatif(
    report: Report, events: xplane.MemoryEvents, own: bfc.SelfCheck, batch_size: int | None = None
) -> Basis | None:
    """The what-if basis of a saved trace: its own allocation sequence replayed at other batches
    (`step_replay.trace_curve`: the allocations whose shape carries the batch scaled), anchored on the trace's peak
    over what its allocator held at the start. The batch is `batch_size`, else the leading dimension that holds most
    of the shaped bytes (a note says which, and how to give another). None (with a note) where the replay cannot be
    used: no shapes, or a self-check (`own`, the trace's sequence replayed as traced) that failed. Only the batch is a
    knob here: the trace holds no model."""
    from tfmem_magic.analyze import step_replay  # NumPy and the simulator: only for a trace short enough to replay

    peak = report.tf_peak_bytes
    if peak is None:
        return None
    guessed, share = step_replay.trace_batch(events)
    batch = batch_size or guessed
    if not batch:
        report.notes.append("No what-if from this trace: none of its allocations has a shape to read a batch from.")
        return None
    if batch < 3:  # 1 and 2 lead many weights' shapes (1x1 kernels, biases): no telling the batch's tensors
        report.notes.append(
            f"No what-if from this trace at batch {batch}: below 3, the batch cannot be told from "
            "the weights' dimensions in the tensors' shapes."
        )
        return None
    curve = step_replay.trace_curve(events, batch, own)
    if not curve.passed:
        report.notes.append(f"No what-if from this trace at batch {batch}: {curve.why_not}.")
        return None
    if curve.summed:
        report.notes.append(
            f"This trace begins mid-run: {format_bytes(own.prepared.start if own.prepared else 0)} were in use "
            f"before its first event, and the free chunks the allocator had then are not in it, so tfmem's "
            f"simulation of the allocator replayed its sequence to {own.peak_error:+.1%} of its peak (over the "
            f"{step_replay.OWN_TOLERANCE:.0%} a simulated what-if needs). The what-if sums the trace's own chunks "
            "over those bytes instead, each batch-shaped one grown with the batch: it gives the trace's peak back "
            "to the byte at its batch, but not the fragmentation another batch would add."
        )
    if batch_size is None:
        report.notes.append(
            f"The what-if reads this trace's batch as {batch}: the leading dimension of {share:.0%} "
            "of the bytes its shaped tensors requested (the batch one step of this device ran, per "
            "replica). If it is not, give it: analyze_xplane(path, batch_size=N), or tfmem show "
            "--batch-size N."
        )
    i = curve.batches.index(batch)
    after = next((j for j, b in enumerate(curve.batches) if b >= 2 * batch), len(curve.batches) - 1)
    slope = (curve.peaks[after] - curve.peaks[i]) / max(1, curve.batches[after] - batch)
    # the parts: what the batch adds per sample on the replay's curve, the rest of the peak fixed (the parts give the
    # summary's split and the anchor; the batch knob moves the peak by the replay's change)
    return Basis(
        name="replay",
        weights=0,
        gradients=0,
        optimizer=0,
        input_copy=0,
        activations_per_sample=slope,
        input_per_sample=0.0,
        other=round(peak - slope * batch),
        fragmentation=1.0,
        measured_peak=peak,
        knobs=Knobs(batch_size=batch),
        slope_source="a saved trace's batch-shaped allocations",
        replay=curve,
    )


# the self-check replays every event in Python, up to four times while it learns the regions' addresses (~12 µs per
# event and replay, measured on a 106k-event CPU trace: 1.3 s): a longer trace (a whole training run) is not checked
REPLAY_CHECK_MAX_EVENTS = 20_000


def replay_check_note(check: bfc.SelfCheck, events: xplane.MemoryEvents) -> str:
    """What replaying the trace's allocation sequence through tfmem's simulator of TensorFlow's BFC allocator
    (analyze/bfc.py, `check`) gives back: the foundation of predictions from a trace at another batch
    (docs/bfc-replay.md)."""
    regions = "growing regions" if check.allow_growth else "one region of the whole limit"
    what = (
        f"tfmem's simulation of TensorFlow's BFC allocator ({regions}), replaying this trace's {check.events} "
        f"memory events of {events.allocator or 'its allocator'}"
    )
    if check.events_exact == check.events:
        return (
            f"{what}, reproduces its bytes in use after every event, and its peak "
            f"({format_bytes(check.traced_peak)}) exactly."
        )
    return (
        f"{what}, differs from its bytes in use by up to {format_bytes(check.max_abs_error)} "
        f"({check.events_exact} of {check.events} events exact; peak {check.peak_error:+.1%}): the trace began "
        "with free chunks it never shows (docs/bfc-replay.md)."
    )
