"""What the surfaces show of one report, computed once: the verdict, the headline numbers, the what-if rows, the
prediction at the cell's own settings, the notes. The text render, the static HTML twin and the live panel all render
a `ReportView`; none of them calls into the advice layer itself (the panel's sliders excepted: they predict anew)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeAlias

from tfmem_magic.advise import bases, parts, prediction
from tfmem_magic.advise.diagnose_held import EAGER_NO_LINE
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import ErrorSite, Knobs, LineGroup, PreflightInfo, Report, TraceInfo
from tfmem_magic.core.sizes import format_bytes

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's; annotations are not evaluated at run time
    from typing import Unpack

# the verdict's colour (ReportView.level, the CSS class tfmem-<level>)
VerdictLevel: TypeAlias = Literal["ok", "warn", "bad"]


@dataclass
class ReportView:
    report: Report
    verdict: str  # one line a person reads in two seconds
    level: str  # "ok" | "warn" | "bad": the verdict's colour
    summary: list[tuple[str, str, str]]  # (label, value, detail) of the headline numbers
    whatifs: list[tuple[str, prediction.WhatIf]]  # the static what-if rows
    base: prediction.WhatIf | None = None  # the prediction at the cell's own settings (the sliders' reference)
    base_problem: str | None = None  # why there is no `base` (no model, unknown batch...)
    calibrated: bool = False  # a calibrated basis is cached for this report
    notes: list[str] = field(default_factory=list)  # the report's notes, the trace's, the allocator's


def view_of(report: Report, whatifs: list[tuple[str, prediction.WhatIf]] | None = None) -> ReportView:
    """The view of `report` (`whatifs`: rows the caller already has)."""
    base, problem = None, None
    if report.prediction is not None and (report.model is not None or bases.from_trace(report.whatif_basis)):
        try:
            base = prediction.predict(report)
        except TfmemUsageError as exc:
            problem = str(exc)
    else:
        problem = "What-if needs a Keras model that the cell trained, evaluated or called; this cell used none."
    notes = (
        report.notes
        + trace_notes(report.trace)
        + peak_counter_notes(report)
        + ([report.env.allocator_note] if report.env.allocator_note else [])
    )
    return ReportView(
        report=report,
        verdict=verdict(report),
        level=verdict_level(report),
        summary=summary_items(report),
        whatifs=whatif_rows(report, base) if whatifs is None else whatifs,
        base=base,
        base_problem=problem,
        calibrated=prediction.is_calibrated(report),
        notes=notes,
    )


def knobs_text(knobs: Knobs) -> str:
    """A what-if's settings as a person reads them: "batch 64, mixed_bfloat16, adam"."""
    parts = [f"batch {knobs.batch_size}", knobs.policy]
    if knobs.optimizer:
        parts.append(knobs.optimizer)
    if knobs.accumulation_steps > 1:
        parts.append(f"{knobs.accumulation_steps} accumulation steps")
    if knobs.replicas > 1:
        parts.append(f"per replica of {knobs.replicas}")
    if not math.isclose(knobs.input_scale, 1.0):
        parts.append(f"input x{knobs.input_scale:g}")
    return ", ".join(parts)


def whatif_rows(report: Report, base: prediction.WhatIf | None = None) -> list[tuple[str, prediction.WhatIf]]:
    """A few what-ifs worth showing without a kernel (static report): other batch sizes, precision, optimizer.
    `base`: the prediction at the cell's own settings, when the caller has it (each one searches the largest batch)."""
    if report.prediction is None or (report.model is None and not bases.from_trace(report.whatif_basis)):
        return []
    if base is None:
        try:
            base = prediction.predict(report)
        except TfmemUsageError:
            return []
    batch = base.knobs.batch_size
    pre = report.preflight
    refused = pre is not None and pre.verdict == "refused" and pre.batch_size == batch
    out = [(f"as asked (batch {batch}, refused)" if refused else f"as run (batch {batch})", base)]

    # one the knobs do not allow (a batch below the replicas): left out
    def add(label: str, **knobs: Unpack[prediction.WhatIfKnobs]) -> None:
        try:
            out.append((label, prediction.predict(report, **knobs)))
        except TfmemUsageError:
            pass

    for factor in (0.5, 2, 4):
        if int(batch * factor) >= 1 and int(batch * factor) != batch:
            add(f"batch {int(batch * factor)}", batch_size=int(batch * factor))
    if report.model is None:  # a saved trace's: the batch is its only knob
        return out
    gpu = any("GPU" in d for d in report.env.devices)
    if report.model.training and base.knobs.policy == "float32":
        policy = "mixed_float16" if gpu else "mixed_bfloat16"
        add(f"{policy} policy", policy=policy)
    if report.model.training and parts.OPTIMIZER_SLOTS.get(base.knobs.optimizer or "", 0) >= 2:
        add("SGD with momentum", optimizer="sgd+momentum")
    return out


