"""Notebooks executed in a real Jupyter kernel (nbclient), checked by the reports they produce."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
from jsonschema import Draft202012Validator
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tfmem_magic.core.report import MIME_TYPE, Report
from tfmem_magic.core.schema import shipped_schema

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "example_notebooks"


def execute(nb: nbformat.NotebookNode, cwd: Path, allow_errors: bool = False) -> nbformat.NotebookNode:
    # the kernel runs this very interpreter, so it sees the same installed packages
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", allow_errors=allow_errors, resources={"metadata": {"path": str(cwd)}}
    )
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable
    client.execute()
    return nb


def reports_in(nb: nbformat.NotebookNode) -> list[Report]:
    """The reports the notebook's kernel displayed, each checked against the schema the package ships."""
    validator = Draft202012Validator(shipped_schema())
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIME_TYPE in data:
                report = {k: v for k, v in data[MIME_TYPE].items() if k != "view"}  # the bundle's own addition
                errors = [f"{'/'.join(map(str, e.path))}: {e.message[:200]}" for e in validator.iter_errors(report)]
                assert not errors, errors[:5]
                found.append(Report.from_dict(data[MIME_TYPE]))
    return found


def test_first_profile_notebook_teaches_what_it_says(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "01_first_profile.ipynb", as_version=4)
    execute(nb, tmp_path)
    first, small = reports_in(nb)
    assert first.label == "batch 128" and small.label == "batch 32"
    for report in (first, small):
        assert report.status == "ok" and report.env.allocator_complete  # loaded before TF: BFC
        # the convolutions hold the most at the peak; pool_a's output (conv_b's input) is live there only when the
        # peak comes before conv_b's backward frees it, which moves from run to run (a CI run had it gone)
        assert {"conv_a", "conv_b"} <= {g.layer for g in report.trace.by_layer}
        assert report.model.name == "first_cnn"
    # what the notebook teaches: activations scale with the batch (4x smaller batch, much smaller activations),
    # the weights and optimizer state do not. Counted on the tensors with the batch dimension, the most live at once:
    # what is live at the peak moves with its moment (CI: backward at 32 was 0.54x backward at 128 in one run)
    assert small.trace.batch_bytes_most < first.trace.batch_bytes_most / 2
    assert small.model.param_bytes == first.model.param_bytes
    assert small.model.optimizer_bytes == first.model.optimizer_bytes
    # input copies vary from run to run (docs/design.md, "Facts found while building tfmem"); the finding must
    # match what the trace saw
    at_peak = sum(c.bytes for c in first.trace.input_copies if c.live_at_peak)
    worth = (
        at_peak >= 0.1 * first.trace.allocated_at_peak_bytes
        or sum(c.bytes for c in first.trace.input_copies) >= 64 * 2**20
    )  # the rule's threshold
    assert any(f.id == "input-copy" for f in first.findings) == (bool(first.trace.input_copies) and worth)
    history = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "batch 128" in history and "batch 32" in history


def outputs_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []))


def by_label(nb: nbformat.NotebookNode) -> dict[str, Report]:
    return {r.label: r for r in reports_in(nb)}


