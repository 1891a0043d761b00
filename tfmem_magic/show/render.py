"""Pure Report → view functions: a text summary, a static HTML report, and the mime bundle holding both.

The HTML is self-contained (inline style, inline SVG chart) so that saved notebooks, nbconvert and GitHub show it
without a kernel. Every string that comes from the user's code (labels, op and layer names, messages) is escaped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from html import escape
from typing import Any

from tfmem_magic.advise import bases, prediction
from tfmem_magic.core.errors import clip_message
from tfmem_magic.core.report import MIME_TYPE, LiveGroup, Report, TraceInfo, main_device_name
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.show.view import (
    BUDGET_SOURCES,
    END_LINES,
    PEAK_LINES,
    LineRow,
    ReportView,
    by_line_rows,
    error_site_text,
    guard_detail,
    held_view,
    knobs_text,
    not_by_line,
    preflight_line_rows,
    summary_items,
    trace_notes,
    verdict,
    verdict_level,
    view_of,
)


def _tf_line(report: Report) -> str | None:
    parts = []
    for device, mem in report.tf.items():
        parts.append(
            f"{device} peak {format_bytes(mem.peak_bytes)} = {format_bytes(mem.baseline_bytes)} before "
            f"+ {format_bytes(mem.peak_bytes - mem.baseline_bytes)} in the cell; "
            f"{format_bytes(mem.end_bytes)} held after"
        )
    return "; ".join(parts) or None


def _group_label(g: LiveGroup) -> str:
    bits = [b for b in (g.layer, g.op) if b]
    return " · ".join(bits) or (g.phase or "?")


def _clip(code: str, limit: int) -> str:
    return code if len(code) <= limit else code[: limit - 1] + "…"


def by_line_text(t: TraceInfo, top: int = 5) -> list[str]:
    """The text report's "By line" block: the `top` lines of code that had the most live at the peak, each with its
    code, its largest tensor and, for a layer's line, the line that made the layer; then what no line made
    (TraceInfo.by_line_note). The words are view.by_line_rows', as every surface shows them."""
    if not t.by_line:
        return []
    return lines_text(by_line_rows(t, top), t.by_line_note, "By line", PEAK_LINES)


def lines_text(rows: list[LineRow], note: str | None, title: str, what: str) -> list[str]:
    """A by-line block of the text report (the peak's, or what the cell left live in "Held by line"): `what` the
    block groups, then each line's bytes, label, code and split, its largest tensor and the line that made its layer;
    then `note`, what no line made."""
    out = [f"{title:<9} {what}, by the line of code that made it"]
    for row in rows:
        code = f"  {_clip(row.code, 90)}" if row.code else ""
        split = f" ({row.split})" if row.split else ""
        out.append(f"  {row.bytes:>10}  {row.label}{code}{split}")
        if row.largest:
            out.append(f"  {'':>10}    {row.largest}")
        if row.made_by:
            made = f": {_clip(row.made_by_code, 70)}" if row.made_by_code else ""
            out.append(f"  {'':>10}    {row.made_by}{made}")
    if note:
        out.append(f"  {'':>10}  {note}")
    return out


def by_line_html(t: TraceInfo) -> str:
    """The "By line" table of the static report and of the panel's "by line" button: each line of code with its
    text (as code), its bytes, its forward/backward split, its largest tensor and, for a layer's line, the line that
    made the layer; then what no line made. Empty without a by-line view (quick mode, a saved trace, an old report).
    labextension/src/logic.ts (byLineHtml) writes the same markup from the view block's rows."""
    if not t.by_line:
        return ""
    return lines_html(by_line_rows(t), t.by_line_note, PEAK_LINES)


def preflight_by_line_text(report: Report, top: int = 5) -> list[str]:
    """The text report's lines of a refusal (PreflightInfo.by_line): what the pre-flight's replay of the refused
    call's step held at its peak, by the line of code that made it, in the By line block's words; then what no line
    made. Empty where no line is named."""
    info = report.preflight
    rows = preflight_line_rows(info, top)
    if info is None or not rows:
        return []
    rest = not_by_line(info.by_line)
    what = f"what the replayed step held at its peak at batch {info.batch_size}"
    return lines_text(rows, f"not by a line: {rest}." if rest else None, "Refused", what)