BUDGET_SOURCES = {"cgroup": "container limit", "ram": "available RAM", "user": "your limit"}
# the same, as a sentence names them ("over your limit", "over the available RAM")
_BUDGET_IN_WORDS = {"cgroup": "the container limit", "ram": "the available RAM", "user": "your limit"}


def verdict(report: Report) -> str:
    """One line a person reads in two seconds."""
    if report.status == "oom":
        return "ran out of memory"
    if report.status == "refused":
        return "stopped by the pre-flight before it ran: it would not fit"
    if report.status == "interrupted":
        return "interrupted"
    budget, peak = report.env.budget_bytes, report.rss.peak_bytes
    device = report.device_budget
    if device is not None and not (budget > 0 and peak > budget):  # the host's budget, when over, comes first
        return _device_verdict(report, *device)
    if budget <= 0:
        return "measured"
    host = _host_verdict(report, budget, peak)
    if report.on_gpu and device is None:
        # quick mode on a GPU (or a trace whose GPU allocator wrote no limit): TensorFlow tells a GPU allocator's
        # limit only in the trace, and the host's RAM is not the GPU's budget, so the verdict says which memory
        error = "raised an error; " if host.startswith("raised an error; ") else ""
        return (
            f"{error}process memory {host.removeprefix(error)}; {report.main_device_name}'s limit was not "
            "recorded (a trace records it)"
        )
    return host


def _host_verdict(report: Report, budget: int, peak: int) -> str:
    """The verdict against the host's budget (RAM, the container, your limit) for the process's RSS peak."""
    share = peak / budget
    source = BUDGET_SOURCES.get(report.env.budget_source, "budget")
    named = _BUDGET_IN_WORDS.get(report.env.budget_source, "the budget")
    if peak > budget:
        return f"over {named} by {format_bytes(peak - budget)}"
    if share >= 0.8:
        return f"used {share:.0%} of {named}"
    prefix = "raised an error; " if report.status == "error" else ""
    return f"{prefix}fits with {format_bytes(budget - peak)} to spare ({source})"


def _device_verdict(report: Report, name: str, limit: int) -> str:
    """The verdict against a GPU's own memory (its allocator's limit), at the higher of the peak measured and, in a
    saved trace, the allocator's peak since its process started (docs/gpu.md, "The first step")."""
    mem = report.tf[name]
    peak = max(mem.peak_bytes, mem.lifetime_peak_bytes or 0)
    since = " at its peak since the process started (above the trace's)" if peak > mem.peak_bytes else ""
    if peak > limit:
        return f"over {name}'s memory by {format_bytes(peak - limit)}{since}"
    if peak >= 0.8 * limit:
        return f"used {peak / limit:.0%} of {name}'s {format_bytes(limit)}{since}"
    prefix = "raised an error; " if report.status == "error" else ""
    return f"{prefix}fits {name} with {format_bytes(limit - peak)} to spare{since}"


def verdict_level(report: Report) -> VerdictLevel:
    """The verdict's colour: "bad" (out of memory, over the budget), "warn" (findings, errors), "ok"."""
    device = report.device_budget
    if device is not None and report.tf[device[0]].peak_bytes > device[1]:
        return "bad"
    if report.status == "oom" or report.rss.peak_bytes > report.env.budget_bytes > 0:
        return "bad"
    if any(f.severity != "info" for f in report.findings) or report.status != "ok":
        return "warn"
    return "ok"


