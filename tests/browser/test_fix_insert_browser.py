"""Fix buttons in real JupyterLab and Chromium: the lab extension inserts the fix cell right below the profiled
cell (or at the top for restart fixes), the fix cell runs and shows before/after; again after a kernel restart."""

from __future__ import annotations

import json
import re

from .conftest import open_notebook, run_cell, wait_kernel_idle

CELLS = [
    "%load_ext tfmem_magic",
    (
        "import psutil, numpy as np, keras\n"
        "xtr = np.random.rand(512, 32, 32, 3).astype('float32'); ytr = np.zeros((512, 10), 'float32')\n"
        "tight = psutil.Process().memory_info().rss // 2**20 + 100  # a small budget: what the process holds + 100 MiB"
    ),
    """%%tfmem --quick --limit {tight}MiB --label over
net = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                        keras.layers.Flatten(), keras.layers.Dense(10)])
net.compile("adam", "mse")
net.fit(xtr, ytr, batch_size=512, verbose=0)""",
]


def cell_sources(page) -> list[str]:
    return page.evaluate(
        "window.jupyterapp.shell.currentWidget.content.widgets.map(c => c.model.sharedModel.getSource())"
    )


def click_fix(page, cell_index: int, fix_id: str) -> None:
    """Open the Fixes tab of the panel in that cell and click the insert button of fix `fix_id`."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(cell_index)
    panel = cell.locator(".tfmem-panel")
    panel.wait_for(state="visible", timeout=60_000)
    panel.get_by_role("tab", name="Fixes").click()
    fix = panel.locator(".widget-vbox", has=page.locator(f"code:text-is('{fix_id}')")).last
    count_before = len(cell_sources(page))  # Shift+Enter on the last cell may have added an empty one
    button = fix.locator("button.widget-button")
    try:
        button.scroll_into_view_if_needed(timeout=60_000)  # a windowed notebook (Notebook 7) renders what is in view
    except Exception:  # noqa: BLE001 - a timeout of any kind: what the panel shows says why
        raise AssertionError(f"no {fix_id} button in the panel; it shows: {panel.inner_text()[-1500:]}") from None
    button.click()
    try:
        page.wait_for_function(
            f"window.jupyterapp.shell.currentWidget.content.widgets.length === {count_before + 1}", timeout=30_000
        )
    except Exception:  # noqa: BLE001 - a timeout of any kind: the fix's own words say why
        raise AssertionError(f"no cell inserted; the fix says: {fix.inner_text()[-400:]}") from None
    top = cell_sources(page)[0] != "%load_ext tfmem_magic" and fix_id == "cpu-memory-limit"
    # the acknowledgement reached the kernel; a cell inserted at the top moved the panel's cell down by one
    status = page.locator(".jp-Notebook .jp-Cell").nth(cell_index + (1 if top else 0)).locator(".tfmem-panel")
    status.get_by_text("Inserted at the top" if top else "Inserted below").first.wait_for(timeout=30_000)


def test_fix_buttons_insert_cells_that_run_with_before_after(lab, page, shoot):
    open_notebook(lab, page, "fixes.ipynb", CELLS)
    for i in range(3):
        run_cell(page, i)

    click_fix(page, 2, "shrink-batch")
    sources = cell_sources(page)
    inserted = sources[3]  # directly below the profiled cell
    assert inserted.startswith("%%tfmem --before ") and "--fix shrink-batch" in inserted
    new_batch = int(inserted.split("batch_size=")[1].split(",")[0])
    assert 1 <= new_batch < 512
    expected = CELLS[2].split("\n", 1)[1].replace("batch_size=512", f"batch_size={new_batch}")
    assert inserted.split("\n", 1)[1].rstrip("\n") == expected  # the rest of the cell byte for byte
    active = page.evaluate("window.jupyterapp.shell.currentWidget.content.activeCellIndex")
    assert active == 3  # selected, not run
    assert page.evaluate("window.jupyterapp.shell.currentWidget.content.widgets[3].model.executionCount") is None
    shoot(page.locator(".jp-Notebook .jp-Cell").nth(2), "fix-inserted.png")

    run_cell(page, 3)
    after = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".tfmem-panel")
    after.wait_for(state="visible", timeout=60_000)
    text = after.locator(".tfmem-before-after").inner_text()
    assert "Before → after (fix shrink-batch)" in text and "prediction" in text
    shoot(after, "before-after.png")

    # a restart fix goes at the top of the notebook
    click_fix(page, 2, "cpu-memory-limit")
    assert cell_sources(page)[0].startswith("# first cell of the notebook")

    # after a kernel restart the comm target is still there: run the cells again and insert again
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()")
    wait_kernel_idle(page)
    run_cell(page, 1)  # %load_ext tfmem_magic
    run_cell(page, 2)  # setup
    run_cell(page, 3)  # the over-budget cell
    click_fix(page, 3, "shrink-batch")
    assert cell_sources(page)[4].startswith("%%tfmem --before ")


def test_without_the_extension_the_button_names_the_command_that_gives_the_cell(lab_without_extension, page):
    # VS Code's and Colab's notebooks have no tfmem_insert comm target: here, JupyterLab with the extension disabled
    open_notebook(lab_without_extension, page, "bare.ipynb", CELLS)
    for i in range(3):
        run_cell(page, i)
    panel = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".tfmem-panel")
    panel.wait_for(state="visible", timeout=60_000)
    panel.get_by_role("tab", name="Fixes").click()
    fix = panel.locator(".widget-vbox", has=page.locator("code:text-is('shrink-batch')")).last
    count = len(cell_sources(page))
    fix.locator("button.widget-button").click()
    fix.get_by_text("This front end has no tfmem extension").wait_for(timeout=30_000)
    command = re.search(r"%tfmem fix \d+ --report \d+", fix.inner_text())
    assert command, fix.inner_text()
    assert len(cell_sources(page)) == count  # nothing was inserted, and nothing waits for an answer
    assert fix.locator("button.widget-button").is_enabled()
    # the command it names puts the fix in the next cell (IPython's set_next_input, which every front end knows)
    page.evaluate(
        f"window.jupyterapp.shell.currentWidget.content.widgets[{count - 1}].model.sharedModel"
        f".setSource({json.dumps(command.group(0))})"
    )
    run_cell(page, count - 1)
    page.wait_for_function(f"window.jupyterapp.shell.currentWidget.content.widgets.length > {count}", timeout=30_000)
    assert (
        cell_sources(page)[count].startswith("%%tfmem --before ") and "--fix shrink-batch" in cell_sources(page)[count]
    )


def test_in_jupyter_notebook_7_the_panel_shows_and_the_button_inserts(notebook7, page):
    open_notebook(notebook7, page, "nb7.ipynb", CELLS)
    for i in range(3):
        run_cell(page, i)
    click_fix(page, 2, "shrink-batch")
    inserted = cell_sources(page)[3]
    assert inserted.startswith("%%tfmem --before ") and "--fix shrink-batch" in inserted
    assert "/notebooks/nb7.ipynb" in page.url and page.locator("#jp-NotebookPanel, .jp-NotebookPanel").count() >= 1
    page.screenshot(path=str(notebook7.root / "nb7.png"))