def preflight_by_line_html(report: Report) -> str:
    """The static report's lines of a refusal (PreflightInfo.by_line), in the By line table's markup; "" where no
    line is named."""
    info = report.preflight
    rows = preflight_line_rows(info)
    if info is None or not rows:
        return ""
    rest = not_by_line(info.by_line)
    what = f"what the pre-flight's replay of the step held at its peak at batch {info.batch_size}"
    table = lines_html(rows, f"Not by a line: {rest}." if rest else None, what, "Refused")
    return f"<div class='tfmem-preflight-by-line'>{table}</div>"


def lines_html(rows: list[LineRow], note: str | None, what: str, title: str = "By line") -> str:
    """A "By line" table (the peak's, what the cell left live in the "Held after" section, or a refusal's replayed
    peak under `title`): `what` it groups, each line's row and a second row with what else is known of it, then
    `note`, what no line made."""
    cells = []
    for row in rows:
        width = round(120 * row.share)
        code = f"<code>{escape(row.code)}</code>" if row.code else ""
        made = escape(row.made_by) + (f": <code>{escape(row.made_by_code)}</code>" if row.made_by_code else "")
        more = " · ".join(x for x in (escape(row.split), escape(row.largest), made) if x)
        cells.append(
            f"<tr><td>{escape(row.label)}</td><td>{code}</td><td class='num'>{escape(row.bytes)}</td>"
            f"<td><span class='tfmem-bar' style='width:{width}px'></span></td></tr>"
        )
        if more:  # a second row under the line: what else is known of it
            cells.append(f"<tr class='tfmem-line-detail'><td></td><td colspan='3' class='tfmem-muted'>{more}</td></tr>")
    table = (
        "<table class='tfmem-by-line'><tr><th>line</th><th>code</th><th class='num'>bytes</th><th></th></tr>"
        f"{''.join(cells)}</table>"
        if cells
        else f"<div class='tfmem-muted'>No line of code made {escape(what)}.</div>"
    )
    said = f"<div class='tfmem-muted tfmem-by-line-note'>{escape(note)}</div>" if note else ""
    return (
        f"<div class='tfmem-by-line-view'><b>{escape(title)}</b>: {escape(what)}, by the line of code that made it"
        f"{table}{said}</div>"
    )


def held_text(report: Report, top: int = 5) -> list[str]:
    """The text report's "Held" line (who holds TensorFlow memory at the cell's end) and its "Held by line" block
    (what the cell left live, by the line of code that made it: view.held_view's rows)."""
    held = held_view(report)
    if held is None:
        return []
    out = []
    if held.holders:
        out.append("Held      " + "; ".join(f"{name} ({kind}) {size}" for name, kind, _, size in held.holders[:top]))
    if held.by_line is not None:
        out.extend(lines_text(held.by_line[:top], held.by_line_note, "Held by line", END_LINES))
    return out


