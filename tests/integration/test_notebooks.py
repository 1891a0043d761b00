"""Notebooks executed in a real Jupyter kernel (nbclient), checked by the reports they produce."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tfmem_magic.report import MIME_TYPE, Report

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "example_notebooks"


def execute(nb: nbformat.NotebookNode, cwd: Path, allow_errors: bool = False) -> nbformat.NotebookNode:
    # the kernel runs this very interpreter, so it sees the same installed packages
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=allow_errors,
                            resources={"metadata": {"path": str(cwd)}})
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable
    client.execute()
    return nb


def reports_in(nb: nbformat.NotebookNode) -> list[Report]:
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIME_TYPE in data:
                found.append(Report.from_dict(data[MIME_TYPE]))
    return found


def test_first_profile_notebook_teaches_what_it_says(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "01_first_profile.ipynb", as_version=4)
    execute(nb, tmp_path)
    first, small = reports_in(nb)
    assert first.label == "batch 128" and small.label == "batch 32"
    for report in (first, small):
        assert report.status == "ok" and report.env.allocator_complete  # loaded before TF: BFC
        assert {"conv_a", "pool_a", "conv_b"} <= {g.layer for g in report.trace.by_layer}
        assert report.model.name == "first_cnn"
    phases = lambda r: {g.phase: g.bytes for g in r.trace.by_phase}  # noqa: E731
    # what the notebook teaches: activations scale with the batch (4x smaller batch, much smaller activations),
    # the weights and optimizer state do not
    assert phases(small)["forward"] < phases(first)["forward"] / 2
    assert phases(small)["backward"] < phases(first)["backward"] / 2
    assert small.model.param_bytes == first.model.param_bytes
    assert small.model.optimizer_bytes == first.model.optimizer_bytes
    # input copies vary from run to run (README, "Facts"); the finding must match what the trace saw
    assert any(f.id == "input-copy" for f in first.findings) == bool(first.trace.input_copies)
    history = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "batch 128" in history and "batch 32" in history


def outputs_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []))


def test_leaks_and_retracing_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "06_leaks_and_retracing.ipynb", as_version=4)
    execute(nb, tmp_path)
    by_label: dict[str, list[Report]] = {}
    for report in reports_in(nb):
        by_label.setdefault(report.label, []).append(report)
    leaky, clean = by_label["leaky"], by_label["clean"]
    assert [r.run for r in leaky] == [1, 2, 3, 4]
    # what it teaches: the leak is reported from the third run on, never for the clean cell
    assert [any(f.id == "leak-growth" for f in r.findings) for r in leaky] == [False, False, True, True]
    assert not any(f.id == "leak-growth" for r in clean for f in r.findings)
    fixed_exercise = by_label["exercise-fixed"]
    assert not any(f.id == "leak-growth" for r in fixed_exercise for f in r.findings)
    text = "".join(outputs_text(c) for c in nb.cells)
    assert "graphs built: {'scale': 6}" in text and "graphs built: {'scale': 1}" in text
    assert "was traced 6 times" in text
    assert "Watch mode off" in text and "tfmem · TF peak" in "".join(
        o.get("data", {}).get("text/plain", "") for c in nb.cells for o in c.get("outputs", []))


def test_surviving_oom_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "07_surviving_oom.ipynb", as_version=4)
    execute(nb, tmp_path)  # the failing cells are tagged raises-exception: the notebook runs top to bottom
    text = "".join(outputs_text(c) for c in nb.cells)
    assert "TensorFlow's allocator is capped" in text and "oneDNN is turned off" in text
    assert "failed request: float32[30000,30000] = 3.35 GiB (op Fill)" in text
    assert "still here: {'epochs_done': 12, 'best_loss': 0.031}" in text
    reports = {r.label or "": r for r in reports_in(nb)}
    statuses = [r.status for r in reports_in(nb)]
    assert statuses.count("oom") >= 3 and "ok" in statuses  # three stopped cells, the small batch trained
    assert "oom stopped by the watchdog after" in text
    assert "largest batch that fits:" in text and "largest batch that fits: None" not in text
    del reports


def test_failing_cell_in_a_kernel_fails_once_and_still_reports(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
        nbformat.v4.new_code_cell("%%tfmem --quick\nkept = 5\nraise RuntimeError('cell failed 7')"),
        nbformat.v4.new_code_cell("kept"),
    ])
    with pytest.raises(CellExecutionError, match="cell failed 7"):
        execute(nb, tmp_path)
    outputs = nb.cells[1].outputs
    errors = [o for o in outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "RuntimeError"  # one traceback, the user's own
    (report,) = reports_in(nb)
    assert report.status == "error" and report.error.message == "cell failed 7"
    html = next(o.data["text/html"] for o in outputs if "data" in o and "text/html" in o.data)
    assert "tfmem report" in html  # the static twin is saved in the notebook


def test_kernel_survives_error_and_keeps_variables(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
        nbformat.v4.new_code_cell("%%tfmem --quick\nkept = 5\nraise RuntimeError('x')"),
        nbformat.v4.new_code_cell("print('kept is', kept)"),
    ])
    execute(nb, tmp_path, allow_errors=True)
    assert "kept is 5" in nb.cells[2].outputs[0].text