def summary_items(report: Report) -> list[tuple[str, str, str]]:
    """(label, value, detail) for the headline numbers: shared by the static table and the panel's cards."""
    r = report
    items = []
    for device, mem in r.tf.items():
        items.append(
            (
                f"TF peak ({device})",
                format_bytes(mem.peak_bytes),
                f"{format_bytes(mem.baseline_bytes)} before + {format_bytes(mem.peak_bytes - mem.baseline_bytes)}"
                f" in the cell; {format_bytes(mem.end_bytes)} held after",
            )
        )
    if r.rss.peak_bytes:  # a report built from a saved trace has no process memory
        items.append(
            (
                "Process RSS peak",
                format_bytes(r.rss.peak_bytes),
                f"baseline {format_bytes(r.rss.baseline_bytes)}, "
                f"+{format_bytes(r.rss.peak_bytes - r.rss.baseline_bytes)} in the cell",
            )
        )
    budget = r.device_budget
    if budget is not None:
        name, limit = budget
        spare = limit - r.tf[name].peak_bytes
        items.append(
            (
                f"{name} left" if spare >= 0 else f"Over {name}",
                format_bytes(abs(spare)),
                f"of {format_bytes(limit)} (TensorFlow's allocator limit on {name})",
            )
        )
    left = r.env.budget_bytes - r.rss.peak_bytes
    source = BUDGET_SOURCES.get(r.env.budget_source, r.env.budget_source)
    if r.env.budget_bytes:
        items.append(
            (
                "Budget left" if left >= 0 else "Over budget",
                format_bytes(abs(left)),
                f"of {format_bytes(r.env.budget_bytes)} ({source})",
            )
        )
    items.append(("Time", f"{r.wall_s:.2f} s", f"{r.status} · {r.mode} mode"))
    if r.guard is not None:
        items.append(("Memory limit", format_bytes(r.guard.limit_bytes), guard_detail(r)))
    return items


def guard_detail(report: Report) -> str:
    """Where the limit came from, what enforced it, and what tripped: a guard is never armed silently."""
    g = report.guard
    if g is None:
        return ""
    layers = ", ".join(g.layers)
    text = f"from {g.source}; enforced by {layers}"
    if g.allocator_limit_bytes:
        text += f" (TF allocator cap {format_bytes(g.allocator_limit_bytes)})"
    if g.tripped_by:
        text += f"; stopped by the {g.tripped_by}"
    return text


def trace_notes(trace: TraceInfo | None) -> list[str]:
    """What the trace left out, and what the profiler itself cost (it is tfmem's memory, not the cell's)."""
    if trace is None:
        return []
    notes = [trace.note] if trace.note else []
    if trace.profiler_rss_bytes >= 2**20:
        notes.append(
            f"tfmem's profiler recorded {format_bytes(trace.profiler_bytes)} of events, which costs up to "
            f"{format_bytes(trace.profiler_rss_bytes)} of process memory while it runs: counted as tfmem's, "
            "never as this cell's (--quick records none)."
        )
    return notes


def peak_counter_notes(report: Report) -> list[str]:
    """TensorFlow's peak counter is reset for each measured cell and cannot be set back: say what it read before,
    when that was more than the cell's own peak (a notebook that reads get_memory_info()['peak'] sees the change)."""
    out = []
    for device, mem in report.tf.items():
        if mem.peak_before_bytes is not None and mem.peak_before_bytes > mem.peak_bytes:
            out.append(
                f"TensorFlow's peak counter for {device} (tf.config.experimental.get_memory_info) read "
                f"{format_bytes(mem.peak_before_bytes)} before this cell; tfmem reset it to measure the cell, "
                f"so it now holds the cell's own peak ({format_bytes(mem.peak_bytes)})."
            )
    return out


HELD_ROW_MIN = 64 * 1024  # a holder of less is not listed (a counter, a scalar tensor)


@dataclass
class HeldView:
    """The "Held after" view: what TensorFlow still held when the cell ended, and who holds it."""

    headline: str
    holders: list[tuple[str, str, str, str]]  # (name, what it is, what it holds, bytes)
    left_by_cell: list[tuple[str, str, int]]  # (layer or op, phase, bytes) of the cell's allocations still live
    hint: str | None = None  # how to give it back
    # what the cell left live, by the line of code that made it (TraceInfo.held_at_end_by_line, as by_line_rows words
    # the peak's), and what no line made; None where the trace did not cover the whole cell or resolved no lines
    by_line: list[LineRow] | None = None
    by_line_note: str | None = None


