"""From what a cell's instruments measured to the report's measured part: memory figures, the model, the trace's
breakdown. Predictions, findings and fixes are added by the advise layer (see tfmem_magic.pipeline)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tfmem_magic.analyze import analysis, lines, modelinfo
from tfmem_magic.core.errors import PreflightRefused
from tfmem_magic.core.report import DeviceMemory, EnvInfo, ErrorInfo, GuardInfo, HeldInfo, Report, RssInfo, TraceInfo
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.core.types import KerasModel
from tfmem_magic.measure import environment, guard, kerases, xplane
from tfmem_magic.measure.instrument import ModelUse
from tfmem_magic.measure.measurement import Measured

# process memory the profiler itself takes per xplane byte it records, at its high-water mark (recorder + export;
# measured 22-27x on MLP, CNN, LSTM and GRU steps: tracer.py): the upper end, so it is never blamed on the user
PROFILER_RSS_PER_BYTE = 27


def status_of(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, PreflightRefused):  # nothing of the call ran: not an out-of-memory
        return "refused"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "ResourceExhaustedError":
        return "oom"
    return "error"


def measured_report(m: Measured, exc: BaseException | None, number: int) -> Report:
    """The figures every mode has: status, error, RSS, TF's allocator, environment, guard."""
    report = Report(
        label=m.options.label,
        status=status_of(exc),
        mode=m.mode,
        wall_s=m.wall_s,
        started_at=m.started_at,
        notes=m.notes,
        number=number,
    )
    if exc is not None:
        request = guard.parse_oom(str(exc)) if report.status == "oom" else None
        report.error = ErrorInfo(type(exc).__name__, str(exc), request)
        if report.status == "oom" and not isinstance(exc, MemoryError):  # TensorFlow's: it names the failing op
            report.error.site = lines.error_site(exc, request, _models(m))
    report.rss = RssInfo(m.rss_baseline, m.rss_peak, m.rss_end, m.rss_peak_source, m.rss_samples)
    report.tf = {d: DeviceMemory(*v, peak_before_bytes=m.peak_before.get(d)) for d, v in m.devices.items()}
    if m.tf_device in report.tf:
        report.tf[m.tf_device].samples = m.tf_samples
    report.env = _env(m)
    report.guard = _guard_info(m, report)
    report.held = _held(m, report)
    if m.instrumentation is not None:
        report.calls = list(m.instrumentation.calls)
    return report


def _models(m: Measured) -> list[KerasModel]:
    """The Keras models the cell used, still alive."""
    instr = m.instrumentation
    if instr is None:
        return []
    return [model for u in instr.models.values() if (model := u.model_ref()) is not None]


def _held(m: Measured, report: Report) -> HeldInfo | None:
    """Who holds TensorFlow memory at the cell's end (measured), with what the allocator says the cell left."""
    if m.held is None:
        return None
    mem = report.main_device
    return replace(m.held, left_bytes=None if mem is None else mem.end_bytes - mem.baseline_bytes)


def add_analysis(report: Report, m: Measured) -> ModelUse | None:
    """The model the cell used, its tf.function traces, and the trace's breakdown; returns the model's use record
    (or None) for the advice that needs the live model."""
    instr = m.instrumentation
    use = None
    if instr is not None:
        uses = list(instr.models.values())
        use = modelinfo.main_use(uses, instr.applied)
        report.model = (
            modelinfo.describe_model(use, instr.new_variables, instr.built_optimizers, instr.applied, uses)
            if use is not None
            else None
        )
        report.tf_function_traces = instr.function_traces()
        report.tf_function_signatures = instr.growing_signatures()
        report.notes.extend(instr.notes)
        if report.model is not None:
            name_the_models_keras(report)
    if m.mode == "trace" and m.tracer is not None and instr is not None:
        report.trace = trace_info(m, report, use)
        xla = xla_note(report)
        if xla:
            report.notes.append(xla)
    return use


def name_the_models_keras(report: Report) -> None:
    """The environment names the Keras the model was made with: `import tf_keras` without TF_USE_LEGACY_KERAS
    leaves `tf.keras` Keras 3, and its version and global policy would describe a Keras the model does not use."""
    package = report.model.keras_package if report.model is not None else None
    if package is None or package == report.env.keras_package:
        return
    report.env.keras_package, report.env.keras = package, kerases.version(package)
    report.env.mixed_precision_policy = environment.mixed_precision_policy(package)


