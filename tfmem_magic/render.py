"""Pure Report → view functions: a text summary, a static HTML report, and the mime bundle holding both.

The HTML is self-contained (inline style, inline SVG chart) so that saved notebooks, nbconvert and GitHub show it
without a kernel. Every string that comes from the user's code (labels, op and layer names, messages) is escaped.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .report import MIME_TYPE, LiveGroup, Report
from .sizes import format_bytes

_SOURCE = {"cgroup": "container limit", "ram": "available RAM", "user": "your limit"}


def verdict(report: Report) -> str:
    """One line a person reads in two seconds."""
    if report.status == "oom":
        return "ran out of memory"
    if report.status == "interrupted":
        return "interrupted"
    budget, peak = report.env.budget_bytes, report.rss.peak_bytes
    if budget <= 0:
        return "measured"
    share = peak / budget
    source = _SOURCE.get(report.env.budget_source, "budget")
    if peak > budget:
        return f"over the {source} by {format_bytes(peak - budget)}"
    if share >= 0.8:
        return f"used {share:.0%} of the {source}"
    prefix = "raised an error; " if report.status == "error" else ""
    return f"{prefix}fits with {format_bytes(budget - peak)} to spare ({source})"


def _tf_line(report: Report) -> str | None:
    parts = []
    for device, mem in report.tf.items():
        parts.append(f"{device} peak {format_bytes(mem.peak_bytes)} = {format_bytes(mem.baseline_bytes)} before "
                     f"+ {format_bytes(mem.peak_bytes - mem.baseline_bytes)} in the cell; "
                     f"{format_bytes(mem.end_bytes)} held after")
    return "; ".join(parts) or None


def _group_label(g: LiveGroup) -> str:
    bits = [b for b in (g.layer, g.op) if b]
    return " · ".join(bits) or (g.phase or "?")


def render_text(report: Report) -> str:
    r = report
    head = f"tfmem · {r.label + ' · ' if r.label else ''}{r.status} · {r.wall_s:.2f} s · {r.mode} mode"
    lines = [head, f"Verdict   {verdict(r)}"]
    tf_line = _tf_line(r)
    if tf_line:
        lines.append(f"TF        {tf_line} ({r.env.allocator})")
    lines.append(f"RSS       peak {format_bytes(r.rss.peak_bytes)} (baseline {format_bytes(r.rss.baseline_bytes)}, "
                 f"+{format_bytes(r.rss.peak_bytes - r.rss.baseline_bytes)})")
    lines.append(f"Budget    {format_bytes(r.env.budget_bytes)} ({r.env.budget_source}); "
                 f"RAM {format_bytes(r.env.ram_total_bytes)}")
    if r.guard is not None:
        lines.append(f"Limit     {format_bytes(r.guard.limit_bytes)} {guard_detail(r)}")
    if r.error:
        lines.append(f"Error     {r.error.type}: {r.error.message.splitlines()[0][:200] if r.error.message else ''}")
    t = r.trace
    if t is not None and t.events:
        lines.append(f"At peak   {format_bytes(t.peak_live_bytes)} live at t={t.peak_time_s:.3f} s: "
                     + ", ".join(f"{g.phase} {format_bytes(g.bytes)}" for g in t.by_phase))
        if t.by_layer:
            lines.append("Layers    " + ", ".join(f"{g.layer} {format_bytes(g.bytes)}" for g in t.by_layer[:6]))
        for g in t.at_peak[:5]:
            shape = f" {g.dtype or ''}{g.shape or ''}" if (g.shape or g.dtype) else ""
            lines.append(f"  {format_bytes(g.bytes):>10}  {_group_label(g)} ({g.phase}){shape}")
    if r.model is not None:
        m = r.model
        lines.append(f"Model     {m.name}: {m.params:,} params ({format_bytes(m.param_bytes)}), optimizer "
                     f"{m.optimizer or 'none'}, batch {m.batch_size or '?'}")
    for f in r.findings:
        lines.append(f"[{f.severity}] {f.title}: {f.evidence}")
    for note in r.notes + ([r.trace.note] if r.trace and r.trace.note else []) + (
            [r.env.allocator_note] if r.env.allocator_note else []):
        lines.append(f"Note      {note}")
    return "\n".join(lines)


# ---- HTML ------------------------------------------------------------------------------------------------------

_STYLE = """
.tfmem-report{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;line-height:1.4;
 border:1px solid rgba(128,128,128,.35);border-radius:6px;padding:10px 12px;max-width:980px;color:inherit}
