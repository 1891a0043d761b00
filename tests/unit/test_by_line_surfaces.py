"""The by-line view (TraceInfo.by_line, docs/lines.md) on the surfaces besides the text report: the static HTML twin,
the panel's "by line" button and the JupyterLab renderer's view block, on reports built from data. A line's code is
the user's text: it is escaped everywhere. A report without a by-line view (quick mode, a saved trace, an older
report) shows none of it, and its panel has no "by line" button. The lines of what the cell left live
(TraceInfo.held_at_end_by_line) are in the "Held after" view of every surface, in the same words, where the trace
covered the whole cell."""

from __future__ import annotations

from html import escape

import ipywidgets as widgets

from tfmem_magic.core.report import (
    MIME_TYPE,
    DeviceMemory,
    EnvInfo,
    HeldInfo,
    Holder,
    LineGroup,
    LineTensor,
    LiveGroup,
    Report,
    RssInfo,
    TraceInfo,
)
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.show.panel import breakdown_tab, held_tab
from tfmem_magic.show.render import by_line_html, mime_bundle, render_html, render_text
from tfmem_magic.show.view import by_line_rows, held_view

MiB = 2**20
EVIL = "x = '<script>alert(1)</script>' & y"
NOTE = "20.0 MiB of the 24.0 MiB traced at the peak named by a line of code; not by a line: eager ops 4 MiB"


def traced(by_line: list[LineGroup] | None = None) -> Report:
    groups = (
        [
            LineGroup(
                label="In [2] line 5",
                code="return keras.ops.matmul(x, self.w)",
                bytes=12 * MiB,
                forward_bytes=8 * MiB,
                backward_bytes=4 * MiB,
                count=3,
                layer="wide",
                made_by="In [3] line 1",
                made_by_code="model = keras.Sequential([Wide(), <Dense>])",
                tensors=[LineTensor(8 * MiB, "[256,8192]", "float32", "MatMul", "forward")],
            ),
            LineGroup(
                label="In [3] line 1",
                code=EVIL,
                bytes=8 * MiB,
                forward_bytes=8 * MiB,
                count=1,
                layer="dense",
                made_by="In [3] line 1",
                tensors=[LineTensor(8 * MiB, "[256,8192]", "float32", "BiasAdd", "forward")],
            ),
            LineGroup(label="eager ops", kind="eager", bytes=4 * MiB, count=2),
        ]
        if by_line is None
        else by_line
    )
    return Report(
        label="fit",
        mode="trace",
        wall_s=1.0,
        env=EnvInfo(budget_bytes=16 * 2**30, ram_total_bytes=16 * 2**30),
        rss=RssInfo(2**30, 2 * 2**30, 2**30, "hwm", []),
        tf={"CPU:0": DeviceMemory(0, 24 * MiB, 0)},
        trace=TraceInfo(
            events=10,
            peak_live_bytes=24 * MiB,
            peak_time_s=0.5,
            by_phase=[LiveGroup(phase="forward", bytes=24 * MiB)],
            by_layer=[LiveGroup(layer="wide", bytes=12 * MiB), LiveGroup(layer="dense", bytes=8 * MiB)],
            by_op=[LiveGroup(op="MatMul", bytes=12 * MiB)],
            by_line=groups,
            by_line_named_bytes=20 * MiB if groups else 0,
            by_line_note=NOTE if groups else None,
        ),
    )


def test_rows_word_each_line_as_the_text_report_does():
    rows = by_line_rows(traced().trace)
    assert [r.label for r in rows] == ["In [2] line 5", "In [3] line 1"]  # lines only: eager ops are in the note
    wide, dense = rows
    assert wide.bytes == format_bytes(12 * MiB) and wide.share == 0.5
    assert wide.split == f"forward {format_bytes(8 * MiB)}, backward {format_bytes(4 * MiB)}"
    assert wide.largest == f"largest of 3 tensors: float32[256,8192] MatMul {format_bytes(8 * MiB)}"
    assert wide.made_by == "layer wide made at In [3] line 1"
    assert wide.made_by_code == "model = keras.Sequential([Wide(), <Dense>])"
    assert dense.split == "" and dense.largest == f"largest: float32[256,8192] BiasAdd {format_bytes(8 * MiB)}"
    assert (dense.made_by, dense.made_by_code) == ("layer dense: made on this line", "")