def held_view(report: Report) -> HeldView | None:
    """None when nothing is known of what was held (TensorFlow did not run, a saved trace)."""
    held = report.held
    if held is None:
        return None
    mem = report.main_device
    if held.left_bytes is not None and mem is not None:
        sign = "more" if held.left_bytes >= 0 else "less"
        headline = (
            f"TensorFlow held {format_bytes(abs(held.left_bytes))} {sign} after the cell than before it "
            f"({format_bytes(mem.end_bytes)} in all on {report.main_device_name})."
        )
    else:
        headline = "TensorFlow's allocator keeps no statistics here: the bytes below are the holders' own sizes."
    rows = []
    for h in held.holders:
        if h.bytes < HELD_ROW_MIN:
            continue
        if h.models:
            what = f"{len(h.models)} Keras model{'s' if len(h.models) > 1 else ''}: {', '.join(h.models[:4])}"
        elif h.tensors:
            what = f"{h.tensors} tensor{'s' if h.tensors > 1 else ''}"
        else:
            what = f"{h.variables} variable{'s' if h.variables > 1 else ''}"
        where = ", ".join(p for p in h.paths[:3] if p != h.name)
        detail = "; ".join(
            x
            for x in (
                f"via {where}" if where else "",
                f"{format_bytes(h.new_bytes)} made in this cell" if h.new_bytes else "",
                f"also reached by {', '.join(h.shared_with[:3])}" if h.shared_with else "",
            )
            if x
        )
        rows.append((h.name, h.kind, what + (f" ({detail})" if detail else ""), format_bytes(h.bytes)))
    if held.runtime_bytes >= HELD_ROW_MIN:
        rows.append(
            (
                "(TensorFlow's gradient registry)",
                "no name reaches it",
                f"weights and slots of models that are gone, kept by {held.runtime_entries} traced training "
                "step(s) (docs/held-memory.md)",
                format_bytes(held.runtime_bytes),
            )
        )
    left = []
    trace = report.trace
    if trace is not None:
        totals: dict[tuple[str, str], int] = {}
        for g in trace.held_at_end:
            key = (g.layer or g.op or "?", g.phase or "")
            totals[key] = totals.get(key, 0) + g.bytes
        left = [(name, phase, b) for (name, phase), b in sorted(totals.items(), key=lambda kv: -kv[1])[:10]]
    hint = None
    if rows:
        hint = (
            "%tfmem free NAME ... drops names and gives their memory back; %tfmem free alone gives back what no "
            "name holds."
            if held.runtime_bytes >= HELD_ROW_MIN
            else "%tfmem free NAME ... drops those names and says what TensorFlow gave back."
        )
    if not held.complete:
        headline += " The search of the notebook's names ran out of time: a holder may be missing."
    view = HeldView(headline, rows, left, hint)
    # only where the trace covered the whole cell: one that stopped early ends with a step's temporaries
    if trace is not None and trace.complete and trace.held_at_end_by_line:
        view.by_line, view.by_line_note = by_line_rows(trace, end=True), held_by_line_note(trace)
    return view


# what a by-line view groups, in the words of its heading (and of "No line of code made ..."), on every surface
PEAK_LINES = "what was live at the peak"
END_LINES = "what the cell left live at its end"


@dataclass
class LineRow:
    """One line of code in the by-line view (TraceInfo.by_line, docs/lines.md), in the words every surface shows:
    the text report, the static HTML, the panel's "by line" button and the JupyterLab renderer's view block."""

    label: str  # "In [2] line 5", "train.py:12"
    code: str  # the line's text, "" where it was not found
    bytes: str  # the bytes live at the peak, in words
    share: float  # of the peak's live bytes, 0 to 1
    split: str  # "forward 8 MiB, backward 2 MiB", "backward: gradients of its ops", or ""
    largest: str  # "largest of 2 tensors: float32[256,8192] MatMul 8 MiB", or ""
    made_by: str  # a layer's line: "layer wide made at In [3] line 2", "layer dense: made on this line", or ""
    made_by_code: str  # the text of the line that made the layer, where it is another line


