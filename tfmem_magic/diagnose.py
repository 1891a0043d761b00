"""Findings: each rule fires only on evidence from the report and states that evidence in numbers.

Finding ids are stable (shared/DESIGN.md §3). More rules arrive with the diagnosis issue; each is a small function
`rule(report) -> Finding | None` listed in RULES.
"""

from __future__ import annotations

from typing import Callable

from .report import Finding, Report
from .sizes import format_bytes

NEAR_BUDGET = 0.8  # share of the budget at which we warn


def allocator_blind_spot(report: Report) -> Finding | None:
    env = report.env
    if env.tensorflow is None or env.allocator_complete or env.allocator == "none":
        return None
    if env.allocator == "cpu":
        what = "keeps no statistics at all: TF memory is not measured, only process RSS"
    else:
        what = f"{env.allocator} tracks only allocations of 256 KiB or more, so smaller tensors are invisible"
    return Finding(
        id="allocator-blind-spot", severity="warn",
        title="TensorFlow's allocator hides part of the memory",
        evidence=f"TensorFlow started before the extension was loaded, and its CPU allocator {what}. Restart the "
                 "kernel and run `%load_ext tfmem_magic` (or `import tfmem_magic; tfmem_magic.prepare()`) before "
                 "any TensorFlow code: it switches on the BFC allocator, which sees every allocation.",
    )


def near_budget(report: Report) -> Finding | None:
    budget = report.env.budget_bytes
    peak = report.rss.peak_bytes
    if budget <= 0 or peak < NEAR_BUDGET * budget or report.status == "oom":
        return None
    share = peak / budget
    source = {"cgroup": "the container's memory limit", "user": "your limit", "ram": "the RAM available"}
    return Finding(
        id="near-budget", severity="critical" if share >= 0.95 else "warn",
        title=f"The process used {share:.0%} of {source.get(report.env.budget_source, 'the budget')}",
        evidence=f"Peak process memory {format_bytes(peak)} against a budget of {format_bytes(budget)} "
                 f"({report.env.budget_source}); {format_bytes(budget - peak)} to spare.",
        bytes=peak,
    )


def out_of_memory(report: Report) -> Finding | None:
    if report.status != "oom":
        return None
    parts = []
    request = report.error.request if report.error else None
    if request:
        op = f" for op {request['op']}" if request.get("op") else ""
        parts.append(f"TensorFlow could not allocate a {request['dtype']} tensor of shape {request['shape']} "
                     f"({format_bytes(request['bytes'])}){op} on {request['device']}.")
    g = report.guard
    if g is not None and g.tripped_by and g.tripped_by != "allocator":
        parts.append(f"tfmem's {g.tripped_by} stopped the cell at {format_bytes(g.tripped_rss_bytes)} of process "
                     f"memory against the limit of {format_bytes(g.limit_bytes)} ({g.source}).")
    elif g is not None and g.allocator_limit_bytes:
        parts.append(f"TensorFlow's allocator is capped at {format_bytes(g.allocator_limit_bytes)} (from {g.source}).")
    trace = report.trace
    if trace is not None and trace.at_peak:
        top = trace.at_peak[0]
        name = " · ".join(x for x in (top.layer, top.op) if x)
        parts.append(f"When it failed, {format_bytes(trace.peak_live_bytes)} was live in TensorFlow; the largest "
                     f"part: {name} ({top.phase}), {format_bytes(top.bytes)}.")
    if not parts:
        message = report.error.message if report.error else ""
        parts.append(message.splitlines()[0][:400] if message else "An out-of-memory error stopped the cell.")
    parts.append("The kernel and your variables are intact.")
    return Finding(id="oom", severity="critical", title="The cell ran out of memory", evidence=" ".join(parts),
                   bytes=request["bytes"] if request else None)


def input_copy(report: Report) -> Finding | None:
    trace = report.trace
    if trace is None or not trace.input_copies:
        return None
    copied = sum(c.bytes for c in trace.input_copies)
    at_peak = sum(c.bytes for c in trace.input_copies if c.live_at_peak)
    own = trace.allocated_at_peak_bytes
    if at_peak:
        share = at_peak / own if own else 1.0
        severity = "warn" if share >= 0.5 else "info"
        where = (f"{format_bytes(at_peak)} of it was live at the peak: {share:.0%} of the "
                 f"{format_bytes(own)} this cell held then.")
    else:
        severity = "info"
        where = "It was freed before the peak, so it did not raise this cell's peak."
    return Finding(
        id="input-copy", severity=severity,
        title="fit() copied the whole input arrays into tensors",
        evidence=f"TensorFlow allocated {format_bytes(copied)} for tensor copies of the numpy arrays handed to "
                 f"fit/evaluate/predict ({len(trace.input_copies)} array(s)): the data is held twice, once by numpy "
                 f"and once by TensorFlow. {where}",
        bytes=at_peak or copied, fixes=["tf-data-streaming"],
    )


RULES: list[Callable[[Report], Finding | None]] = [out_of_memory, near_budget, allocator_blind_spot, input_copy]


def findings(report: Report) -> list[Finding]:
    return [f for f in (rule(report) for rule in RULES) if f is not None]
