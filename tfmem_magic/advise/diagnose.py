"""Findings: each rule fires only on evidence from the report and states that evidence in numbers.

Finding ids are stable (docs/design.md, 'Finding ids'). Each rule is a small function `rule(report) -> Finding | None`
listed in RULES; the rules about the model, the batch and the data live in diagnose_model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tfmem_magic.advise.diagnose_held import HELD_MIN, HELD_RULES, held_lines_words, holder_words
from tfmem_magic.advise.diagnose_model import MODEL_RULES
from tfmem_magic.advise.gpu_target import DEFAULT_WORKSPACE_LIMIT_MB
from tfmem_magic.core.errors import clip_message
from tfmem_magic.core.report import Finding, Holder, Report
from tfmem_magic.core.sizes import format_bytes

NEAR_BUDGET = 0.8  # share of the budget at which we warn
LEAK_RUNS = 3  # consecutive runs of a cell that must each leave memory behind
LEAK_MIN_TF = 256 * 1024  # bytes a run must leave live in TF's allocator to count
LEAK_MIN_RSS = 16 * 2**20  # RSS growth per run to count (RSS is coarse: pages, allocator arenas)
RETRACE_MIN = 3  # traces of one tf.function in one cell
MIN_COPY_SHARE = 0.1  # an input copy worth a finding: this share of the cell's memory at the peak,
MIN_COPY_BYTES = 64 * 2**20  # or this large in itself
RAN_ON = 1.05  # a peak this far past where the guard tripped: the step ran on inside TensorFlow
MIN_WORKSPACE_SHARE = 0.1  # GPU workspaces worth a finding: this share of what was live at the peak,
MIN_WORKSPACE_BYTES = 256 * 2**20  # or this much in itself
KERAS_STEP_FUNCTIONS = (
    "multi_step_on_iterator",
    "one_step_on_iterator",
    "one_step_on_data",
    "predict_step",
    "train_function",
    "test_function",
    "predict_function",
)


@dataclass
class RunSummary:
    """What one run of a cell left behind, kept per cell key for the leak rule."""

    run: int
    tf_left_bytes: int | None  # TF live bytes after the run minus before it
    rss_end_bytes: int
    new_models: int
    holders: dict[str, int] = field(default_factory=dict)  # name -> TensorFlow bytes it reached after the run
    runtime_bytes: int = 0  # what only TensorFlow's gradient registry held after the run


def run_summary(report: Report, new_models: int) -> RunSummary:
    mem = report.main_device
    left = None if mem is None else mem.end_bytes - mem.baseline_bytes
    held = report.held
    return RunSummary(
        report.run,
        left,
        report.rss.end_bytes,
        new_models,
        {h.name: h.bytes for h in held.holders} if held else {},
        held.runtime_bytes if held else 0,
    )


def growing_holders(report: Report, earlier: RunSummary) -> list[Holder]:
    """The names that reach at least HELD_MIN more TensorFlow memory now than after the run `earlier`."""
    held = report.held
    return [h for h in held.holders if h.bytes - earlier.holders.get(h.name, 0) >= HELD_MIN] if held else []


def allocator_blind_spot(report: Report) -> Finding | None:
    env = report.env
    if not env.partial_allocator:
        return None
    saved = env.tensorflow is None  # a trace recorded in another process: a worker, a saved file
    if env.allocator == "cpu":
        what = env.allocator_misses + ("" if saved else ": TF memory is not measured, only process RSS")
    else:
        what = f"{env.allocator} {env.allocator_misses}, so smaller tensors are invisible"
    if saved:
        evidence = (
            f"The process that recorded this trace did not switch TensorFlow's CPU allocator to BFC before "
            f"its first op, and its allocator {what}: the peak and the breakdown are a lower bound. Start "
            "that process with `tfmem_magic.serve(PORT)` (a worker) or `tfmem_magic.prepare()` first "
            "thing, before any TensorFlow code, and record it again."
        )
    else:
        evidence = (
            f"TensorFlow started before the extension was loaded, and its CPU allocator {what}. Restart the "
            "kernel and run `%load_ext tfmem_magic` (or `import tfmem_magic; tfmem_magic.prepare()`) "
            "before any TensorFlow code: it switches on the BFC allocator, which sees every allocation."
        )
    return Finding(
        id="allocator-blind-spot",
        severity="warn",
        title="TensorFlow's allocator hides part of the memory",
        evidence=evidence,
    )


def near_budget(report: Report) -> Finding | None:
    """The GPU's memory (its allocator's limit) when the main device has one, then the host's budget (RSS). A saved
    trace's GPU is judged at the higher of its peak and its allocator's peak since the process started (a first
    step's: docs/gpu.md, "The first step")."""
    if report.stopped_for_memory:
        return None
    device = report.device_budget
    if device is not None:
        name, limit = device
        mem = report.tf[name]
        peak = max(mem.peak_bytes, mem.lifetime_peak_bytes or 0)
        since = " since its process started (above the trace's)" if peak > mem.peak_bytes else ""
        found = _near(
            peak,
            limit,
            f"TensorFlow used {{share}} of {name}'s memory",
            f"Peak on {name}{since} {{peak}} against its allocator's limit of {{budget}}",
        )
        if found is not None:
            return found
    source = {"cgroup": "the container's memory limit", "user": "your limit", "ram": "the RAM available"}
    return _near(
        report.rss.peak_bytes,
        report.env.budget_bytes,
        f"The process used {{share}} of {source.get(report.env.budget_source, 'the budget')}",
        f"Peak process memory {{peak}} against a budget of {{budget}} ({report.env.budget_source})",
    )


def _near(peak: int, budget: int, title: str, evidence: str) -> Finding | None:
    if budget <= 0 or peak < NEAR_BUDGET * budget:
        return None
    share = peak / budget
    values = {"share": f"{share:.0%}", "peak": format_bytes(peak), "budget": format_bytes(budget)}
    return Finding(
        id="near-budget",
        severity="critical" if share >= 0.95 else "warn",
        title=title.format(**values),
        evidence=evidence.format(**values) + f"; {format_bytes(max(0, budget - peak))} to spare.",
        bytes=peak,
    )


def out_of_memory(report: Report) -> Finding | None:
    """The cell ran out of memory, or its pre-flight refused a call that would have (the same id: the same fixes)."""
    if not report.stopped_for_memory:
        return None
    parts = []
    request = report.error.request if report.error else None
    if request:
        op = f" for op {request['op']}" if request.get("op") else ""
        parts.append(
            f"TensorFlow could not allocate a {request['dtype']} tensor of shape {request['shape']} "
            f"({format_bytes(request['bytes'])}){op} on {request['device']}."
        )
    site = report.error.site if report.error else None
    if site is not None:
        code = f" ({site.code})" if site.code else ""
        if site.via == "traceback":
            parts.append(f"The innermost line of your code it passed through: {site.label}{code}.")
        else:
            parts.append(f"The request was made by {site.label}{code}.")
    g = report.guard
    if g is not None and g.tripped_by in ("batch-end check", "watchdog"):  # tfmem's layers, not TF's allocator
        parts.append(
            f"tfmem's {g.tripped_by} stopped the cell at {format_bytes(g.tripped_rss_bytes)} of process "
            f"memory against the limit of {format_bytes(g.limit_bytes)} ({g.source})."
        )
        peak = report.rss.peak_bytes
        over = f"{format_bytes(peak)} ({peak / g.limit_bytes - 1:.0%} over the limit)"
        if g.tripped_rss_bytes and peak > max(g.tripped_rss_bytes, g.limit_bytes) * RAN_ON:
            if g.tripped_by == "watchdog":  # it raises in Python code: the step it saw pass the limit ran on first
                parts.append(
                    f"The step running then went on to {over} before it could be stopped: one step is one C++ call."
                )
            else:  # the batch-end check runs after a step: the step had been higher inside
                parts.append(f"Inside the last step the process had reached {over}: the check runs between steps.")
    elif g is not None and g.allocator_limit_bytes:
        parts.append(f"TensorFlow's allocator is capped at {format_bytes(g.allocator_limit_bytes)} (from {g.source}).")
    trace = report.trace
    if trace is not None and trace.at_peak:
        top = trace.at_peak[0]
        name = " · ".join(x for x in (top.layer, top.op) if x)
        parts.append(
            f"When it failed, {format_bytes(trace.peak_live_bytes)} was live in TensorFlow; the largest "
            f"part: {name} ({top.phase}), {format_bytes(top.bytes)}."
        )
        held = next((g for g in trace.by_line if g.kind == "line"), None)
        if held is not None:
            code = f" ({held.code})" if held.code else ""
            parts.append(
                f"The line of your code holding the most then: {held.label}{code}, {format_bytes(held.bytes)}."
            )
    if not parts:
        message = report.error.message if report.error else ""
        # a refusal says more (the lines at the replay's peak, the batch a restart would let it name): whole
        most = 1500 if report.status == "refused" else 600
        parts.append(clip_message(message, most) if message else "An out-of-memory error stopped the cell.")
    parts.append("The kernel and your variables are intact.")
    refused = report.status == "refused"
    return Finding(
        id="oom",
        severity="critical",
        title="The pre-flight stopped a call that would not fit, before it ran"
        if refused
        else "The cell ran out of memory",
        evidence=" ".join(parts),
        bytes=request["bytes"] if request else None,
    )


def input_copy(report: Report) -> Finding | None:
    """Keras copied numpy arrays into tensors, and the copy is a real part of the peak (or large in itself)."""
    trace = report.trace
    if trace is None or not trace.input_copies:
        return None
    copied = sum(c.bytes for c in trace.input_copies)
    at_peak = sum(c.bytes for c in trace.input_copies if c.live_at_peak)
    own = trace.allocated_at_peak_bytes
    share = at_peak / own if own else 1.0
    if share < MIN_COPY_SHARE and copied < MIN_COPY_BYTES:
        return None  # a few KiB of validation rows: true, but not worth a finding
    calls = report.model.calls if report.model is not None else []
    call = next((c for c in ("fit", "evaluate", "predict") if c in calls), "fit/evaluate/predict")
    roles = sorted({c.role for c in trace.input_copies})
    what = " and ".join(
        f"{role} data {format_bytes(sum(c.bytes for c in trace.input_copies if c.role == role))}" for role in roles
    )
    if at_peak:
        severity = "warn" if share >= 0.5 else "info"
        where = (
            f"{format_bytes(at_peak)} of it was live at the peak: {share:.0%} of the "
            f"{format_bytes(own)} this cell held then."
        )
    else:
        severity = "info"
        where = "It was freed before the peak, so it did not raise this cell's peak."
    return Finding(
        id="input-copy",
        severity=severity,
        title=f"{call}() copied the whole input arrays into tensors",
        evidence=f"TensorFlow allocated {format_bytes(copied)} for tensor copies of the numpy arrays handed to "
        f"{call}() ({what}): the data is held twice, once by numpy and once by TensorFlow. {where}",
        bytes=at_peak or copied,
        fixes=["tf-data-streaming"],
    )


def gpu_workspaces(report: Report) -> Finding | None:
    """cuDNN's and cuBLAS's scratch space (phase "workspace", on a GPU's allocator only) is a real part of the peak.
    The autotuner's rule and the two variables that change it: docs/gpu.md, "Workspaces"."""
    trace = report.trace
    if trace is None or not any(g.phase == "workspace" for g in trace.by_phase):
        return None
    from tfmem_magic.analyze.analysis import (
        WORKSPACE,
        is_cudnn_workspace,
    )  # NumPy: only for a trace that has workspaces

    total = sum(g.bytes for g in trace.by_phase if g.phase == WORKSPACE)
    peak = trace.peak_live_bytes
    share = total / peak if peak else 1.0
    if not total or (share < MIN_WORKSPACE_SHARE and total < MIN_WORKSPACE_BYTES):
        return None
    groups = sorted((g for g in trace.at_peak if g.phase == WORKSPACE), key=lambda g: -g.bytes)
    cudnn = any(is_cudnn_workspace(g.op, g.layer) for g in groups)
    listed = "; ".join(
        f"{' · '.join(x for x in (g.layer, g.op) if x)} {g.dtype or 'uint8'}{g.shape or ''} {format_bytes(g.bytes)}"
        + (f" ({g.count} buffers)" if g.count > 1 else "")
        for g in groups[:3]
    )
    where = report.main_device_name or "the GPU"
    parts = [
        f"{format_bytes(total)} of the {format_bytes(peak)} live on {where} at the peak ({share:.0%}) is scratch "
        f"space GPU kernels asked for, not tensors of the model" + (f": {listed}." if listed else ".")
    ]
    if cudnn:
        parts.append(
            "For each convolution TensorFlow's autotuner times cuDNN's algorithms on its first run and keeps the "
            "fastest whose workspace fits under TF_CUDNN_WORKSPACE_LIMIT_IN_MB "
            f"({format_bytes(DEFAULT_WORKSPACE_LIMIT_MB * 2**20)} per convolution unless set): a faster algorithm is "
            "paid for in memory. A lower cap makes it choose among the algorithms that fit, which can run slower; "
            "TF_CUDNN_USE_AUTOTUNE=0 skips the timing and takes cuDNN's heuristic choice, which can run slower too. "
            "The trials of a process's first step hold each algorithm's workspace in turn: that step can peak "
            "above this one."
        )
    if not cudnn or any(not is_cudnn_workspace(g.op, g.layer) for g in groups):
        parts.append("TensorFlow puts no cap on cuBLAS's matrix-product workspaces: no variable limits them.")
    return Finding(
        id="cudnn-workspace",
        severity="warn" if share >= 0.25 else "info",
        title=f"cuDNN/cuBLAS workspaces hold {share:.0%} of the peak on {where}",
        evidence=" ".join(parts),
        bytes=total,
        fixes=["cudnn-workspace-limit"] if cudnn else [],
    )


def retracing(report: Report) -> Finding | None:
    """A tf.function whose input signatures keep growing with its calls. What does not grow is not a retrace: the
    second trace of a first call that creates variables, and a dataset's partial last batch (a second signature
    that differs only in the batch dimension): TensorFlow's quickstart for experts traces 3 graphs for those."""
    growing = report.tf_function_signatures or report.tf_function_traces  # a report made before signatures
    heavy = {name: n for name, n in growing.items() if n >= RETRACE_MIN}
    if not heavy:
        return None
    name, signatures = max(heavy.items(), key=lambda item: item[1])
    count = max(report.tf_function_traces.get(name, signatures), signatures)
    if any(step in name for step in KERAS_STEP_FUNCTIONS):
        cause = (
            "Keras traced its training step again for each new model or compile(): build and compile the model "
            "once, outside the loop, and call keras.backend.clear_session() before making a new one."
        )
    else:
        cause = (
            "each call with a new Python number, a new input shape or dtype builds a new graph, and every graph "
            "stays in memory: pass tensors instead of Python numbers, or give the function an input_signature "
            "(or reduce_retracing=True)."
        )
    return Finding(
        id="retracing",
        severity="warn",
        title=f"tf.function '{name}' was traced {count} times in this cell",
        evidence=f"TensorFlow built {count} graphs for '{name}' during this cell, for {signatures} input signatures "
        f"that grow with the calls ({sum(report.tf_function_traces.values())} traces in all): {cause}"
        + _graphs_memory(report),
        fixes=["clear-session"] if "Keras" in cause else [],
    )


def _graphs_memory(report: Report) -> str:
    """What the retraced graphs may hold, as far as it was measured: the process's growth over the cell (graphs live
    in Python and TensorFlow's function library, outside the allocator tfmem reads per op)."""
    grew = report.rss.end_bytes - report.rss.baseline_bytes
    if not report.rss.end_bytes or grew < 2**20:
        return ""
    return (
        f" The process held {format_bytes(grew)} more at the cell's end than at its start; every graph and its "
        "concrete function stay in memory as long as the tf.function does (del it, or re-create it, to free them)."
    )


def leak_growth(report: Report, previous: Sequence[RunSummary]) -> Finding | None:
    """Memory that every one of the last LEAK_RUNS runs of the same cell left behind."""
    if len(previous) < LEAK_RUNS - 1:
        return None
    current = run_summary(report, 0)
    recent = list(previous[-(LEAK_RUNS - 1) :]) + [current]
    new_models = sum(r.new_models for r in previous[-(LEAK_RUNS - 1) :])
    left = [r.tf_left_bytes for r in recent]
    if all(x is not None and x > LEAK_MIN_TF for x in left):
        per_run = sum(left) // len(left)  # type: ignore[arg-type]
        named = growing_holders(report, previous[-(LEAK_RUNS - 1)])
        runtime_grew = (
            report.held is not None and report.held.runtime_bytes - previous[-(LEAK_RUNS - 1)].runtime_bytes >= HELD_MIN
        )
        if named or runtime_grew:
            who = [holder_words(h) for h in named[:3]]
            if runtime_grew:
                who.append(
                    "TensorFlow's gradient registry holds the trained models no name reaches (docs/held-memory.md)"
                )
            cause = "Who holds it: " + "; ".join(who) + ". Drop those references and %tfmem free gives the memory back."
            fixes = ["clear-session"]
        elif new_models >= LEAK_RUNS - 1:
            cause = (
                "The cell builds a new Keras model each run while memory grows each run: the earlier models are "
                "still referenced somewhere (a list, a callback, Out[...]). Drop those references; "
                "keras.backend.clear_session() also resets Keras' global state."
            )
            fixes = ["clear-session"]
        else:
            cause = (
                "Something keeps tensors alive between runs: a list or dict they are appended to, a global, "
                "or an output history (Out[...], _). Clear it, or keep only what you need as numpy values."
            )
            fixes = []
        growth = ", ".join(f"+{format_bytes(x)}" for x in left)
        return Finding(
            id="leak-growth",
            severity="warn",
            title=f"Each run of this cell leaves ~{format_bytes(per_run)} more in TensorFlow",
            evidence=f"Runs {recent[0].run}-{recent[-1].run} of this cell left {growth} live in TensorFlow's "
            f"allocator after they ended. {cause}{held_lines_words(report)}",
            bytes=per_run * len(left),
            fixes=fixes,
            holders=[h.name for h in named[:3]],
        )
    rss = [r.rss_end_bytes for r in [previous[-LEAK_RUNS]] + recent] if len(previous) >= LEAK_RUNS else []
    steps = [b - a for a, b in zip(rss, rss[1:], strict=False)]
    if steps and all(step > LEAK_MIN_RSS for step in steps):
        return Finding(
            id="leak-growth",
            severity="warn",
            title=f"Process memory grows ~{format_bytes(sum(steps) // len(steps))} with each run of this cell",
            evidence=f"After runs {recent[0].run}-{recent[-1].run} the process held "
            + ", ".join(format_bytes(x) for x in rss[1:])
            + ", while TensorFlow's live bytes did not grow: numpy arrays or Python objects are kept "
            "between runs (appended to a list, stored in a global).",
            bytes=sum(steps),
        )
    return None


RULES: list[Callable[[Report], Finding | None]] = [
    out_of_memory,
    near_budget,
    allocator_blind_spot,
    input_copy,
    gpu_workspaces,
    retracing,
    *MODEL_RULES,
    *HELD_RULES,
]


def findings(report: Report, previous: Sequence[RunSummary] = ()) -> list[Finding]:
    """Every rule's finding; `previous` are the earlier runs of the same cell (for the leak rule)."""
    found = [f for f in (rule(report) for rule in RULES) if f is not None]
    leak = leak_growth(report, previous)
    return found + ([leak] if leak is not None else [])
