"""The text of `%tfmem status`, `%tfmem history` and `%tfmem fix`: what the extension sees of this process, one
line per profiled cell, a report's fixes. Plain text, read from the environment and the session; no IPython."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tfmem_magic.advise import probe_runs
from tfmem_magic.core import fallbacks
from tfmem_magic.core.report import Report
from tfmem_magic.core.session import CALIBRATE_MODES, HISTORY_BYTES, HISTORY_SIZE, SESSION, WHOLE_REPORTS
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import capabilities, environment, guard


def status_text() -> str:
    """The allocator, the budget, TensorFlow's and Keras' state, the limit in force and the private APIs."""
    setup = environment.allocator_setup()
    view = environment.allocator_view()
    budget = environment.memory_budget()
    found = environment.versions()
    imported = environment.tensorflow_imported()
    lines = [
        f"TensorFlow   {(found['tensorflow'] or 'imported') if imported else 'not imported yet'}"
        f"{', running' if environment.tensorflow_initialized() else ''}",
        f"Keras        {keras_line(found)}",
        f"Allocator    {view.name}{' (sees every allocation)' if view.complete else ''}"
        f"{'; BFC switched on by tfmem' if setup.bfc_set_by_us else ''}",
        f"Budget       {format_bytes(budget.budget_bytes)} ({budget.budget_source}); RAM "
        f"{format_bytes(budget.ram_total_bytes)}, available {format_bytes(budget.ram_available_bytes)}"
        + (f", container limit {format_bytes(budget.cgroup_limit_bytes)}" if budget.cgroup_limit_bytes else ""),
        history_line(),
        f"Calibration  {SESSION.calibrate} (%tfmem calibrate auto|on|off: {CALIBRATE_MODES[SESSION.calibrate]})",
    ]
    session = guard.session_limit()
    if session is not None:
        cap = guard.allocator_limit_bytes() or (session.allocator_mb * 2**20 if session.allocator_mb else None)
        lines.append(
            f"Limit        {format_bytes(session.bytes)} (%tfmem limit)"
            + (f"; TensorFlow's allocator capped at {format_bytes(cap)}" if cap else "")
        )
    warm = probe_runs.warm_waiting()
    if warm:
        lines.append(
            f"Probes       {warm} warm: started ahead for the pre-flight (~{format_bytes(probe_runs.WARM_OWN_BYTES)} "
            f"each), ended after {probe_runs.WARM_IDLE_S / 60:.0f} min unused or by %tfmem limit off"
        )
    if view.note:
        lines.append(f"Note         {view.note}")
    lines += capabilities_lines()
    lines.append(fallbacks_line())
    return "\n".join(lines)


def history_line() -> str:
    """What the history holds against its caps (core/session.py, docs/session.md)."""
    return (
        f"Reports      {len(SESSION.history)} of at most {HISTORY_SIZE} in the history, "
        f"{format_bytes(sum(SESSION.history_bytes))} of at most {format_bytes(HISTORY_BYTES)} "
        f"(the newest {WHOLE_REPORTS} whole, with their live panels; older ones without their time series); "
        f"{SESSION.published} published this session"
    )


def fallbacks_line() -> str:
    """How many times tfmem degraded instead of failing in this kernel, where, and how to read them."""
    counts = fallbacks.counts()
    if not counts:
        return "Fallbacks    none in this kernel"
    where = ", ".join(f"{name.removeprefix('tfmem_magic.')} {n}" for name, n in list(counts.items())[:4])
    more = ", ..." if len(counts) > 4 else ""
    return (
        f"Fallbacks    {sum(counts.values())} in this kernel ({where}{more}): %tfmem status --log lists the "
        "last ones; the logger 'tfmem_magic' at DEBUG level shows them with their tracebacks"
    )


def fallbacks_text() -> str:
    """The last fallbacks this kernel took, oldest first: where, what degraded, what was caught."""
    kept = fallbacks.recent()
    if not kept:
        return "No fallback in this kernel: every measurement ran as designed."
    rows = [f"The last {len(kept)} fallbacks (of {sum(fallbacks.counts().values())}), oldest first:"]
    rows += [f"  {f.where.removeprefix('tfmem_magic.')}: {f.what}" + (f" ({f.error})" if f.error else "") for f in kept]
    return "\n".join(rows)


def keras_line(found: dict[str, Any]) -> str:
    """Which Keras `tf.keras` is, and its version (`found`: environment.versions())."""
    if found["keras_package"] == "tf_keras":
        return f"tf_keras {found['keras'] or '(not imported yet)'}: tf.keras is Keras 2 (TF_USE_LEGACY_KERAS=1)"
    return f"Keras 3 {found['keras'] or '(not imported yet)'}"


def capabilities_lines() -> list[str]:
    """The private APIs tfmem relies on (measure/capabilities.py): how many are there, each one missing with what
    degrades, and those not checked yet (the Keras they belong to is not imported)."""
    if not environment.tensorflow_imported():
        return ["Capabilities checked once TensorFlow is imported"]
    absent, done, waiting = capabilities.missing(), capabilities.judged(), capabilities.pending()
    names = ", ".join(c.name for c in done if c not in absent)
    if not absent:
        lines = [f"Capabilities all {len(done)} available on {capabilities.versions_text()}: {names}"]
    else:
        lines = [
            f"Capabilities {len(done) - len(absent)} of {len(done)} available on "
            f"{capabilities.versions_text()}: {names or 'none'}"
        ]
        lines += [f"Capability   {c.name}: {capabilities.unavailable_text(c)}: {c.degraded}" for c in absent]
    if waiting:
        needs = " or ".join(sorted({c.needs for c in waiting}))
        lines.append(f"Capabilities checked when {needs} is imported: " + ", ".join(c.name for c in waiting))
    return lines


def history_text(reports: Iterable[Report]) -> str:
    """One line per report: its number, label, status, TF peak over baseline and what is left, RSS, time, warnings."""
    rows = [
        f"{'#':>3}  {'label':<20} {'status':<11} {'mode':<5} {'run':>3} {'TF peak +':>10} {'TF left':>9} "
        f"{'RSS peak':>10} {'RSS +':>9} {'time':>8}  findings"
    ]
    for r in reports:
        mem = r.main_device
        tf_peak = format_bytes(r.tf_peak_bytes) if mem else "n/a"
        delta = mem.end_bytes - mem.baseline_bytes if mem else 0
        left = "n/a" if mem is None else format_bytes(delta) if delta >= 0 else "-" + format_bytes(-delta)
        warnings = " ".join(f.id for f in r.findings if f.severity != "info")
        rows.append(
            f"{r.number:>3}  {(r.label or '-')[:20]:<20} {r.status:<11} {r.mode:<5} {r.run:>3} "
            f"{tf_peak:>10} {left:>9} {format_bytes(r.rss.peak_bytes):>10} "
            f"{format_bytes(r.rss.peak_bytes - r.rss.baseline_bytes):>9} {r.wall_s:>7.2f}s  {warnings}"
        )
    return "\n".join(rows) if len(rows) > 1 else "No cell has been profiled yet."


def fixes_text(report: Report) -> str:
    """`%tfmem fix` without a fix to put in: the report's fixes, numbered, or that it has none."""
    if not report.fixes:
        return f"Report {report.number} has no fix to suggest."
    return "\n".join(
        [f"{i}. [{f.id}] {f.title}: {f.why}" for i, f in enumerate(report.fixes, 1)]
        + [f"%tfmem fix K puts fix K into the next cell (report {report.number})."]
    )
