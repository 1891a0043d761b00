"""The OOM report names the line of the user's code that made the failing request (docs/lines.md, 'The line of
an OOM'), in a real IPython shell.

A request of 4 TiB fails at once on any machine (the CPU allocator refuses it without touching memory), so no
allocator cap and no fresh process is needed. Each cell runs with its own execution count (store_history=True).
"""

from __future__ import annotations

import pytest

import tfmem_magic
from tfmem_magic.core.report import MIME_TYPE, Report
from tfmem_magic.show.render import mime_bundle, render_html, render_text

pytestmark = pytest.mark.slow

IMPORTS = "import numpy as np, keras, tensorflow as tf"
HUGE = "[2**40]"  # 4 TiB of float32


def run(shell, *cells: str) -> Report:
    """Run the cells as a notebook would; the last one fails with TensorFlow's OOM. Its report."""
    for cell in cells[:-1]:
        result = shell.run_cell(cell, store_history=True)
        assert result.success, result.error_in_exec or result.error_before_exec
    result = shell.run_cell(cells[-1], store_history=True)
    assert type(result.error_in_exec).__name__ == "ResourceExhaustedError", result.error_in_exec
    report = tfmem_magic.last_report()
    assert report is not None and report.status == "oom" and report.error is not None
    return report


def surfaces_name(report: Report, label: str, code: str) -> None:
    """The JSON, the text report, the static HTML, the renderer's view block and the OOM finding name the line."""
    as_json = Report.from_dict(report.to_dict())
    assert as_json.error is not None and as_json.error.site == report.error.site
    text = render_text(report)
    assert label in text and code in text, text
    html = render_html(report)
    assert "Failed at" in html and label in html, html
    view = mime_bundle(report)[MIME_TYPE]["view"]  # the JupyterLab renderer's words
    assert label in view["error_site"] and code in view["error_site"], view
    oom = next(f for f in report.findings if f.id == "oom")
    assert label in oom.evidence and code in oom.evidence, oom.evidence


def test_an_eager_ops_oom_names_the_cells_line(shell):
    report = run(shell, IMPORTS, f"%%tfmem --no-panel --quick\nsmall = tf.ones([4])\nx = tf.random.normal({HUGE})\n")
    site = report.error.site
    assert report.error.request is not None and report.error.request["op"] == "RandomStandardNormal"
    assert site is not None and site.via == "traceback", site
    assert site.code == f"x = tf.random.normal({HUGE})"
    # the line as the notebook shows the cell: its third, below the magic's line (IPython runs the body as a cell
    # of the next number, `In [3]` line 2, in its own traceback)
    assert site.label == "In [2] line 3", site
    surfaces_name(report, site.label, site.code)


def test_a_custom_layers_oom_in_fit_names_its_call_line(shell):
    layer = f"""class Huge(keras.layers.Layer):
    def call(self, x):
        noise = tf.random.normal({HUGE})
        return x + noise[:1]
"""
    report = run(
        shell,
        IMPORTS,
        layer,
        'model = keras.Sequential([keras.Input((4,)), Huge(), keras.layers.Dense(1)])\nmodel.compile("sgd", "mse")',
        '%%tfmem --no-panel\nmodel.fit(np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32"), verbose=0)\n',
    )
    site = report.error.site
    assert report.error.request is not None and "/" in report.error.request["op"], report.error.request
    assert report.error.request["function"].startswith("__inference_")
    assert site is not None and site.via == "graph node", site
    assert site.label == "In [2] line 3" and site.code == f"noise = tf.random.normal({HUGE})", site
    assert (site.layer or "").startswith("huge") and site.made_by == "In [3] line 1", site
    surfaces_name(report, site.label, site.code)
    # traced: the trace up to the failure is grouped by line too, and the finding names the line holding the most
    assert report.trace is not None and report.trace.by_line
    held = next((g for g in report.trace.by_line if g.kind == "line"), None)
    oom = next(f for f in report.findings if f.id == "oom")
    assert held is None or f"holding the most then: {held.label}" in oom.evidence, oom.evidence