def render_text(
    report: Report, whatifs: list[tuple[str, prediction.WhatIf]] | None = None, view: ReportView | None = None
) -> str:
    """The text report (`view`: computed once by a caller that renders several forms)."""
    r = report
    view = view or view_of(report, whatifs)
    head = f"tfmem · {r.label + ' · ' if r.label else ''}{r.status} · {r.wall_s:.2f} s · {r.mode} mode"
    lines = [head, f"Verdict   {view.verdict}"]
    tf_line = _tf_line(r)
    if tf_line:
        lines.append(f"TF        {tf_line} ({r.env.allocator})")
    device = r.device_budget
    if device is not None:
        lines.append(f"Budget    {device[0]}: {format_bytes(device[1])} (TensorFlow's allocator limit there)")
    if r.rss.peak_bytes:  # a report built from a saved trace has no process memory
        lines.append(
            f"RSS       peak {format_bytes(r.rss.peak_bytes)} (baseline {format_bytes(r.rss.baseline_bytes)}, "
            f"+{format_bytes(r.rss.peak_bytes - r.rss.baseline_bytes)})"
        )
    if r.env.budget_bytes:
        host = "host " if device else ""
        lines.append(
            f"Budget    {host}{format_bytes(r.env.budget_bytes)} ({r.env.budget_source}); "
            f"RAM {format_bytes(r.env.ram_total_bytes)}"
        )
    if r.guard is not None:
        lines.append(f"Limit     {format_bytes(r.guard.limit_bytes)} {guard_detail(r)}")
    if r.error:
        message = clip_message(r.error.message, 200)
        lines.append(f"Error     {r.error.type}" + (f": {message}" if message else ""))
        if r.error.site is not None:
            lines.append(f"          {error_site_text(r.error.site)}")
    lines.extend(preflight_by_line_text(r))
    t = r.trace
    if t is not None and t.events:
        lines.append(
            f"At peak   {format_bytes(t.peak_live_bytes)} live at t={t.peak_time_s:.3f} s: "
            + ", ".join(f"{g.phase} {format_bytes(g.bytes)}" for g in t.by_phase)
        )
        if t.by_layer:
            lines.append("Layers    " + ", ".join(f"{g.layer} {format_bytes(g.bytes)}" for g in t.by_layer[:6]))
        for g in t.at_peak[:5]:
            shape = f" {g.dtype or ''}{g.shape or ''}" if (g.shape or g.dtype) else ""
            times = f" ×{g.count}" if g.count > 1 else ""
            lines.append(f"  {format_bytes(g.bytes):>10}  {_group_label(g)} ({g.phase}){shape}{times}")
        lines.extend(by_line_text(t))
    lines.extend(held_text(r))
    for key, was, now in before_after_rows(r):
        lines.append(f"Before/after  {key}: {was} → {now}")
    if r.model is not None:
        lines.append(f"Model     {model_text(r)}")
    for f in r.findings:
        lines.append(f"[{f.severity}] {f.title}: {f.evidence}")
    for i, fix in enumerate(r.fixes, 1):
        after = f" (predicted TF peak {format_bytes(fix.predicted_peak_bytes)})" if fix.predicted_peak_bytes else ""
        lines.append(f"Fix {i}     [{fix.id}] {fix.title}{after}; in a notebook: %tfmem fix {i} --report {r.number}")
    for label, w in view.whatifs:
        fits = "" if w.fits is None else " " + fits_words(w)
        lines.append(f"What if   {label}: TF peak {format_bytes(w.peak_bytes)} {band_text(w)} ({w.basis}){fits}")
    for note in view.notes:
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
.tfmem-report .tfmem-by-line code{font-family:var(--jp-code-font-family,monospace);font-size:12px;white-space:pre-wrap}
.tfmem-report .tfmem-line-detail td{border-bottom:none;font-size:12px}
"""


def _rows(groups: list[LiveGroup], key: str, total: int, limit: int = 10) -> str:
    out = []
    for g in groups[:limit]:
        width = int(120 * g.bytes / total) if total > 0 else 0
        label = getattr(g, key) or "(none)"
        out.append(
            f"<tr><td>{escape(str(label))}</td><td class='num'>{escape(format_bytes(g.bytes))}</td>"
            f"<td><span class='tfmem-bar' style='width:{width}px'></span></td></tr>"
        )
    return "".join(out)


def png_img(png: bytes | None, alt: str) -> str:
    if not png:
        return ""
    import base64

    data = base64.b64encode(png).decode()
    return f"<img alt='{escape(alt)}' style='max-width:100%' src='data:image/png;base64,{data}'>"


def render_html(
    report: Report,
    timeline: bytes | None = None,
    whatifs: list[tuple[str, prediction.WhatIf]] | None = None,
    view: ReportView | None = None,
) -> str:
    """The static report; `timeline` is the timeline PNG if the caller already has it, `view` the report's view."""
    r = report
    view = view or view_of(report, whatifs)
    title = "tfmem report" + (f" · {escape(r.label)}" if r.label else "")
    cells = [
        (escape(label), f"{escape(value)} <span class='tfmem-muted'>{escape(detail)}</span>")
        for label, value, detail in view.summary
    ]
    cells.append(
        (
            "Allocator",
            f"{escape(r.env.allocator)} <span class='tfmem-muted'>"
            f"({'sees every allocation' if r.env.allocator_complete else 'partial view'}; "
            f"RAM {escape(format_bytes(r.env.ram_total_bytes))})</span>",
        )
    )
    if r.model is not None:
        cells.append(("Model", escape(model_text(r))))
    if r.error:
        message = clip_message(" ".join(r.error.message.split()), 500)  # HTML folds the lines anyway
        cells.append(("Error", f"{escape(r.error.type)}: {escape(message)}"))
        if r.error.site is not None:
            cells.append(("Failed at", escape(error_site_text(r.error.site))))
    summary = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in cells)
    parts = [
        f"<div class='tfmem-report'><style>{_STYLE}</style><h4>{title}</h4>",
        f"<div class='tfmem-verdict tfmem-{view.level}'>{escape(view.verdict)}</div>",
        f"<table class='tfmem-summary'>{summary}</table>",
        preflight_by_line_html(r),
        before_after_html(r),
    ]
    t = r.trace
    if t is not None and t.events:
        total = t.peak_live_bytes
        parts.append(f"<h4>{escape(peak_heading(t))}</h4>")
        parts.append(
            f"<table class='tfmem-by-phase'><tr><th>phase</th><th class='num'>bytes</th><th></th></tr>"
            f"{_rows(t.by_phase, 'phase', total)}</table>"
        )
        if t.by_layer:
            parts.append(
                f"<table class='tfmem-by-layer'><tr><th>layer</th><th class='num'>bytes</th><th></th></tr>"
                f"{_rows(t.by_layer, 'layer', total)}</table>"
            )
        parts.append(by_line_html(t))
        top = "".join(
            f"<tr><td>{escape(g.op or '')}</td><td>{escape(g.layer or '')}</td><td>{escape(g.phase or '')}</td>"
            f"<td>{escape(g.dtype or '')}</td><td>{escape(g.shape or '')}</td>"
            f"<td class='num'>{escape(format_bytes(g.bytes))}</td><td class='num'>{g.count}</td></tr>"
            for g in t.at_peak[:15]
        )
        parts.append(
            "<details><summary>Largest tensors at the peak</summary><table class='tfmem-at-peak'>"
            "<tr><th>op</th><th>layer</th><th>phase</th><th>dtype</th><th>shape</th>"
            f"<th class='num'>bytes</th><th class='num'>n</th></tr>{top}</table></details>"
        )
        if t.requested_at_peak_bytes:
            ratio = t.allocated_at_peak_bytes / t.requested_at_peak_bytes
            parts.append(
                f"<div class='tfmem-muted'>Allocated {escape(format_bytes(t.allocated_at_peak_bytes))} for "
                f"{escape(format_bytes(t.requested_at_peak_bytes))} requested (×{ratio:.2f}: allocator "
                f"rounding and fragmentation); {t.events:,} memory events traced.</div>"
            )
    if timeline is None:
        from tfmem_magic.show.figures import timeline_png

        timeline = timeline_png(r)
    parts.append(png_img(timeline, "memory timeline: TF live bytes and process RSS over the cell"))
    parts.append(held_html(r))
    if r.findings:
        items = "".join(
            f"<li><b>{escape(f.title)}</b> <span class='tfmem-muted'>[{escape(f.severity)}]</span><br>"
            f"{escape(f.evidence)}</li>"
            for f in r.findings
        )
        parts.append(f"<h4>Findings</h4><ul class='tfmem-findings'>{items}</ul>")
    parts.append(whatif_html(r, view.whatifs))
    if r.fixes:
        items = "".join(
            f"<li><b>{escape(x.title)}</b> <code>{escape(x.id)}</code>: {escape(x.why)}"
            + (
                f" <i>Predicted TF peak after it: {escape(format_bytes(x.predicted_peak_bytes))}.</i>"
                if x.predicted_peak_bytes is not None
                else ""
            )
            + (" <b>Needs a kernel restart (top of the notebook).</b>" if x.needs_restart else "")
            + f"<pre>{escape(x.code)}</pre></li>"
            for x in r.fixes
        )
        parts.append(
            f"<h4>Fixes</h4><div class='tfmem-muted'>In a live kernel each fix has an insert button; "
            f"here, copy the code, or run <code>%tfmem fix K --report {r.number}</code>.</div>"
            f"<ul class='tfmem-fixes'>{items}</ul>"
        )
    notes = view.notes
    if notes:
        parts.append("<div class='tfmem-notes tfmem-muted'>" + "<br>".join(escape(n) for n in notes) + "</div>")
    parts.append("</div>")
    return "".join(parts)