def xla_note(report: Report) -> str | None:
    """Why an XLA-compiled step's breakdown has no layers: XLA allocates its buffers itself, without TensorFlow op or
    layer names. Said when the trace holds XLA runs (a Keras model's jit_compile step, a tf.function(jit_compile=True)
    of the user's, an auto-clustered launch, a saved trace's), or the cell's model was compiled with XLA."""
    model, trace = report.model, report.trace
    if trace is None or not trace.events:
        return None
    keras_jit = model is not None and bool(model.jit_compile)
    # runs that fell between the trace's segments are not counted, but their bytes are still XLA's (tagged with the
    # compiled function's name): those bytes alone are evidence too
    if not trace.xla_runs and not trace.xla_at_peak_bytes and not keras_jit:
        return None
    # what the trace attributed to XLA; in a Keras jit step whose runs the trace did not see, the untagged bytes are
    # XLA's too (measured: its buffers are untagged, and a run whose own event a pause cut off has nothing around
    # them). With runs seen, the untagged bytes inside them are already counted, and the others are not XLA's.
    untagged = sum(g.bytes for g in trace.at_peak if g.op == "(untagged)")
    xla_bytes = trace.xla_at_peak_bytes + (untagged if keras_jit and not trace.xla_runs else 0)
    who = f"{model.name}'s steps" if keras_jit and model is not None else "Code in this trace"
    runs = f" ({trace.xla_runs} XLA run{'s' if trace.xla_runs != 1 else ''} traced)" if trace.xla_runs else ""
    switch = (
        "model.compile(..., jit_compile=False)"
        if keras_jit
        else "jit_compile=False (tf.function(jit_compile=False), model.compile(..., jit_compile=False))"
    )
    # HLO metadata names the Keras layers of each XLA op, but the buffers XLA allocates (one temporary block for many
    # ops' values, measured on TF 2.21) map to no single op: the bytes stay unattributed rather than guessed
    return (
        f'{who} ran as XLA computations{runs}: jit_compile=True, or Keras 3\'s jit_compile="auto", which turns '
        "it on when a GPU is present. XLA allocates its buffers itself, without op or layer names, so "
        f"{format_bytes(xla_bytes)} at the peak is in no layer (op '{analysis.XLA_OP}', phase 'other'). Run "
        f"with {switch} for a per-layer breakdown; the peak itself differs without XLA, which fuses ops and "
        "reuses buffers."
    )


def _guard_info(m: Measured, report: Report) -> GuardInfo | None:
    g = m.guard
    if g is None:
        return None
    allocator = guard.allocator_limit_bytes()
    armed = m.instrumentation is not None and m.instrumentation.installed
    layers = guard_layers(report.on_gpu, allocator_capped=bool(allocator), batch_end_armed=armed)
    tripped = g.tripped_by
    if tripped is None and report.error is not None and report.error.request is not None:
        tripped = oom_tripped_by(report.error.request)
    return GuardInfo(g.limit, g.source, layers, allocator, tripped, g.tripped_rss or None)


def guard_layers(on_gpu: bool, allocator_capped: bool, batch_end_armed: bool) -> list[str]:
    """The guard's layers as the report lists them, each saying which memory it watches on a GPU: the allocator cap
    (TF_CPU_BFC_MEM_LIMIT_IN_MB) is the CPU allocator's only, and the batch-end check and the watchdog read the
    process's RSS, which is host memory; none of them watches the GPU's memory (TensorFlow's own OOM error does)."""
    host = " (host memory)" if on_gpu else ""
    return (
        ([("allocator (CPU only)" if on_gpu else "allocator")] if allocator_capped else [])
        + ([f"batch-end check{host}"] if batch_end_armed else [])
        + [f"watchdog{host}"]
    )


def oom_tripped_by(request: dict[str, Any]) -> str:
    """What stopped a cell that TensorFlow's own OOM error ended: its allocator, named when it is a GPU's."""
    device, allocator = str(request.get("device") or ""), request.get("allocator")
    if "GPU" in device.upper() and allocator:
        return f"{allocator} allocator (the GPU's own memory)"
    return "allocator"