def test_the_static_report_shows_each_line_with_its_code_escaped():
    html = render_html(traced(), timeline=b"")
    assert "<table class='tfmem-by-line'>" in html
    assert "<td>In [2] line 5</td><td><code>return keras.ops.matmul(x, self.w)</code></td>" in html
    assert f"forward {format_bytes(8 * MiB)}, backward {format_bytes(4 * MiB)}" in html
    assert "largest of 3 tensors: float32[256,8192] MatMul" in html
    assert "layer wide made at In [3] line 1: <code>model = keras.Sequential([Wide(), &lt;Dense&gt;])</code>" in html
    assert "layer dense: made on this line" in html
    assert "<script>" not in html and "&lt;Dense&gt;" in html
    assert "<code>x = &#x27;&lt;script&gt;alert(1)&lt;/script&gt;&#x27; &amp; y</code>" in html
    assert NOTE in html
    assert "eager ops" not in html.split("tfmem-by-line'>")[1].split("</table>")[0]  # not a row: in the note


def test_a_report_without_a_by_line_view_shows_none():
    """Quick mode has no trace; a saved trace or an older report has a trace without by_line."""
    report = traced(by_line=[])
    assert by_line_html(report.trace) == "" and "class='tfmem-by-line" not in render_html(report, timeline=b"")
    peak = mime_bundle(report, timeline=b"")[MIME_TYPE]["view"]["peak"]
    assert "by_line" not in peak and "by_line_note" not in peak
    chooser = next(w for w in breakdown_tab(report).children if isinstance(w, widgets.ToggleButtons))
    assert [value for _, value in chooser.options] == ["phase", "layer", "op"]


def test_where_no_line_made_anything_the_note_says_what_did():
    report = traced(by_line=[LineGroup(label="eager ops", kind="eager", bytes=4 * MiB)])
    report.trace.by_line_note = "0 B of the 4 MiB traced at the peak named by a line of code; not by a line: eager"
    html = by_line_html(report.trace)
    assert "No line of code made what was live at the peak." in html and "not by a line: eager" in html
    assert "<table" not in html


def test_the_panels_by_line_button_shows_the_lines_in_place_of_the_chart():
    tab = breakdown_tab(traced())
    chooser = next(w for w in tab.children if isinstance(w, widgets.ToggleButtons))
    chart = next(w for w in tab.children if isinstance(w, widgets.Image))
    lines = next(w for w in tab.children if isinstance(w, widgets.HTML) and "tfmem-by-line" in w.value)
    assert [label for label, _ in chooser.options] == ["by phase", "by layer", "by op", "by line"]
    assert lines.layout.display == "none" and chart.layout.display != "none"
    assert "<code>return keras.ops.matmul(x, self.w)</code>" in lines.value and NOTE in lines.value
    assert "<script>" not in lines.value and "&lt;script&gt;" in lines.value
    chooser.value = "line"
    assert chart.layout.display == "none" and lines.layout.display != "none"
    chooser.value = "layer"
    assert lines.layout.display == "none" and chart.layout.display != "none"
    assert bytes(chart.value).startswith(b"\x89PNG")


def test_the_lab_view_block_carries_the_rows_in_words():
    peak = mime_bundle(traced(), timeline=b"")[MIME_TYPE]["view"]["peak"]
    assert [row["label"] for row in peak["by_line"]] == ["In [2] line 5", "In [3] line 1"]
    assert peak["by_line"][1]["code"] == EVIL  # raw in the JSON: the renderer escapes it
    assert set(peak["by_line"][0]) == {
        "label",
        "code",
        "bytes",
        "share",
        "split",
        "largest",
        "made_by",
        "made_by_code",
    }
    assert peak["by_line_note"] == NOTE


# what a cell left live, by line: a list a name keeps, a tensor made on a line with hostile text, and an eager op's
LEFT = [
    LineGroup(
        label="In [4] line 2",
        code="keep.append(tf.random.normal([1024, 1024]))",
        bytes=4 * MiB,
        forward_bytes=0,
        count=1,
        tensors=[LineTensor(4 * MiB, "[1024,1024]", "float32", "RandomStandardNormal", "other")],
    ),
    LineGroup(label="In [4] line 3", code=EVIL, bytes=2 * MiB, count=2),
    LineGroup(label="eager ops", kind="eager", bytes=2 * MiB, count=1),
]
LEFT_NOTE = (
    f"{format_bytes(6 * MiB)} of the {format_bytes(8 * MiB)} the cell left live named by a line of code; not by a "
    f"line: eager ops {format_bytes(2 * MiB)} (the trace keeps no stack for an eager op)."
)
LEFT_HEAD = "what the cell left live at its end, by the line of code that made it"