def error_site_text(site: ErrorSite) -> str:
    """The line that made an OOM's failing request (ErrorInfo.site), in the words every surface shows: the op's own
    line for a graph op found, else the innermost line of the user's code the error passed through."""
    code = f": {site.code}" if site.code else ""
    if site.via == "traceback":
        return f"raised at {site.label}{code} (the innermost line of your code in the traceback)"
    layer = ""
    if site.layer:
        made = f", made at {site.made_by}" if site.made_by and site.made_by != site.label else ""
        layer = f" (layer {site.layer}{made})"
    return f"requested by {site.label}{code}{layer}"


def by_line_rows(trace: TraceInfo | None, top: int = 10, end: bool = False) -> list[LineRow]:
    """The `top` lines of code that had the most live at the peak (the groups of kind "line"; what no line made is
    in TraceInfo.by_line_note), largest first; with `end`, those that made the most of what the cell still had live
    when it ended (TraceInfo.held_at_end_by_line; what no line made: held_by_line_note), each's share of that."""
    if trace is None:
        return []
    if end:
        return line_rows(trace.held_at_end_by_line, trace.held_at_end_bytes, top)
    return line_rows(trace.by_line, trace.peak_live_bytes, top)


def preflight_line_rows(info: PreflightInfo | None, top: int = 10) -> list[LineRow]:
    """A refusal's replayed peak by line (PreflightInfo.by_line), as `by_line_rows` words a trace's: its share is
    of the replayed peak."""
    if info is None:
        return []
    return line_rows(info.by_line, sum(g.bytes for g in info.by_line), top)


def not_by_line(groups: list[LineGroup]) -> str:
    """What no line made, by what it is ("Keras internals (...) 7 MiB, eager ops 24 MiB"), or ""."""
    by_label: dict[str, int] = {}
    for g in groups:
        if g.kind != "line":
            by_label[g.label] = by_label.get(g.label, 0) + g.bytes
    return ", ".join(f"{label} {format_bytes(size)}" for label, size in sorted(by_label.items(), key=lambda kv: -kv[1]))


def line_rows(groups: list[LineGroup], total: int, top: int = 10) -> list[LineRow]:
    """The `top` groups of kind "line" of `groups`, largest first, each with its share of `total` bytes."""
    rows = []
    for g in [g for g in groups if g.kind == "line"][:top]:
        if g.forward_bytes and g.backward_bytes:
            split = f"forward {format_bytes(g.forward_bytes)}, backward {format_bytes(g.backward_bytes)}"
        elif g.backward_bytes == g.bytes:
            split = "backward: gradients of its ops"
        else:
            split = ""
        largest = ""
        if g.tensors:
            t = g.tensors[0]
            what = f"{t.dtype or ''}{t.shape or ''}".strip() or "a tensor"
            times = f" of {g.count} tensors" if g.count > 1 else ""
            largest = f"largest{times}: {what} {t.op or ''} {format_bytes(t.bytes)}".replace("  ", " ")
        made_by, made_by_code = "", ""
        if g.made_by and g.made_by != g.label:
            made_by, made_by_code = f"layer {g.layer} made at {g.made_by}", g.made_by_code or ""
        elif g.made_by and g.layer:
            made_by = f"layer {g.layer}: made on this line"
        rows.append(
            LineRow(
                label=g.label,
                code=g.code or "",
                bytes=format_bytes(g.bytes),
                share=g.bytes / total if total > 0 else 0.0,
                split=split,
                largest=largest,
                made_by=made_by,
                made_by_code=made_by_code,
            )
        )
    return rows


def held_by_line_note(trace: TraceInfo) -> str | None:
    """How much of what the cell left live a line of code named, and what no line made (the groups of
    TraceInfo.held_at_end_by_line of other kinds), as TraceInfo.by_line_note says it of the peak. An eager op's bytes
    have no line here: the op callback's lines are paired with the peak's tensors only."""
    groups = trace.held_at_end_by_line
    total = sum(g.bytes for g in groups)
    if not total:
        return None
    named = sum(g.bytes for g in groups if g.kind == "line")
    rest = [
        f"{g.label} {format_bytes(g.bytes)}" + (f" ({EAGER_NO_LINE})" if g.kind == "eager" else "")
        for g in groups
        if g.kind != "line"
    ]
    said = f"{format_bytes(named)} of the {format_bytes(total)} the cell left live named by a line of code"
    return said + (f"; not by a line: {', '.join(rest)}" if rest else "") + "."
