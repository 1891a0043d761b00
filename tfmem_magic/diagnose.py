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
    message = report.error.message if report.error else ""
    return Finding(
        id="oom", severity="critical", title="The cell ran out of memory",
        evidence=(message.splitlines()[0][:400] if message else "An out-of-memory error stopped the cell."),
    )


def input_copy(report: Report) -> Finding | None:
    trace = report.trace
    if trace is None or trace.requested_at_peak_bytes <= 0:
        return None
    copied = sum(g.bytes for g in trace.at_peak if g.op and g.op.startswith("input copy"))
    own = trace.allocated_at_peak_bytes
    if copied <= 0 or copied < 0.2 * own:
        return None
    return Finding(
        id="input-copy", severity="warn" if copied >= 0.5 * own else "info",
        title="fit() copied the whole input array into a tensor",
        evidence=f"{format_bytes(copied)} of the {format_bytes(own)} this cell held at its peak is a full "
                 "tensor copy of the numpy arrays handed to fit/evaluate/predict: the data is held twice, once "
                 "by numpy and once by TensorFlow.",
        bytes=copied, fixes=["tf-data-streaming"],
    )


RULES: list[Callable[[Report], Finding | None]] = [out_of_memory, near_budget, allocator_blind_spot, input_copy]


def findings(report: Report) -> list[Finding]:
    return [f for f in (rule(report) for rule in RULES) if f is not None]