def left_live(groups: list[LineGroup] | None = None, complete: bool = True) -> Report:
    """A traced cell that left 8 MiB live, 6 MiB of it made by two lines, a list holding it."""
    report = traced()
    report.trace.held_at_end_by_line = LEFT if groups is None else groups
    report.trace.held_at_end_bytes = 8 * MiB
    report.trace.complete = complete
    report.held = HeldInfo(left_bytes=8 * MiB, holders=[Holder("keep", "list", 8 * MiB, new_bytes=8 * MiB, tensors=3)])
    return report


def test_rows_of_what_the_cell_left_live_are_worded_as_the_peaks():
    held = held_view(left_live())
    assert held is not None and held.by_line is not None
    assert [r.label for r in held.by_line] == ["In [4] line 2", "In [4] line 3"]  # eager ops: in the note
    made = held.by_line[0]
    assert made.bytes == format_bytes(4 * MiB) and made.share == 0.5  # of the 8 MiB left live, not of the peak
    assert made.largest == f"largest: float32[1024,1024] RandomStandardNormal {format_bytes(4 * MiB)}"
    assert held.by_line == by_line_rows(left_live().trace, end=True)
    assert held.by_line_note == LEFT_NOTE


def test_the_text_report_shows_what_the_cell_left_live_by_line():
    text = render_text(left_live())
    held = text.split("\nHeld      ")[1]
    assert held.startswith(f"keep (list) {format_bytes(8 * MiB)}\nHeld by line {LEFT_HEAD}\n")
    assert f"  {format_bytes(4 * MiB):>10}  In [4] line 2  keep.append(tf.random.normal([1024, 1024]))" in held
    assert f"largest: float32[1024,1024] RandomStandardNormal {format_bytes(4 * MiB)}" in held
    assert f"In [4] line 3  {EVIL}" in held and LEFT_NOTE in held
    assert text.count("By line   what was live at the peak") == 1  # the peak's block stays where it was


def test_the_static_reports_held_after_section_shows_the_lines_escaped():
    html = render_html(left_live(), timeline=b"")
    section = html.split("<h4>Held after the cell</h4>")[1]
    assert f"<b>By line</b>: {LEFT_HEAD}<table class='tfmem-by-line'>" in section
    assert "<td>In [4] line 2</td><td><code>keep.append(tf.random.normal([1024, 1024]))</code></td>" in section
    assert "<code>x = &#x27;&lt;script&gt;alert(1)&lt;/script&gt;&#x27; &amp; y</code>" in section
    assert escape(LEFT_NOTE) in section and "<script>" not in html


def test_the_panels_held_after_tab_shows_the_lines_escaped():
    value = held_tab(left_live()).value
    assert (
        f"<b>By line</b>: {LEFT_HEAD}" in value and "<code>keep.append(tf.random.normal([1024, 1024]))</code>" in value
    )
    assert "&lt;script&gt;" in value and "<script>" not in value and escape(LEFT_NOTE) in value


def test_the_lab_view_block_carries_the_held_lines_in_words():
    held = mime_bundle(left_live(), timeline=b"")[MIME_TYPE]["view"]["held"]
    assert [row["label"] for row in held["by_line"]] == ["In [4] line 2", "In [4] line 3"]
    assert held["by_line"][1]["code"] == EVIL  # raw in the JSON: the renderer escapes it
    assert held["by_line"][0]["bytes"] == format_bytes(4 * MiB) and held["by_line_note"] == LEFT_NOTE


def test_a_cell_that_left_nothing_by_line_shows_no_held_lines():
    """A report without held_at_end_by_line (quick mode, no lines resolved, an older report) and one whose trace
    stopped before the cell ended (its end is a step's temporaries, not what the cell left) show none of it."""
    for report in (left_live(groups=[]), left_live(complete=False)):
        held = held_view(report)
        assert held is not None and held.by_line is None and held.by_line_note is None
        assert "Held by line" not in render_text(report)
        assert LEFT_HEAD not in render_html(report, timeline=b"") and LEFT_HEAD not in held_tab(report).value
        view = mime_bundle(report, timeline=b"")[MIME_TYPE]["view"]["held"]
        assert "by_line" not in view and "by_line_note" not in view
        assert "keep" in render_text(report)  # the holders stay


def test_where_no_line_made_what_the_cell_left_the_note_says_what_did():
    report = left_live(groups=[LineGroup(label="eager ops", kind="eager", bytes=2 * MiB)])
    report.held = HeldInfo(left_bytes=2 * MiB)  # no name holds it
    html = render_html(report, timeline=b"")
    assert "No line of code made what the cell left live at its end." in html
    assert f"0 B of the {format_bytes(2 * MiB)} the cell left live named by a line of code" in html
    assert "Held by line" in render_text(report) and "Held      " not in render_text(report)
    assert mime_bundle(report, timeline=b"")[MIME_TYPE]["view"]["held"]["by_line"] == []