def held_html(report: Report) -> str:
    """The "Held after" section: who holds TensorFlow memory at the cell's end, and what the cell left live."""
    held = held_view(report)
    if held is None or not (held.holders or held.left_by_cell or held.by_line is not None):
        return ""
    parts = [f"<h4>Held after the cell</h4><div class='tfmem-held'>{escape(held.headline)}</div>"]
    if held.holders:
        rows = "".join(
            f"<tr><td><code>{escape(name)}</code></td><td>{escape(kind)}</td><td>{escape(what)}</td>"
            f"<td class='num'>{escape(size)}</td></tr>"
            for name, kind, what, size in held.holders
        )
        parts.append(
            "<table class='tfmem-holders'><tr><th>held by</th><th>is</th><th>holds</th>"
            f"<th class='num'>bytes</th></tr>{rows}</table>"
        )
    if held.by_line is not None:
        parts.append(lines_html(held.by_line, held.by_line_note, END_LINES))
    if held.left_by_cell:
        rows = "".join(
            f"<tr><td>{escape(name)}</td><td>{escape(phase)}</td><td class='num'>{escape(format_bytes(b))}</td></tr>"
            for name, phase, b in held.left_by_cell
        )
        parts.append(
            "<details><summary>What the cell allocated that was still live when the trace stopped"
            "</summary>"
            "<table class='tfmem-left'><tr><th>layer or op</th><th>phase</th><th class='num'>bytes</th></tr>"
            f"{rows}</table></details>"
        )
    if held.hint:
        parts.append(f"<div class='tfmem-muted'>{escape(held.hint)}</div>")
    return "".join(parts)


