"""The interactive panel built from reports of real cells, and what a real kernel displays."""

from __future__ import annotations

import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tfmem_magic.core.report import MIME_TYPE, Report
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.show import figures
from tfmem_magic.show.panel import build_panel

PNG = b"\x89PNG\r\n\x1a\n"

FIT_CELL = """%%tfmem --as rep --label '<i>fit</i>'
import keras, numpy as np
m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(128, activation="relu", name="wide"),
                      keras.layers.Dense(4, name="head")], name="small")
m.compile("adam", "sparse_categorical_crossentropy")
m.fit(np.random.rand(1024, 32).astype("float32"), np.random.randint(0, 4, 1024), batch_size=64, verbose=0);
"""


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


@pytest.fixture
def fit_report(shell) -> Report:
    assert shell.run_cell(FIT_CELL).success
    return shell.user_ns["rep"]


def test_header_shows_the_reports_numbers_escaped(fit_report):
    panel = build_panel(fit_report)
    header = panel.children[0].value
    cpu = fit_report.tf["CPU:0"]
    for number in (
        format_bytes(cpu.peak_bytes),
        format_bytes(cpu.peak_bytes - cpu.baseline_bytes),
        format_bytes(fit_report.rss.peak_bytes),
        format_bytes(fit_report.env.budget_bytes),
    ):
        assert number in header
    assert "&lt;i&gt;fit&lt;/i&gt;" in header and "<i>fit</i>" not in header
    assert "tfmem-panel" in panel._dom_classes


def test_tabs_breakdown_toggle_and_charts(fit_report):
    import ipywidgets as widgets

    panel = build_panel(fit_report)
    tabs = panel.children[1]
    assert tabs.titles[0] == "Breakdown at peak" and tabs.titles[2].startswith("Findings (")
    breakdown = tabs.children[0]
    chooser = next(w for w in walk(breakdown) if isinstance(w, widgets.ToggleButtons))
    chart = next(w for w in walk(breakdown) if isinstance(w, widgets.Image))
    by_phase = bytes(chart.value)
    assert by_phase.startswith(PNG)
    chooser.value = "layer"
    assert bytes(chart.value).startswith(PNG) and bytes(chart.value) != by_phase
    tensors = next(w for w in walk(breakdown) if isinstance(w, widgets.HTML) and "Largest tensors" in w.value)
    assert "wide" in tensors.value
    timeline = tabs.children[1]
    assert isinstance(timeline, widgets.Image) and bytes(timeline.value).startswith(PNG)


def test_panel_escapes_user_strings():
    """<script> and an <img onerror> in a label, a layer name, an op and a note never reach the DOM as markup."""
    import ipywidgets as widgets

    from tfmem_magic.core.report import LayerInfo, LiveGroup, ModelInfo, TraceInfo

    evil = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    report = Report(
        label=evil,
        notes=[evil],
        model=ModelInfo(name=evil, layers=[LayerInfo(name=evil, type=evil)]),
        trace=TraceInfo(
            events=1,
            peak_live_bytes=2**20,
            at_peak=[LiveGroup(op=evil, layer=evil, phase="forward", bytes=2**20)],
            by_layer=[LiveGroup(layer=evil, bytes=2**20)],
            note=evil,
        ),
    )
    html = " ".join(w.value for w in walk(build_panel(report)) if isinstance(w, widgets.HTML))
    assert "<script>" not in html and "<img src=x" not in html
    assert html.count("&lt;script&gt;") >= 5


def test_timeline_shades_what_was_not_traced(fit_report):
    assert not fit_report.trace.complete and fit_report.trace.windows  # a fit traced for its first steps only
    start, end = fit_report.trace.windows[0]
    assert 0 <= start < end <= fit_report.wall_s


def test_empty_states_say_why(shell):
    assert shell.run_cell("%%tfmem --quick --as q\nx = 1").success
    panel = build_panel(shell.user_ns["q"])
    breakdown = panel.children[1].children[0]
    assert "Quick mode records no trace" in breakdown.value or "TensorFlow did not run" in breakdown.value
    assert "What-if needs a Keras model" in panel.children[1].children[3].value
    assert "No fix to suggest" in panel.children[1].children[4].value


def test_whatif_sliders_repredict_and_calibrate(fit_report):
    from tfmem_magic.advise import prediction

    panel = build_panel(fit_report)
    tabs = panel.children[1]
    assert tabs.titles[3] == "What if"
    controls = {w.description: w for w in walk(tabs.children[3]) if getattr(w, "description", None)}
    result = next(w for w in walk(tabs.children[3]) if "Predicted TF peak" in str(getattr(w, "value", "")))
    as_run = prediction.predict(fit_report)
    assert format_bytes(as_run.peak_bytes) in result.value and "±30%" in result.value
    controls["Batch size"].value = 512  # moving a slider re-predicts at once, without running anything
    at_512 = prediction.predict(fit_report, batch_size=512)
    assert format_bytes(at_512.peak_bytes) in result.value and "batch 512" in result.value
    assert "mixed_float16" not in str(controls["Precision"].options)  # never offered on CPU
    controls["Replicas"].value = 4  # one of 4 data-parallel replicas sharing the batch of 512
    per_replica = prediction.predict(fit_report, batch_size=512, replicas=4)
    assert format_bytes(per_replica.peak_bytes) in result.value and "per replica of 4" in result.value
    controls["Replicas"].value = 1
    controls["Precision"].value = "mixed_bfloat16"
    assert "mixed_bfloat16" in result.value
    controls["Calibrate (probe runs)"].click()  # a clone of the model trains at three batch sizes
    assert "measured basis" in result.value and "±30%" in result.value  # bf16: the probes ran in float32
    controls["Precision"].value = "float32"  # what the probes ran: the step replay predicts the batch
    # the replay's band: ±15%, its low side wider where the analytic basis predicts lower ("+15%/−33%")
    assert ("±15%" in result.value or "+15%/−" in result.value) and "replay basis" in result.value
    assert prediction.is_calibrated(fit_report)