def test_batch_size_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "02_batch_size.ipynb", as_version=4)
    execute(nb, tmp_path)
    reports = by_label(nb)
    b32, b128, acc = reports["batch 32"], reports["batch 128"], reports["4 x 32 accumulated"]
    # activations scale with the batch, the model's state does not. Measured on the tensors with the batch dimension,
    # the most live at any one moment: what is live at the peak is not (its forward/backward split moves from run to
    # run; CI once saw forward + backward at 128 only 2.3x that at 32). This was 3.3-4.0x in 3 runs here, under 4x when
    # a moment at batch 32 held a few more batch tensors than its usual busiest one
    assert b128.trace.batch_bytes_most > 2.5 * b32.trace.batch_bytes_most
    assert b128.model.optimizer_bytes == b32.model.optimizer_bytes
    assert "tensors with the batch dimension, the most live at once" in "".join(outputs_text(c) for c in nb.cells)
    # the prediction from batch 32 holds at batch 128, within its band
    text = "".join(outputs_text(c) for c in nb.cells)
    line = next(t for t in text.splitlines() if t.startswith("predicted ") and "measured" in t)
    error = int(line.rsplit("(", 1)[1].rstrip("%)"))
    if "an upper bound" in text:  # the trace stopped before b32's peak (seen in CI, not here): the safe side
        assert error >= -10, line
    else:
        assert abs(error) <= 30, line
    assert "calibrated:" in text and re.search(r"(±15%|\+15%/−\d+%) \(replay\)", text), text
    # accumulation: batch 128's effective batch with batch 32's activations
    assert acc.tf_peak_bytes < 0.7 * b128.tf_peak_bytes
    assert "largest batch that fits the budget:" in text and "largest batch under 1 GiB" in text
    # the pre-flight refuses batch 1024 under 2 GB before its first step, and the batch it names fits
    refused, fitted = reports["batch 1024"], reports["largest batch"]
    assert refused.preflight.verdict == "refused" and refused.error.type == "PreflightRefused"
    assert refused.rss.peak_bytes < refused.guard.limit_bytes  # nothing of the call ran
    # its what-if predicts from the pre-flight's replay, and names the refusal's batch
    said = next((t for t in text.splitlines() if t.startswith("batch 512: TF peak")), "no what-if printed")
    pre = refused.preflight
    assert said.endswith(f"±35% (replay basis); largest batch that fits: {pre.largest_batch}"), (said, pre.replay_note)
    assert fitted.status == "ok" and fitted.model.batch_size == refused.preflight.largest_batch
    assert fitted.rss.peak_bytes <= fitted.guard.limit_bytes


def test_precision_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "03_precision.ipynb", as_version=4)
    execute(nb, tmp_path)
    reports = by_label(nb)
    f32, bf16 = reports["float32"], reports["mixed_bfloat16"]
    assert bf16.tf_peak_bytes < 0.85 * f32.tf_peak_bytes  # what it teaches: bf16 lowers the peak on CPU
    assert bf16.model.dtype_policy == "mixed_bfloat16" and f32.model.dtype_policy == "float32"
    text = "".join(outputs_text(c) for c in nb.cells)
    assert "model built before the policy: float32" in text and "model built after it:         bfloat16" in text
    assert "dtype of the variables: float32" in text
    assert not any(f.id == "mixed-precision" and 'mixed_float16")' in f.code for f in f32.fixes)


def test_data_pipelines_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "04_data_pipelines.ipynb", as_version=4)
    execute(nb, tmp_path)
    reports = by_label(nb)
    numpy_fit, streamed, shuffled = reports["fit(numpy)"], reports["tf.data generator"], reports["shuffle 32 batches"]
    assert numpy_fit.model.input_array_bytes == 8192 * 1024 * 4 + 8192 * 4
    assert streamed.trace.input_copies == []  # the generator pipeline never copies the whole arrays
    assert streamed.tf_peak_bytes < numpy_fit.tf_peak_bytes or not numpy_fit.trace.input_copies
    assert streamed.tf_peak_bytes < 16 * 2**20  # a few batches of 1 MiB and a small model
    assert shuffled.tf_peak_bytes > 2 * streamed.tf_peak_bytes  # 32 buffered batches are the whole dataset again
    text = "".join(outputs_text(c) for c in nb.cells)
    assert "ran out of data" not in text


def test_the_model_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "05_the_model.ipynb", as_version=4)
    execute(nb, tmp_path)
    reports = by_label(nb)
    adam, sgd, frozen = reports["Adam"], reports["SGD momentum"], reports["encoder frozen"]
    # what it teaches: one slot fewer, and frozen layers have neither gradients nor slots
    assert sgd.model.optimizer_bytes < 0.6 * adam.model.optimizer_bytes and sgd.tf_peak_bytes < adam.tf_peak_bytes
    assert frozen.model.trainable_params < adam.model.trainable_params / 2
    assert frozen.tf_peak_bytes < 0.7 * adam.tf_peak_bytes
    assert any(f.id == "optimizer-state" for f in adam.findings)
    assert "lighter-optimizer" in {f.id for f in adam.fixes}
    assert reports["64 px"].tf_peak_bytes < 0.5 * reports["128 px"].tf_peak_bytes  # a quarter of the pixels
    # the GAN's own train_step: both optimizers counted, and calibration replays the step the cell ran
    gan = reports["GAN, own train_step"]
    assert gan.status == "ok" and gan.model.optimizer_text == "Adam ×2 (d_optimizer, g_optimizer)"
    printed = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "batch 64 (analytic)" in printed and "batch 64 (replay)" in printed, printed[-2000:]
    assert "own training step (GAN.train_step" in printed
    # which line of the model holds the memory: the custom layer's `call` line, named in the cell it is defined in
    defined = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("class Expand"))
    named = [g for g in reports["by line"].trace.by_line if g.kind == "line"]
    # its output is live at the peak in every order the backward pass runs in (tanh's gradient reads it); the Dense
    # after it made its input's gradient, as large, named by the model's line: either can come first
    call = next((g for g in named[:2] if g.code == "return keras.ops.tanh(keras.ops.matmul(x, self.w))"), None)
    assert call is not None, [(g.label, g.code, g.bytes) for g in named]
    assert call.label == f"In [{defined.execution_count}] line 7" and call.bytes >= 8 * 2**20
    assert f"In [{defined.execution_count}] line 7  return keras.ops.tanh" in printed