SPLIT_COLORS = {
    "weights": "#7e57c2",
    "gradients": "#ef6c00",
    "optimizer": "#c62828",
    "activations": "#5b8def",
    "input": "#2e7d32",
    "other": "#9e9e9e",
}


def split_bar(w: prediction.WhatIf, scale: int) -> str:
    """A stacked bar of the predicted parts (fragmentation spread over them), `scale` bytes = full width."""
    total = sum(max(0, v) for v in w.split.values()) or 1
    segs = "".join(
        f"<span title='{k}: {escape(format_bytes(round(v * w.peak_bytes / total)))}' style='display:inline-block;"
        f"height:10px;width:{100 * v * w.peak_bytes / total / max(scale, 1):.2f}%;background:{SPLIT_COLORS[k]}'>"
        "</span>"
        for k, v in w.split.items()
        if v > 0
    )
    return f"<div style='width:100%;background:rgba(128,128,128,.12);line-height:0'>{segs}</div>"


def band_text(w: prediction.WhatIf) -> str:
    """The band beside a prediction: "±15%", or "+15%/−33%" where its low side is wider (`WhatIf.below`)."""
    if w.below > w.error_band:
        return f"+{w.error_band:.0%}/−{w.below:.0%}"
    return f"±{w.error_band:.0%}"


def fits_words(w: prediction.WhatIf, no: str = "does NOT fit") -> str:
    """ "fits" / "does NOT fit", and the margin where it is not the band shown beside the peak (a CPU's process
    budget judges a peak above the cell's with +40%: bands.PROCESS_MARGIN)."""
    words = "fits" if w.fits else no
    return words + (f" at +{w.fit_margin:.0%}" if w.fit_margin > w.error_band else "")


def whatif_summary(w: prediction.WhatIf) -> str:
    """One sentence: the prediction, its band and basis, the budget and the largest batch."""
    text = f"Predicted TF peak {format_bytes(w.peak_bytes)} {band_text(w)} ({w.basis} basis, {knobs_text(w.knobs)})"
    if w.budget_bytes is not None:
        text += f"; {format_bytes(w.budget_bytes)} available: " + fits_words(w)
        if w.largest_batch is not None and w.largest_batch >= prediction.MAX_BATCH:
            text += f"; any batch up to {prediction.MAX_BATCH:,} fits"
        elif w.largest_batch is not None:
            text += f"; the largest batch that fits is {w.largest_batch:,}"
        else:
            text += "; no batch size fits with these settings"
    return text + "."


