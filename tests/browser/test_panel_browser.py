"""The panel in real JupyterLab and real Chromium: what a user sees below a %%tfmem cell, live and reopened."""

from __future__ import annotations

import re

from .conftest import open_notebook, run_cell

CELLS = [
    "%load_ext tfmem_magic",
    """%%tfmem --label "browser fit"
import keras, numpy as np
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu", name="wide"),
                          keras.layers.Dense(10, name="head")], name="browser_mlp")
model.compile("adam", "sparse_categorical_crossentropy")
model.fit(np.random.rand(2048, 32).astype("float32"), np.random.randint(0, 10, 2048), batch_size=128, verbose=0);""",
]


def test_panel_renders_live_and_static_twin_survives_reopen(lab, page, shoot):
    open_notebook(lab, page, "panel.ipynb", CELLS)
    run_cell(page, 0)
    run_cell(page, 1)

    panel = page.locator(".tfmem-panel")
    panel.wait_for(state="visible", timeout=60_000)
    header = panel.locator(".tfmem-head")
    assert "browser fit" in header.inner_text()
    assert "TF peak (CPU:0)" in header.inner_text() and "Budget left" in header.inner_text()
    assert "fits with" in panel.locator(".tfmem-verdict").inner_text()
    chart = panel.locator("img").first
    chart.wait_for(state="visible")
    assert chart.evaluate("img => img.naturalWidth") > 200  # a real decoded PNG
    # the static twin is in the same cell but hidden while the live panel is mounted
    static = page.locator(".jp-Cell").nth(1).locator(".tfmem-report")
    assert static.count() == 1 and not static.is_visible()

    shoot(panel, "panel-breakdown.png")
    before = chart.get_attribute("src")
    panel.get_by_role("button", name="by layer").click()
    page.wait_for_function("src => document.querySelector('.tfmem-panel img').src !== src", arg=before)
    by_layer = chart.get_attribute("src")
    # by line: the lines of the cell that made the Dense layers, their code as code, in place of the chart
    panel.get_by_role("button", name="by line").click()
    lines = panel.locator("table.tfmem-by-line:visible")
    lines.wait_for(state="visible")
    # the cell's third line as the notebook shows it (the magic's line counts)
    assert re.search(r"In \[\d+\] line 3\tmodel = keras.Sequential", lines.inner_text()), lines.inner_text()
    assert lines.locator("code").count() >= 1 and not chart.is_visible()
    panel.get_by_role("tab", name="Timeline").click()
    shown = panel.locator("img:visible")
    shown.first.wait_for(state="visible")
    assert shown.count() == 1  # only the Timeline tab's image is on screen now
    assert shown.first.get_attribute("src") not in (before, by_layer)
    assert shown.first.evaluate("img => img.naturalWidth") > 400
    shoot(panel, "panel-timeline.png")

    # the What if tab: moving the batch slider re-predicts in the kernel and the browser shows the new numbers
    panel.get_by_role("tab", name="What if").click()
    result = panel.locator(".tfmem-whatif").get_by_text("Predicted TF peak")
    result.wait_for(state="visible")
    assert "(analytic basis, batch 128" in result.inner_text()
    slider = panel.locator(".tfmem-whatif .widget-slider").first
    slider.locator(".widget-readout").click()  # the readout is editable: type a batch size
    slider.locator(".widget-readout").fill("512")
    slider.locator(".widget-readout").press("Enter")
    page.wait_for_function("() => document.querySelector('.tfmem-whatif').innerText.includes('batch 512')")
    shoot(panel, "panel-whatif.png")

    # the Held after tab: the name that keeps the fitted model's weights and slots, and how much
    panel.get_by_role("tab", name="Held after").click()
    holders = panel.locator("table.tfmem-holders:visible")
    holders.first.wait_for(state="visible")
    text = holders.first.inner_text()
    assert "model" in text and "1 Keras model: browser_mlp" in text, text
    shoot(panel, "panel-held.png")

    # save, stop the kernel, reopen: no widget can render, the static twin must be there
    page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("!window.jupyterapp.shell.currentWidget.context.model.dirty")
    for session in lab.api("/api/sessions"):
        lab.api(f"/api/sessions/{session['id']}", method="DELETE")
    page.goto(lab.notebook_url("panel.ipynb"))
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    static = page.locator(".jp-Cell").nth(1).locator(".tfmem-report")
    static.wait_for(state="visible", timeout=30_000)
    text = static.inner_text()
    assert "tfmem report" in text and "browser fit" in text and "TF peak" in text and "fits with" in text
    # the lab extension renders the report JSON itself (styled and escaped even in an untrusted notebook)
    assert static.get_attribute("class") == "tfmem-report tfmem-rendered"
    assert static.locator("svg.tfmem-timeline path").count() >= 1
    shoot(static, "static-reopened.png")
