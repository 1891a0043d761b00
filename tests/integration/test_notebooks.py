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