def test_a_saved_report_shows_the_whatif_the_live_panel_showed(fit_report, tmp_path):
    """The what-if's basis, calibration included, is part of the report: a report saved after calibrating and loaded
    in another kernel (or by nbconvert, or the JupyterLab renderer) predicts what the live panel predicts."""
    from tfmem_magic.advise import calibration, prediction
    from tfmem_magic.show.render import mime_bundle, render_text, whatif_html

    calibration.measured_basis(fit_report)  # what the panel's Calibrate button runs
    loaded = Report.load(fit_report.save(tmp_path / "report.json"))
    assert loaded.whatif_basis is not None and loaded.whatif_basis.name == "replay"
    assert loaded.whatif_basis.replay is not None and loaded.whatif_basis.replay.peaks
    assert loaded.whatif_basis == fit_report.whatif_basis and loaded.prediction == fit_report.prediction
    assert prediction.is_calibrated(loaded)

    def moved(report: Report) -> tuple[str, str]:  # the what-if tab after the same moves of its controls
        tab = build_panel(report).children[1].children[3]
        controls = {w.description: w for w in walk(tab) if getattr(w, "description", None)}
        result = next(w for w in walk(tab) if "Predicted TF peak" in str(getattr(w, "value", "")))
        as_run = result.value
        controls["Batch size"].value = 512
        controls["Optimizer"].value = "sgd"
        assert "Calibrated" in controls and controls["Calibrated"].disabled  # no second calibration
        return as_run, result.value

    live, reloaded = moved(fit_report), moved(loaded)
    assert live == reloaded and ("±15%" in live[0] or "+15%/−" in live[0]) and "batch 512" in live[1]
    assert whatif_html(loaded) == whatif_html(fit_report) and "replay basis" in whatif_html(loaded)
    assert render_text(loaded) == render_text(fit_report)
    assert mime_bundle(loaded)["text/html"] == mime_bundle(fit_report)["text/html"]


def test_static_report_has_the_whatif_table(fit_report):
    from tfmem_magic.show.render import render_html, render_text

    html = render_html(fit_report)
    assert "<h4>What if</h4>" in html and "batch 128" in html and "mixed_bfloat16 policy" in html
    assert "SGD with momentum" in html  # the cell used Adam
    assert "What if   batch 128: TF peak" in render_text(fit_report)


def test_figures_are_png_and_none_without_data(fit_report):
    assert figures.timeline_png(fit_report).startswith(PNG)
    assert figures.breakdown_png(fit_report.trace.by_op, "op").startswith(PNG)
    assert figures.breakdown_png([], "op") is None
    empty = Report()
    assert figures.timeline_png(empty) is None


@pytest.mark.slow
def test_kernel_displays_static_twin_then_live_panel(tmp_path):
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
            # long enough for the sampler's timeline (a cell of a few sampling periods draws none)
            nbformat.v4.new_code_cell(
                "%%tfmem\nimport time, tensorflow as tf\nx = tf.ones((128, 128))\ntime.sleep(0.5)"
            ),
            nbformat.v4.new_code_cell("%%tfmem --no-panel\ny = 1"),
        ]
    )
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable
    client.execute()
    static, live = [o for o in nb.cells[1].outputs if o.output_type == "display_data"]
    assert {"text/html", "text/plain", MIME_TYPE} <= set(static.data)
    html = static.data["text/html"]
    assert "<img" in html  # the timeline travels with the static twin
    report = Report.from_dict(static.data[MIME_TYPE])
    cpu = report.tf["CPU:0"]
    for number in (
        cpu.peak_bytes,
        cpu.peak_bytes - cpu.baseline_bytes,
        report.rss.peak_bytes,
        report.trace.peak_live_bytes,
    ):
        assert format_bytes(number) in html  # the HTML shows the report's own numbers
    # nbconvert's HTML of the executed notebook shows the static report
    from nbconvert import HTMLExporter

    page, _ = HTMLExporter().from_notebook_node(nb)
    assert "tfmem report" in page and "data:image/png;base64," in page
    assert "application/vnd.jupyter.widget-view+json" in live.data
    only = [o for o in nb.cells[2].outputs if o.output_type == "display_data"]
    assert len(only) == 1 and MIME_TYPE in only[0].data  # --no-panel: the static report alone