def test_myths_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "08_myths_and_facts.ipynb", as_version=4)
    execute(nb, tmp_path)  # the set_memory_growth cell is tagged raises-exception
    reports = by_label(nb)
    assert reports["TF_MEMORY_ALLOCATION=0.01"].tf_peak_bytes >= 2**29  # the variable capped nothing
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert [e.evalue for e in errors] == ["Cannot set memory growth on non-GPU and non-Pluggable devices"]
    freed = reports["del frees"].tf["CPU:0"]
    assert freed.peak_bytes - freed.baseline_bytes >= 128 * 2**20 and freed.end_bytes == freed.baseline_bytes
    text = "".join(outputs_text(c) for c in nb.cells)
    assert "has dispose: False | tf.Session in TF2: False" in text and "DataLoader in tf: False" in text


def test_gpu_notebook_skips_cleanly_without_a_gpu(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "09_gpu.ipynb", as_version=4)
    execute(nb, tmp_path)
    text = "".join(outputs_text(c) for c in nb.cells)
    if "GPUs: none" in text:
        assert text.count("skipped:") == 2 and "mixed_bfloat16 there" in text
    else:
        assert "memory growth on for" in text and "mixed_float16: GPU peak" in text


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
    # who holds it: the leak names the list; the search names its dict of History objects; models nothing refers
    # to are TensorFlow's (its gradient registry), and %tfmem free gives both back
    assert [f.holders for f in leaky[2].findings if f.id == "leak-growth"] == [["kept"]]
    ids = [{f.id for f in r.findings} for r in reports_in(nb)]
    assert any("leak-in-cell" in found for found in ids) and any("held-by-tensorflow" in found for found in ids)
    assert "via histories[256].model" in text and text.count("given back") >= 2
    assert "Watch mode off" in text and "tfmem · TF peak" in "".join(
        o.get("data", {}).get("text/plain", "") for c in nb.cells for o in c.get("outputs", [])
    )


def test_surviving_oom_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "07_surviving_oom.ipynb", as_version=4)
    execute(nb, tmp_path)  # the failing cells are tagged raises-exception: the notebook runs top to bottom
    text = "".join(outputs_text(c) for c in nb.cells)
    assert "TensorFlow's allocator is capped" in text and "oneDNN is turned off" in text
    assert "failed request: float32[30000,30000] = 3.35 GiB (op Fill)" in text
    assert "still here: {'epochs_done': 12, 'best_loss': 0.031}" in text
    reports = {r.label or "": r for r in reports_in(nb)}
    statuses = [r.status for r in reports_in(nb)]
    # three stopped cells (out of memory, or refused by the pre-flight), the small batch trained
    assert statuses.count("oom") + statuses.count("refused") >= 3 and "ok" in statuses
    assert "oom stopped by the watchdog after" in text
    assert "largest batch that fits:" in text and "largest batch that fits: None" not in text
    del reports


def test_failing_cell_in_a_kernel_fails_once_and_still_reports(tmp_path):
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
            nbformat.v4.new_code_cell("%%tfmem --quick\nkept = 5\nraise RuntimeError('cell failed 7')"),
            nbformat.v4.new_code_cell("kept"),
        ]
    )
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
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
            nbformat.v4.new_code_cell("%%tfmem --quick\nkept = 5\nraise RuntimeError('x')"),
            nbformat.v4.new_code_cell("print('kept is', kept)"),
        ]
    )
    execute(nb, tmp_path, allow_errors=True)
    assert "kept is 5" in nb.cells[2].outputs[0].text
