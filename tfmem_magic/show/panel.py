"""The interactive panel below a %%tfmem cell (ipywidgets 8). It only renders: every number comes from the Report.

The panel is displayed right after the static report (a separate output), because JupyterLab shows "Error
displaying widget: model not found" instead of falling back to another MIME type when a notebook is reopened
without its kernel. While the live panel is mounted, a CSS rule it carries hides that static twin; reopened
notebooks, nbconvert and GitHub show the twin.
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from tfmem_magic.core.report import Fix, LiveGroup, Report
from tfmem_magic.core.session import SESSION, WHOLE_REPORTS
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.show import figures, frontend
from tfmem_magic.show.render import before_after_html, by_line_html, held_html
from tfmem_magic.show.view import BUDGET_SOURCES, ReportView, trace_notes, view_of
from tfmem_magic.show.whatif_panel import whatif_tab

if TYPE_CHECKING:
    from tfmem_magic.analyze.cluster import ClusterView

BREAKDOWN_KEYS = ("phase", "layer", "op")  # the charted groups; "by line" (a table) follows where a report has it

PANEL_CSS = """<style>
/* the static report is the output just before the live panel: hide it while the panel is there */
.jp-OutputArea-child:has(+ .jp-OutputArea-child .tfmem-panel) .tfmem-report { display: none; }
.tfmem-panel { max-width: 980px; }
.tfmem-head { font-family: var(--jp-ui-font-family, system-ui, sans-serif); }
.tfmem-head .tfmem-title { font-size: 14px; font-weight: 600; margin: 2px 0 4px 0; }
.tfmem-head .tfmem-verdict { font-size: 13px; font-weight: 600; margin-bottom: 8px; }
.tfmem-head .tfmem-ok { color: #2e7d32; } .tfmem-head .tfmem-warn { color: #b26a00; }
.tfmem-head .tfmem-bad { color: #c62828; }
.tfmem-cards { display: flex; gap: 10px; flex-wrap: wrap; margin-bottom: 6px; }
.tfmem-card { border: 1px solid rgba(128,128,128,.35); border-radius: 6px; padding: 6px 10px;
  flex: 1 1 160px; max-width: 235px; }
.tfmem-card .tfmem-label { font-size: 11px; opacity: .75; }
.tfmem-card .tfmem-value { font-size: 18px; font-weight: 600; font-variant-numeric: tabular-nums; }
.tfmem-card .tfmem-detail { font-size: 11px; opacity: .75; line-height: 1.3; }
.tfmem-panel table { border-collapse: collapse; font-size: 12px; }
.tfmem-panel td, .tfmem-panel th { padding: 2px 8px; text-align: left; border-bottom: 1px solid rgba(128,128,128,.2); }
.tfmem-panel td.num, .tfmem-panel th.num { text-align: right; font-variant-numeric: tabular-nums; }
.tfmem-panel .tfmem-empty { opacity: .75; font-style: italic; padding: 6px 0; }
.tfmem-panel .tfmem-sev-critical { color: #c62828; } .tfmem-panel .tfmem-sev-warn { color: #b26a00; }
.tfmem-panel .tfmem-muted { opacity: .7; }
.tfmem-panel .tfmem-bar { display: inline-block; height: 9px; background: #5b8def; border-radius: 2px;
  vertical-align: middle; }
.tfmem-panel .tfmem-by-line code { font-family: var(--jp-code-font-family, monospace); white-space: pre-wrap; }
.tfmem-panel .tfmem-line-detail td { border-bottom: none; }
.tfmem-panel pre { font-size: 12px; padding: 6px; border: 1px solid rgba(128,128,128,.25); border-radius: 4px;
  white-space: pre-wrap; }
</style>"""


def header_html(report: Report, view: ReportView | None = None) -> str:
    view = view or view_of(report)
    cards = "".join(
        f"<div class='tfmem-card'><div class='tfmem-label'>{escape(label)}</div>"
        f"<div class='tfmem-value'>{escape(value)}</div><div class='tfmem-detail'>{escape(detail)}</div></div>"
        for label, value, detail in view.summary
    )
    title = "tfmem" + (f" · {escape(report.label)}" if report.label else "")
    return (
        f"<div class='tfmem-head'><div class='tfmem-title'>{title}</div>"
        f"<div class='tfmem-verdict tfmem-{view.level}'>{escape(view.verdict)}</div>"
        f"<div class='tfmem-cards'>{cards}</div></div>"
    )


def _empty(text: str) -> widgets.HTML:
    return widgets.HTML(f"<div class='tfmem-empty'>{escape(text)}</div>")


def _why_no_trace(report: Report) -> str:
    if report.env.tensorflow is None:
        return "TensorFlow did not run in this cell: only process memory was measured (Timeline tab)."
    if report.mode == "quick":
        return (
            "Quick mode records no trace, so nothing is broken down by op, layer or phase. Run the cell with "
            "%%tfmem (trace is the default) to see what was live at the peak."
        )
    return "The trace recorded no TensorFlow allocation in this cell."


def _top_tensors(groups: list[LiveGroup]) -> str:
    rows = "".join(
        f"<tr><td>{escape(g.op or '')}</td><td>{escape(g.layer or '')}</td><td>{escape(g.phase or '')}</td>"
        f"<td>{escape(g.dtype or '')}</td><td>{escape(g.shape or '')}</td>"
        f"<td class='num'>{escape(format_bytes(g.bytes))}</td><td class='num'>{g.count}</td></tr>"
        for g in groups[:12]
    )
    return (
        "<table><tr><th>op</th><th>layer</th><th>phase</th><th>dtype</th><th>shape</th>"
        f"<th class='num'>bytes</th><th class='num'>n</th></tr>{rows}</table>"
    )


def breakdown_tab(report: Report) -> widgets.Widget:
    trace = report.trace
    if trace is None or not trace.events:
        return _empty(_why_no_trace(report))
    groups = {"phase": trace.by_phase, "layer": trace.by_layer, "op": trace.by_op}
    images: dict[str, bytes | None] = {}

    def image_for(key: str) -> bytes:
        if key not in images:
            images[key] = figures.breakdown_png(groups[key], key)
        return images[key] or b""

    options = [(f"by {key}", key) for key in BREAKDOWN_KEYS]
    if trace.by_line:  # a report without a by-line view (quick mode, a saved trace, an older report) has no button
        options.append(("by line", "line"))
    chooser = widgets.ToggleButtons(options=options, value="phase", style={"button_width": "90px"})
    chart = widgets.Image(value=image_for("phase"), format="png", layout=widgets.Layout(max_width="640px"))
    # "by line" shows a table in place of the chart: each line's code, bytes, split, largest tensor and maker
    by_line = widgets.HTML(by_line_html(trace), layout=widgets.Layout(display="none"))

    def choose(change: dict[str, Any]) -> None:
        line = change["new"] == "line"
        chart.layout.display = "none" if line else None
        by_line.layout.display = None if line else "none"
        if not line:
            chart.value = image_for(change["new"])

    chooser.observe(choose, names="value")
    lines = [
        f"<b>{escape(format_bytes(trace.peak_live_bytes))}</b> live at t = {trace.peak_time_s:.3f} s "
        f"({trace.events:,} memory events traced)"
    ]
    if trace.requested_at_peak_bytes:
        ratio = trace.allocated_at_peak_bytes / trace.requested_at_peak_bytes
        if ratio >= 1.1:
            lines.append(
                f"The allocator handed out {escape(format_bytes(trace.allocated_at_peak_bytes))} for "
                f"{escape(format_bytes(trace.requested_at_peak_bytes))} requested (×{ratio:.2f}: "
                "rounding and fragmentation)."
            )
    for note in trace_notes(trace):
        lines.append(f"<span class='tfmem-empty'>{escape(note)}</span>")
    info = widgets.HTML("<br>".join(lines))
    tensors = widgets.HTML("<b>Largest tensors at the peak</b>" + _top_tensors(trace.at_peak))
    return widgets.VBox([info, chooser, chart, by_line, tensors])


def timeline_tab(report: Report, png: bytes | None = None) -> widgets.Widget:
    png = png if png is not None else figures.timeline_png(report)
    if not png:
        return _empty(
            f"The cell ran {report.wall_s:.2f} s, too short for a timeline (fewer than "
            f"{figures.MIN_POINTS} samples); the peaks above are exact."
        )
    return widgets.Image(value=png, format="png", layout=widgets.Layout(max_width="900px"))


def findings_tab(report: Report) -> widgets.Widget:
    if not report.findings:
        if report.mode == "quick" or report.trace is None:
            return _empty("Nothing looked wrong in what was measured. " + _why_no_trace(report))
        return _empty("Nothing looked wrong: no finding fired for this cell.")
    items = "".join(
        f"<li><b class='tfmem-sev-{escape(f.severity)}'>{escape(f.title)}</b> [{escape(f.severity)}]<br>"
        f"{escape(f.evidence)}</li>"
        for f in report.findings
    )
    return widgets.HTML(f"<ul>{items}</ul>")


def fixes_tab(report: Report, cell_id: str | None = None) -> widgets.Widget:
    if not report.fixes:
        return _empty("No fix to suggest for this cell.")
    return widgets.VBox([fix_widget(report, i, fix, cell_id) for i, fix in enumerate(report.fixes, 1)])


def fix_widget(report: Report, index: int, fix: Fix, cell_id: str | None) -> widgets.Widget:
    """One fix: what and why, the predicted peak, the code, and a button that inserts the code as a new cell."""
    fallback = f"%tfmem fix {index} --report {report.number}"
    predicted = (
        f"<div>Predicted TF peak after it: <b>{escape(format_bytes(fix.predicted_peak_bytes))}</b></div>"
        if fix.predicted_peak_bytes is not None
        else ""
    )
    restart = (
        "<div class='tfmem-sev-warn'>Needs a kernel restart: goes at the top of the notebook.</div>"
        if fix.needs_restart
        else ""
    )
    text = widgets.HTML(
        f"<b>{escape(fix.title)}</b> <code>{escape(fix.id)}</code><div>{escape(fix.why)}</div>"
        f"{predicted}{restart}<pre>{escape(fix.code)}</pre>"
    )
    where = "at the top of the notebook" if fix.placement == "top" else "below this cell"
    button = widgets.Button(
        description=f"Insert {where}",
        icon="plus",
        button_style="success",
        tooltip="Adds the code above as a new cell and selects it; it does not run it",
        layout=widgets.Layout(width="auto"),
    )
    status = widgets.HTML()

    def replied(state: str, data: dict[str, Any]) -> None:
        if state == "inserted":
            status.value = f"<span class='tfmem-ok'>Inserted {escape(where)}: read it, then run it.</span>"
        elif state == "no-answer":  # VS Code, Colab, a headless kernel: the comm went nowhere
            status.value = (
                f"<span class='tfmem-sev-warn'>The front end did not answer (no tfmem extension here?): "
                f"copy the code above, or run <code>{escape(fallback)}</code> to get it as the next "
                "cell.</span>"
            )
            button.disabled = False
        else:
            status.value = (
                f"<span class='tfmem-sev-warn'>This front end has no tfmem extension: copy the code "
                f"above, or run <code>{escape(fallback)}</code> to get it as the next cell.</span>"
            )
            button.disabled = False

    def clicked(_: object) -> None:  # the button
        button.disabled = True
        status.value = (
            f"Sent to the notebook… (nothing appears? run <code>{escape(fallback)}</code>, or copy the code above)"
        )
        if not frontend.insert_cell(fix.code, cell_id, fix.placement, replied):
            replied("no-extension", {})

    button.on_click(clicked)
    return widgets.VBox(
        [text, widgets.HBox([button, status])],
        layout=widgets.Layout(border_bottom="1px solid rgba(128,128,128,.25)", padding="4px 0"),
    )


def held_tab(report: Report) -> widgets.Widget:
    """Who holds TensorFlow memory at the cell's end, and the lines of code that made what the cell left live (the
    static twin's "Held after" section)."""
    html = held_html(report)
    if not html:
        return _empty(
            "Nothing measured is held: TensorFlow did not run in this process, or no name reaches its memory."
        )
    return widgets.HTML(html)


def details_tab(report: Report, view: ReportView) -> widgets.Widget:
    env = report.env
    rows = [
        ("TensorFlow", env.tensorflow or "not imported"),
        ("Keras", env.keras_text),
        ("Allocator", f"{env.allocator} ({'sees every allocation' if env.allocator_complete else 'partial'})"),
        ("Devices", ", ".join(env.devices) or "-"),
        *(
            [
                (
                    f"{report.device_budget[0]} budget",
                    f"{format_bytes(report.device_budget[1])} (TensorFlow's allocator limit)",
                )
            ]
            if report.device_budget
            else []
        ),
        (
            "Host budget" if report.device_budget else "Budget",
            f"{format_bytes(env.budget_bytes)} ({BUDGET_SOURCES.get(env.budget_source, env.budget_source)})",
        ),
        ("RAM", f"{format_bytes(env.ram_total_bytes)}, {format_bytes(env.ram_available_bytes)} available"),
        ("Precision policy", env.mixed_precision_policy or "-"),
        ("RSS peak from", "kernel high-water mark (exact)" if report.rss.peak_source == "hwm" else "samples"),
    ]
    html = "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    html += "</table>"
    m = report.model
    if m is not None:
        layer_rows = "".join(
            f"<tr><td>{escape(layer.name)}</td><td>{escape(layer.type)}</td><td class='num'>{layer.params:,}</td>"
            f"<td>{escape(layer.output_shape or '')}</td>"
            f"<td class='num'>{escape(format_bytes(layer.activation_bytes_per_sample))}</td></tr>"
            for layer in m.layers[:30]
        )
        html += (
            f"<p><b>Model {escape(m.name)}</b>: {m.params:,} parameters ({escape(format_bytes(m.param_bytes))}),"
            f" optimizer {escape(m.optimizer_text)} ({m.optimizer_slots} slot(s) per weight, "
            f"{escape(format_bytes(m.optimizer_bytes))}), batch {escape(m.batch_text)}, "
            f"input {escape(m.input_shape or '?')}</p><table><tr><th>layer</th><th>type</th>"
            "<th class='num'>params</th><th>output</th><th class='num'>activations / sample</th></tr>"
            f"{layer_rows}</table>"
        )
    notes = view.notes
    if notes:
        html += "<p>" + "<br>".join(escape(n) for n in notes) + "</p>"
    return widgets.HTML(html)


def build_panel(
    report: Report, timeline: bytes | None = None, cell_id: str | None = None, view: ReportView | None = None
) -> widgets.VBox:
    """Header (verdict and headline numbers) over tabs: breakdown, timeline, findings, what-if, fixes, details.

    `timeline` is the timeline PNG and `view` the report's view when the caller already made them for the static
    twin; `cell_id` is the notebook cell that ran, below which fix cells go.
    """
    view = view or view_of(report)
    header = widgets.HTML(PANEL_CSS + header_html(report, view) + before_after_html(report))
    tabs = widgets.Tab()

    def titles() -> tuple[str, ...]:
        return (
            "Breakdown at peak",
            "Timeline",
            f"Findings ({len(report.findings)})",
            "What if",
            f"Fixes ({len(report.fixes)})",
            "Held after",
            "Details",
        )

    def calibrated() -> None:  # the calibration wrote the fixes (and large-batch's advice) again on its basis
        children = list(tabs.children)
        close_panel(children[2])
        close_panel(children[4])
        children[2], children[4] = findings_tab(report), fixes_tab(report, cell_id)
        tabs.children = tuple(children)
        tabs.titles = titles()

    tabs.children = (
        breakdown_tab(report),
        timeline_tab(report, timeline),
        findings_tab(report),
        whatif_tab(report, view, on_calibrated=calibrated),
        fixes_tab(report, cell_id),
        held_tab(report),
        details_tab(report, view),
    )
    tabs.titles = titles()
    panel = widgets.VBox([header, tabs])
    panel.add_class("tfmem-panel")
    return panel


def keep_live(report: Report, panel: widgets.Widget) -> None:
    """Remember `panel` as `report`'s live panel, and close the panels that are no longer live: the one its cell
    showed before (a re-run replaces a cell's outputs), those of reports that left the history, and all but the
    newest WHOLE_REPORTS (core/session.py). ipywidgets keeps each widget, and its comm, until it is closed: without
    this every panel ever shown stays in the kernel (docs/session.md). A closed panel's cell shows its static report."""
    kept = {r.number for r in SESSION.history}
    for number, (key, old) in list(SESSION.panels.items()):
        if number not in kept or (report.cell_key is not None and key == report.cell_key):
            close_panel(old)
            del SESSION.panels[number]
    SESSION.panels[report.number] = (report.cell_key, panel)
    while len(SESSION.panels) > WHOLE_REPORTS:
        close_panel(SESSION.panels.pop(next(iter(SESSION.panels)))[1])


def close_panel(panel: widgets.Widget) -> None:
    """Close `panel` and every widget it reaches (its children, tabs, layouts and styles are widgets too)."""
    todo, seen = [panel], set()
    while todo:
        widget = todo.pop()
        if id(widget) in seen:
            continue
        seen.add(id(widget))
        for name in widget.keys:
            value = getattr(widget, name, None)
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, widgets.Widget):
                    todo.append(item)
        widget.close()


def cluster_panel(view: ClusterView) -> widgets.VBox:
    """The workers side by side (the static table), and below it one worker's full panel, chosen in a selector
    (the worst worker first)."""
    from tfmem_magic.show.cluster_render import cluster_html

    measured = sorted(view.measured, key=lambda row: row is not view.worst)
    table = widgets.HTML(PANEL_CSS + cluster_html(view))
    if not measured:
        return widgets.VBox([table])
    choice = widgets.Dropdown(
        options=[(f"{row.worker} ({row.device})", i) for i, row in enumerate(measured)], value=0, description="Worker"
    )
    # a measured row has its report (ClusterView.measured), which WorkerRow's type cannot say
    shown = widgets.VBox([build_panel(measured[0].report, figures.timeline_png(measured[0].report))])  # type: ignore[arg-type]

    def pick(change: dict[str, Any]) -> None:
        report = measured[change["new"]].report
        shown.children = [build_panel(report, figures.timeline_png(report))]

    choice.observe(pick, names="value")
    panel = widgets.VBox([table, choice, shown])
    panel.add_class("tfmem-cluster-panel")
    return panel