def whatif_html(report: Report, rows: list[tuple[str, prediction.WhatIf]] | None = None) -> str:
    """The static what-if table: the same model the live sliders use, at a few settings."""
    rows = view_of(report).whatifs if rows is None else rows
    if not rows:
        return ""
    scale = max([w.peak_bytes for _, w in rows] + [rows[0][1].budget_bytes or 0])
    body = "".join(
        f"<tr><td>{escape(label)}</td><td class='num'>{escape(format_bytes(w.peak_bytes))}</td>"
        f"<td class='num'>{band_text(w)}</td><td>{'' if w.fits is None else fits_words(w, 'no')}</td>"
        f"<td style='width:40%'>{split_bar(w, scale)}</td></tr>"
        for label, w in rows
    )
    legend = " ".join(f"<span style='color:{c}'>■</span> {k}" for k, c in SPLIT_COLORS.items())
    return (
        f"<h4>What if</h4><div>{escape(whatif_summary(rows[0][1]))}</div>"
        "<table class='tfmem-whatif'><tr><th>setting</th><th class='num'>TF peak</th><th class='num'>error</th>"
        f"<th>fits</th><th>split (bar: the largest of these or the budget)</th></tr>{body}</table>"
        f"<div class='tfmem-muted'>{legend}. {_whatif_how(report)}</div>"
    )


def _whatif_how(report: Report) -> str:
    """Where else the what-if is asked: a saved trace's has the batch only."""
    if bases.from_trace(report.whatif_basis):
        return "Predicted from the trace's own allocations; from Python: tfmem_magic.predict(report, batch_size=...)."
    return (
        "The live panel has sliders; from Python: "
        "tfmem_magic.predict(report, batch_size=..., policy=..., optimizer=..., accumulation_steps=...)."
    )


def before_after_rows(report: Report) -> list[tuple[str, str, str]]:
    b = report.before
    if b is None:
        return []
    after_tf = report.tf_peak_bytes

    def tf(value: int | None) -> str:
        return "n/a" if value is None else format_bytes(value)

    rows = [
        ("TF peak (in the cell)", tf(b.tf_peak_bytes), tf(after_tf)),
        ("process RSS peak", format_bytes(b.rss_peak_bytes), format_bytes(report.rss.peak_bytes)),
        ("time", f"{b.wall_s:.2f} s", f"{report.wall_s:.2f} s"),
        ("status", b.status, report.status),
    ]
    if b.predicted_peak_bytes is not None:
        verdict_text = (
            ("held" if b.held else "missed")
            if b.held is not None
            else "not judged: the kernel changed"
            if b.kernel_changed
            else "not checked"
        )
        rows.append(
            (
                f"prediction ±{(b.error_band or 0):.0%}",
                format_bytes(b.predicted_peak_bytes),
                f"{tf(after_tf)}: {verdict_text}",
            )
        )
    if b.kernel_changed:
        rows.append(("note", "", b.kernel_changed))
    return rows


def before_after_html(report: Report) -> str:
    rows, b = before_after_rows(report), report.before
    if not rows or b is None:  # rows only with a before
        return ""
    title = f"Before → after{' (fix ' + escape(b.fix_id) + ')' if b.fix_id else ''}: report {b.number}"
    body = "".join(
        f"<tr><th>{escape(k)}</th><td class='num'>{escape(x)}</td><td class='num'>{escape(y)}</td></tr>"
        for k, x, y in rows
    )
    return (
        f"<div class='tfmem-before-after'><b>{title}</b><table><tr><th></th><th class='num'>before</th>"
        f"<th class='num'>after</th></tr>{body}</table></div>"
    )


def model_text(report: Report) -> str:
    """The model in one line: name, parameters, optimizer and batch (empty without a model)."""
    m = report.model
    if m is None:
        return ""
    return (
        f"{m.name}: {m.params:,} params ({format_bytes(m.param_bytes)}), optimizer {m.optimizer_text}, "
        f"batch {m.batch_text}"
    )


def peak_heading(trace: TraceInfo) -> str:
    return f"At the peak: {format_bytes(trace.peak_live_bytes)} live at t = {trace.peak_time_s:.3f} s"