.tfmem-report h4{margin:0 0 6px 0;font-size:14px}
.tfmem-report .tfmem-verdict{font-weight:600;margin-bottom:6px}
.tfmem-report .tfmem-ok{color:#2e7d32}.tfmem-report .tfmem-warn{color:#b26a00}.tfmem-report .tfmem-bad{color:#c62828}
.tfmem-report table{border-collapse:collapse;margin:4px 0 8px 0}
.tfmem-report td,.tfmem-report th{padding:2px 8px;text-align:left;border-bottom:1px solid rgba(128,128,128,.2)}
.tfmem-report td.num,.tfmem-report th.num{text-align:right;font-variant-numeric:tabular-nums}
.tfmem-report .tfmem-bar{display:inline-block;height:9px;background:#5b8def;border-radius:2px;vertical-align:middle}
.tfmem-report .tfmem-muted{opacity:.7}
.tfmem-report details{margin:4px 0}
"""


def _verdict_class(report: Report) -> str:
    if report.status == "oom" or report.rss.peak_bytes > report.env.budget_bytes > 0:
        return "tfmem-bad"
    if any(f.severity != "info" for f in report.findings) or report.status != "ok":
        return "tfmem-warn"
    return "tfmem-ok"


def _rows(groups: list[LiveGroup], key: str, total: int, limit: int = 10) -> str:
    out = []
    for g in groups[:limit]:
        width = int(120 * g.bytes / total) if total > 0 else 0
        label = getattr(g, key) or "(none)"
        out.append(f"<tr><td>{escape(str(label))}</td><td class='num'>{escape(format_bytes(g.bytes))}</td>"
                   f"<td><span class='tfmem-bar' style='width:{width}px'></span></td></tr>")
    return "".join(out)


def summary_items(report: Report) -> list[tuple[str, str, str]]:
    """(label, value, detail) for the headline numbers: shared by the static table and the panel's cards."""
    r = report
    items = []
    for device, mem in r.tf.items():
        items.append((f"TF peak ({device})", format_bytes(mem.peak_bytes),
                      f"{format_bytes(mem.baseline_bytes)} before + {format_bytes(mem.peak_bytes - mem.baseline_bytes)}"
                      f" in the cell; {format_bytes(mem.end_bytes)} held after"))
    items.append(("Process RSS peak", format_bytes(r.rss.peak_bytes),
                  f"baseline {format_bytes(r.rss.baseline_bytes)}, "
                  f"+{format_bytes(r.rss.peak_bytes - r.rss.baseline_bytes)} in the cell"))
    left = r.env.budget_bytes - r.rss.peak_bytes
    items.append(("Budget left" if left >= 0 else "Over budget", format_bytes(abs(left)),
                  f"of {format_bytes(r.env.budget_bytes)} ({_SOURCE.get(r.env.budget_source, r.env.budget_source)})"))
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


def png_img(png: bytes | None, alt: str) -> str:
    if not png:
        return ""
    import base64

    data = base64.b64encode(png).decode()
    return f"<img alt='{escape(alt)}' style='max-width:100%' src='data:image/png;base64,{data}'>"


def render_html(report: Report, timeline: bytes | None = None) -> str:
    """The static report; `timeline` is the timeline PNG if the caller already rendered it (else it is rendered)."""
    r = report
    title = "tfmem report" + (f" · {escape(r.label)}" if r.label else "")
    cells = [(escape(label), f"{escape(value)} <span class='tfmem-muted'>{escape(detail)}</span>")
             for label, value, detail in summary_items(r)]
    cells.append(("Allocator", f"{escape(r.env.allocator)} <span class='tfmem-muted'>"
                  f"({'sees every allocation' if r.env.allocator_complete else 'partial view'}; "
                  f"RAM {escape(format_bytes(r.env.ram_total_bytes))})</span>"))
    if r.model is not None:
        m = r.model
        cells.append(("Model", f"{escape(m.name)}: {m.params:,} params ({escape(format_bytes(m.param_bytes))}), "
                      f"optimizer {escape(m.optimizer or 'none')}, batch {escape(str(m.batch_size or '?'))}"))
    if r.error:
        cells.append(("Error", f"{escape(r.error.type)}: {escape(r.error.message[:500])}"))
    summary = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in cells)
    parts = [f"<div class='tfmem-report'><style>{_STYLE}</style><h4>{title}</h4>",
             f"<div class='tfmem-verdict {_verdict_class(r)}'>{escape(verdict(r))}</div>",
             f"<table class='tfmem-summary'>{summary}</table>"]
    t = r.trace
    if t is not None and t.events:
        total = t.peak_live_bytes
        parts.append(f"<h4>At the peak: {escape(format_bytes(total))} live at t = {t.peak_time_s:.3f} s</h4>")
        parts.append(f"<table class='tfmem-by-phase'><tr><th>phase</th><th class='num'>bytes</th><th></th></tr>"
                     f"{_rows(t.by_phase, 'phase', total)}</table>")
        if t.by_layer:
            parts.append(f"<table class='tfmem-by-layer'><tr><th>layer</th><th class='num'>bytes</th><th></th></tr>"
                         f"{_rows(t.by_layer, 'layer', total)}</table>")
        top = "".join(
            f"<tr><td>{escape(g.op or '')}</td><td>{escape(g.layer or '')}</td><td>{escape(g.phase or '')}</td>"
            f"<td>{escape(g.dtype or '')}</td><td>{escape(g.shape or '')}</td>"
            f"<td class='num'>{escape(format_bytes(g.bytes))}</td><td class='num'>{g.count}</td></tr>"
            for g in t.at_peak[:15])
        parts.append("<details><summary>Largest tensors at the peak</summary><table class='tfmem-at-peak'>"
                     "<tr><th>op</th><th>layer</th><th>phase</th><th>dtype</th><th>shape</th>"
                     f"<th class='num'>bytes</th><th class='num'>n</th></tr>{top}</table></details>")
        if t.requested_at_peak_bytes:
            ratio = t.allocated_at_peak_bytes / t.requested_at_peak_bytes
            parts.append(f"<div class='tfmem-muted'>Allocated {escape(format_bytes(t.allocated_at_peak_bytes))} for "
                         f"{escape(format_bytes(t.requested_at_peak_bytes))} requested (×{ratio:.2f}: allocator "
                         f"rounding and fragmentation); {t.events:,} memory events traced.</div>")
    if timeline is None:
        from .figures import timeline_png

        timeline = timeline_png(r)
    parts.append(png_img(timeline, "memory timeline: TF live bytes and process RSS over the cell"))
    if r.findings:
        items = "".join(f"<li><b>{escape(f.title)}</b> <span class='tfmem-muted'>[{escape(f.severity)}]</span><br>"
                        f"{escape(f.evidence)}</li>" for f in r.findings)
        parts.append(f"<h4>Findings</h4><ul class='tfmem-findings'>{items}</ul>")
    if r.fixes:
        items = "".join(f"<li><b>{escape(x.title)}</b>: {escape(x.why)}<pre>{escape(x.code)}</pre></li>"
                        for x in r.fixes)
        parts.append(f"<h4>Fixes</h4><ul class='tfmem-fixes'>{items}</ul>")
    notes = r.notes + ([t.note] if t and t.note else []) + ([r.env.allocator_note] if r.env.allocator_note else [])
    if notes:
        parts.append("<div class='tfmem-notes tfmem-muted'>" + "<br>".join(escape(n) for n in notes) + "</div>")
    parts.append("</div>")
    return "".join(parts)


def mime_bundle(report: Report, timeline: bytes | None = None) -> dict[str, Any]:
    """What a front end needs: the static HTML, a text fallback and the report itself."""
    return {"text/plain": render_text(report), "text/html": render_html(report, timeline), MIME_TYPE: report.to_dict()}


# ---- one-line summaries (watch mode) and comparisons ------------------------------------------------------------

def watch_line(report: Report) -> str:
    """The one line under a watched cell."""
    parts = ["tfmem"]
    mem = report.main_device
    if mem is not None:
        parts.append(f"TF peak +{format_bytes(mem.peak_bytes - mem.baseline_bytes)} "
                     f"(left {format_bytes(mem.end_bytes - mem.baseline_bytes)})")
    grew = report.rss.peak_bytes - report.rss.baseline_bytes
    parts.append(f"RSS {format_bytes(report.rss.peak_bytes)} (+{format_bytes(grew)})")
    parts.append(f"{report.wall_s:.2f} s")
    if report.status != "ok":
        parts.append(report.status)
    parts.extend(f"[{f.id}]" for f in report.findings if f.severity != "info")
    return " · ".join(parts)


def watch_html(report: Report) -> str:
    warn = [f for f in report.findings if f.severity != "info"]
    details = "".join(f"<div>{escape(f.title)}: {escape(f.evidence)}</div>" for f in warn)
    return (f"<div class='tfmem-watch' style='font-size:11px;opacity:.7;font-family:monospace'>"
            f"{escape(watch_line(report))}{details}</div>")


def _compare_rows(a: Report, b: Report) -> list[tuple[str, str, str, str]]:
    def tf_peak(r: Report) -> int | None:
        return r.tf_peak_bytes if r.tf else None

    def delta(x: float | None, y: float | None, fmt=format_bytes) -> str:
        if x is None or y is None:
            return ""
        change = f"{'+' if y >= x else '-'}{fmt(abs(y - x))}"
        return change + (f" ({(y / x - 1):+.0%})" if x else "")

    rows = [("label", a.label or "-", b.label or "-", ""), ("status", a.status, b.status, "")]
    pa, pb = tf_peak(a), tf_peak(b)
    rows.append(("TF peak over baseline", format_bytes(pa), format_bytes(pb), delta(pa, pb)))
    for name, get in (("RSS peak", lambda r: r.rss.peak_bytes),
                      ("RSS growth", lambda r: r.rss.peak_bytes - r.rss.baseline_bytes)):
        rows.append((name, format_bytes(get(a)), format_bytes(get(b)), delta(get(a), get(b))))
    rows.append(("time", f"{a.wall_s:.2f} s", f"{b.wall_s:.2f} s",
                 delta(a.wall_s, b.wall_s, lambda v: f"{v:.2f} s")))
    for r_name, pick in (("batch", lambda r: r.model.batch_size if r.model else None),
                         ("precision policy", lambda r: r.env.mixed_precision_policy)):
        if pick(a) is not None or pick(b) is not None:
            rows.append((r_name, str(pick(a)), str(pick(b)), ""))
    ta = {g.phase: g.bytes for g in a.trace.by_phase} if a.trace else {}
    tb = {g.phase: g.bytes for g in b.trace.by_phase} if b.trace else {}
    for phase in [p for p in ("forward", "backward", "optimizer", "input", "weights") if p in ta or p in tb]:
        x, y = ta.get(phase, 0), tb.get(phase, 0)
        rows.append((f"at peak: {phase}", format_bytes(x), format_bytes(y), delta(x, y)))
    return rows


def compare_text(a: Report, b: Report) -> str:
    rows = _compare_rows(a, b)
    return "\n".join(f"{name:<22} {x:>14} {y:>14}  {d}" for name, x, y, d in rows)


def compare_html(a: Report, b: Report) -> str:
    body = "".join(f"<tr><th>{escape(name)}</th><td class='num'>{escape(x)}</td><td class='num'>{escape(y)}</td>"
                   f"<td class='num'>{escape(d)}</td></tr>" for name, x, y, d in _compare_rows(a, b))
    return (f"<div class='tfmem-report'><style>{_STYLE}</style><h4>tfmem: A vs B</h4><table>"
            f"<tr><th></th><th class='num'>A</th><th class='num'>B</th><th class='num'>B - A</th></tr>{body}"
            "</table></div>")