def _env(m: Measured) -> EnvInfo:
    view = environment.allocator_view()
    # a container limit is not the user's
    user_limit = m.limit if m.limit_source in ("--limit", "%tfmem limit") else None
    budget = environment.memory_budget(user_limit, rss_now=m.rss_baseline)
    return EnvInfo(
        **environment.versions(),
        allocator=view.name,
        allocator_complete=view.complete,
        allocator_note=view.note,
        devices=environment.tf_devices(),
        ram_total_bytes=budget.ram_total_bytes,
        ram_available_bytes=budget.ram_available_bytes,
        cgroup_limit_bytes=budget.cgroup_limit_bytes,
        budget_bytes=budget.budget_bytes,
        budget_source=budget.budget_source,
        mixed_precision_policy=environment.mixed_precision_policy(),
        tensorflow_started_in_cell=not m.tf_running_at_start and environment.tensorflow_initialized(),
    )


def gpu_limits(info: TraceInfo) -> dict[str, int]:
    """Each traced GPU's allocator limit: that GPU's budget (the CPU's is the host's, see EnvInfo.budget_bytes)."""
    return {
        a.device: a.limit_bytes
        for a in info.allocators
        if a.device is not None and a.device.startswith("GPU:") and a.limit_bytes
    }


def step_dims(report: Report) -> set[int]:
    """The steps of each sequence-shaped layer output ((None, 64, 32) -> 64): what a Dense on a sequence folds into
    its matmul's first dimension ([B*T, D]). Images ((None, H, W, C)) are not folded that way."""
    model = report.model
    if model is None:
        return set()
    dims = set()
    for layer in model.layers:
        parts = [p.strip() for p in (layer.output_shape or "").strip("()[]").split(",") if p.strip()]
        if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) > 1:
            dims.add(int(parts[1]))
    return dims


def trace_info(m: Measured, report: Report, use: ModelUse | None) -> TraceInfo:
    instr, tracer = m.instrumentation, m.tracer
    assert instr is not None and tracer is not None
    models = _models(m)
    ctx = analysis.TraceContext(
        layer_names=set(instr.layer_names),
        input_array_bytes=set(instr.copy_roles),
        copy_roles=dict(instr.copy_roles),
        windows=list(tracer.windows),
        batch_size=report.model.replica_batch if report.model is not None else None,
        weight_shapes=modelinfo.weight_shapes(use),
        step_dims=step_dims(report),
        models=models,
        bare_layers=analysis.bare_scope_layers(models),
        traced_functions=[f for ref in instr.traced_functions if (f := ref()) is not None],
        eager_ops=m.eager_ops,
    )
    ctx.optimizer_scopes |= instr.optimizer_names
    info = analysis.summarize(xplane.read_segments(m.segments, report.main_device_name), ctx)
    report.env.device_limit_bytes.update(gpu_limits(info))
    if info.allocator and info.allocator != report.env.allocator and report.env.allocator != "none":
        report.env.allocator = info.allocator
    info.windows = [[round(a, 4), round(b, 4)] for a, b in tracer.windows]
    info.profiler_bytes = int(tracer.traced_bytes)
    # the recorder's and the export's high-water mark follows the largest segment (the next one reuses what an
    # export frees), plus the decoded events kept
    info.profiler_rss_bytes = int(PROFILER_RSS_PER_BYTE * tracer.largest_segment_bytes + 0.3 * info.profiler_bytes)
    info.budget_spent = tracer.budget_spent
    reasons = tracer.paused_reasons
    if reasons:
        info.complete = False
        info.note = "; ".join(reasons) + ". The allocator's peak still covers the whole cell."
    device = report.main_device
    if device is not None and info.events and not info.complete:
        gap = device.peak_bytes - info.peak_live_bytes
        if gap > max(0.01 * device.peak_bytes, 64 * 1024):
            info.note = (info.note or "") + (
                f" The cell's peak ({format_bytes(device.peak_bytes)}) came outside the traced window; the "
                f"breakdown shows the largest traced moment ({format_bytes(info.peak_live_bytes)})."
                + (
                    " The trace's memory budget was spent first: the what-if then predicts from the cell's own "
                    "peak (an upper bound)."
                    if tracer.budget_spent
                    else " Raise --trace-steps or --trace-seconds to trace more."
                )
            )
    return info