def lab_view(report: Report, view: ReportView) -> dict[str, Any]:
    """The bundle's `view` block: what the JupyterLab renderer (labextension/src/logic.ts) shows, as the Python views
    word and format it, so that the renderer formats no number itself and both say the same. Its JSON Schema is
    labextension/schema/view.schema.json (the renderer's types are made from it;
    tests/integration/test_labextension.py checks this block against it): a new key goes there too."""
    r, t = report, report.trace
    out: dict[str, Any] = {
        "verdict": view.verdict,
        "level": view.level,
        "main_device": main_device_name(r.tf),
        "summary": [list(item) for item in view.summary],
    }
    if r.model is not None:
        out["model"] = model_text(r)
    if r.before is not None:
        out["before_after"] = [list(row) for row in before_after_rows(r)]
    if r.error is not None and r.error.site is not None:
        out["error_site"] = error_site_text(r.error.site)
    if t is not None and t.events:
        total = t.peak_live_bytes
        rows = {
            key: [
                {
                    "label": str(getattr(g, key) or "(none)"),
                    "bytes": format_bytes(g.bytes),
                    "share": g.bytes / total if total > 0 else 0.0,
                }
                for g in groups[:10]
            ]
            for key, groups in (("phase", t.by_phase), ("layer", t.by_layer))
        }
        out["peak"] = {"heading": peak_heading(t), "by_phase": rows["phase"], "by_layer": rows["layer"]}
        if t.by_line:  # absent without a by-line view (quick mode, a saved trace, an older report)
            out["peak"]["by_line"] = [asdict(row) for row in by_line_rows(t)]
            out["peak"]["by_line_note"] = t.by_line_note
    out["timeline"] = timeline_series(r)
    held = held_view(r)
    if held is not None and (held.holders or held.by_line is not None):
        out["held"] = {"headline": held.headline, "hint": held.hint, "holders": [list(row) for row in held.holders]}
        if held.by_line is not None:  # absent where the trace did not cover the whole cell or named no lines
            out["held"]["by_line"] = [asdict(row) for row in held.by_line]
            out["held"]["by_line_note"] = held.by_line_note
    return out


def timeline_series(report: Report) -> list[dict[str, Any]]:
    """The timeline's series as figures.timeline_figure picks them (the trace's TF live bytes, else the sampled
    device's; the process RSS), those with two points or more, each with its range and the shared duration in words:
    TF's bytes are drawn from zero, the RSS from its lowest sample."""
    t, sampled = report.trace, report.sampled_device
    candidates: list[tuple[dict[str, Any], list[list[float]]]] = []
    if t is not None and t.timeline:
        candidates.append(({"kind": "trace", "name": "TF live bytes (trace)"}, t.timeline))
    elif sampled is not None:
        candidates.append(
            (
                {"kind": "device", "device": sampled[0], "name": f"TF live bytes (sampled, {sampled[0]})"},
                sampled[1].samples,
            )
        )
    candidates.append(({"kind": "rss", "name": "process RSS"}, report.rss.samples))
    drawn = [(about, points) for about, points in candidates if len(points) >= 2]
    seconds = max([p[0] for _, points in drawn for p in points], default=0.0)
    out = []
    for about, points in drawn:
        values = [p[1] for p in points]
        from_zero = about["kind"] != "rss"
        out.append(
            {
                **about,
                "from_zero": from_zero,
                "low": format_bytes(0 if from_zero else min(values)),
                "high": format_bytes(max(values)),
                "seconds": f"{seconds:.2f} s",
            }
        )
    return out


def mime_bundle(report: Report, timeline: bytes | None = None, view: ReportView | None = None) -> dict[str, Any]:
    """What a front end needs: the static HTML, a text fallback and the report itself, from one view."""
    view = view or view_of(report)  # a few predictions with a largest-batch search each: once for every form
    data = report.to_dict()
    data["view"] = lab_view(report, view)
    return {
        "text/plain": render_text(report, view=view),
        "text/html": render_html(report, timeline, view=view),
        MIME_TYPE: data,
    }


# ---- one-line summaries (watch mode) and comparisons ------------------------------------------------------------


def left_text(delta: int) -> str:
    """What a cell left in TensorFlow's allocator: "left 2 MiB", or "freed 36 KiB" when it ended below its start."""
    return f"left {format_bytes(delta)}" if delta >= 0 else f"freed {format_bytes(-delta)}"


def watch_line(report: Report) -> str:
    """The one line under a watched cell."""
    parts = ["tfmem"]
    mem = report.main_device
    if mem is not None:
        parts.append(
            f"TF peak +{format_bytes(mem.peak_bytes - mem.baseline_bytes)} "
            f"({left_text(mem.end_bytes - mem.baseline_bytes)})"
        )
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
    return (
        f"<div class='tfmem-watch' style='font-size:11px;opacity:.7;font-family:monospace'>"
        f"{escape(watch_line(report))}{details}</div>"
    )


def _compare_rows(a: Report, b: Report) -> list[tuple[str, str, str, str]]:
    def tf_peak(r: Report) -> int | None:
        return r.tf_peak_bytes if r.tf else None

    def delta(x: float | None, y: float | None, fmt: Callable[[float], str] = format_bytes) -> str:
        if x is None or y is None:
            return ""
        change = f"{'+' if y >= x else '-'}{fmt(abs(y - x))}"
        return change + (f" ({(y / x - 1):+.0%})" if x else "")

    rows = [("label", a.label or "-", b.label or "-", ""), ("status", a.status, b.status, "")]
    pa, pb = tf_peak(a), tf_peak(b)
    rows.append(("TF peak over baseline", format_bytes(pa), format_bytes(pb), delta(pa, pb)))
    growths: tuple[tuple[str, Callable[[Report], int]], ...] = (
        ("RSS peak", lambda r: r.rss.peak_bytes),
        ("RSS growth", lambda r: r.rss.peak_bytes - r.rss.baseline_bytes),
    )
    for name, get in growths:
        rows.append((name, format_bytes(get(a)), format_bytes(get(b)), delta(get(a), get(b))))
    rows.append(("time", f"{a.wall_s:.2f} s", f"{b.wall_s:.2f} s", delta(a.wall_s, b.wall_s, lambda v: f"{v:.2f} s")))
    settings: tuple[tuple[str, Callable[[Report], object]], ...] = (
        ("batch", lambda r: r.model.batch_size if r.model else None),
        ("precision policy", lambda r: r.env.mixed_precision_policy),
    )
    for r_name, pick in settings:
        if pick(a) is not None or pick(b) is not None:
            rows.append((r_name, str(pick(a)), str(pick(b)), ""))
    ta = {g.phase: g.bytes for g in a.trace.by_phase} if a.trace else {}
    tb = {g.phase: g.bytes for g in b.trace.by_phase} if b.trace else {}
    compared = ("forward", "backward", "optimizer", "workspace", "input", "weights")
    for phase in [p for p in compared if p in ta or p in tb]:
        x, y = ta.get(phase, 0), tb.get(phase, 0)
        rows.append((f"at peak: {phase}", format_bytes(x), format_bytes(y), delta(x, y)))
    return rows


def compare_text(a: Report, b: Report) -> str:
    rows = _compare_rows(a, b)
    return "\n".join(f"{name:<22} {x:>14} {y:>14}  {d}" for name, x, y, d in rows)


def compare_html(a: Report, b: Report) -> str:
    body = "".join(
        f"<tr><th>{escape(name)}</th><td class='num'>{escape(x)}</td><td class='num'>{escape(y)}</td>"
        f"<td class='num'>{escape(d)}</td></tr>"
        for name, x, y, d in _compare_rows(a, b)
    )
    return (
        f"<div class='tfmem-report'><style>{_STYLE}</style><h4>tfmem: A vs B</h4><table>"
        f"<tr><th></th><th class='num'>A</th><th class='num'>B</th><th class='num'>B - A</th></tr>{body}"
        "</table></div>"
    )


# the view's names that callers have always found here
__all__ = [
    "BUDGET_SOURCES",
    "ReportView",
    "guard_detail",
    "mime_bundle",
    "render_html",
    "render_text",
    "summary_items",
    "trace_notes",
    "verdict",
    "verdict_level",
    "view_of",
    "watch_html",
    "watch_line",
    "compare_html",
    "compare_text",
    "whatif_html",
    "whatif_summary",
    "before_after_html",
    "left_text",
]
