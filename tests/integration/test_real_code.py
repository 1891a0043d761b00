"""Real Keras programs under %%tfmem, in a real Jupyter kernel.

tests/realcode/ holds training programs written the way the keras.io tutorials write them (only the data is synthetic
and small). Each runs in its own fresh kernel twice: plainly, then again in a cell that starts with `%%tfmem --as r`.
The profiled run must behave like the plain one (no exception, the same History keys) and its report must describe
the program's own model without findings that are false for a program this small.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from test_notebooks import execute  # a real kernel running this interpreter (the repo's .venv)

from tfmem_magic.advise.rewrite import rewrite_batch

pytestmark = pytest.mark.slow
REALCODE = Path(__file__).resolve().parents[1] / "realcode"

# program -> (the variable holding the trained model, whether fit() was handed numpy arrays)
PROGRAMS = {
    "mnist_convnet": ("model", True),
    "text_transformer": ("model", True),
    "timeseries_lstm": ("model", False),
    "vae": ("vae", True),  # the example calls its trained model `vae`
    "image_from_directory": ("model", False),
    "structured_data": ("model", False),
    "text_vectorization": ("model", False),
}
# Programs whose losses vary from run to run even without the magic, and by how much (relative). The image program's
# random augmentation runs in a parallel tf.data map (num_parallel_calls=AUTOTUNE): its second epoch differed by
# ~1e-3 between two plain runs, once 1.07e-2 in CI. The others gave bit-identical losses plain and under %%tfmem.
NONDETERMINISTIC = {"image_from_directory": 3e-2}
# Findings that cannot be true for these programs: a few MB of weights and batches, one model built and compiled
# once per cell, one fit, far from any budget, the extension loaded before TensorFlow's first op (BFC allocator).
# "input-copy" can be true only when fit() was handed numpy arrays.
FALSE_FOR_SMALL_PROGRAMS = {
    "large-batch",
    "large-model",
    "optimizer-state",
    "in-memory-dataset",
    "leak-growth",
    "retracing",
    "fragmentation",
    "near-budget",
    "oom",
    "non-tf-growth",
    "allocator-blind-spot",
}
MARK = "REALCODE-RESULT "
# programs whose peak the trace does not reach: structured_data adapts 13 preprocessing layers before fit, and those
# tf.data passes spend the trace's memory budget (tracer.py) before the training step, whose ~1.5 MiB peak is then
# predicted from the cell's own point (an upper bound, the safe side) instead of within the ±30% band
UPPER_BOUND_ONLY = {"structured_data"}


def probe(model_var: str) -> str:
    """A cell printing what the previous cell left: History keys and losses, the model's layer names, and the
    report bound by `--as r` (if any); then it forgets them so the next run cannot reuse stale objects."""
    return f"""
import json as _json, math as _math
_out = {{}}
_h = globals().get("history")
if _h is not None:
    _out["keys"] = sorted(_h.history)
    _out["loss"] = [float(v) for v in _h.history.get("loss", [])]
_m = globals().get({model_var!r})
if _m is not None:
    _out["layers"] = [layer.name for layer in _m.layers]
_r = globals().get("r")
if _r is not None:
    _out["report"] = {{
        "status": _r.status,
        "error": None if _r.error is None else {{"type": _r.error.type, "message": _r.error.message}},
        "model_name": None if _r.model is None else _r.model.name,
        "model_layers": None if _r.model is None else [layer.name for layer in _r.model.layers],
        "findings": [[f.id, f.title] for f in _r.findings],
        "wall_s": _r.wall_s,
        "tf_function_traces": dict(_r.tf_function_traces),
        "batch": None if _r.model is None else _r.model.batch_size,
        "tf_peak": _r.tf_peak_bytes,
    }}
    try:
        import tfmem_magic as _t
        _w = _t.predict(_r, batch_size=2 * _r.model.batch_size)
        from tfmem_magic.advise.prediction import analytic_basis as _ab
        _t_ = _r.trace
        _out["report"]["twice"] = [_w.peak_bytes, _w.error_band, _w.basis]
        _out["report"]["slope"] = [_ab(_r).slope_source, _t_.batch_bytes_at_peak, _t_.peak_live_bytes,
                                   _r.main_device.peak_bytes, _t_.requested_at_peak_bytes, _t_.note,
                                   [(g.phase, g.requested_bytes) for g in _t_.by_phase]]
    except Exception as _e:
        _out["report"]["twice"] = repr(_e)
print({MARK!r} + _json.dumps(_out))
for _name in ("history", {model_var!r}, "r"):
    globals().pop(_name, None)
"""


def seconds(cell) -> float:
    timing = cell.metadata.get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return float("nan")
    return (
        datetime.fromisoformat(end.replace("Z", "+00:00")) - datetime.fromisoformat(start.replace("Z", "+00:00"))
    ).total_seconds()


def error_of(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out.get("traceback", [])))
            return f"{out.ename}: {out.evalue}\n" + "\n".join(tb.splitlines()[-25:])
    return None


def result_of(cell) -> dict:
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
    lines = [line for line in text.splitlines() if line.startswith(MARK)]
    assert lines, f"the probe cell printed nothing: {error_of(cell)}"
    return json.loads(lines[-1][len(MARK) :])


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_real_program_under_tfmem(program, tmp_path, record_property):
    model_var, fed_arrays = PROGRAMS[program]
    source = (REALCODE / f"{program}.py").read_text()
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
            nbformat.v4.new_code_cell(source),
            nbformat.v4.new_code_cell(probe(model_var)),
            nbformat.v4.new_code_cell("%%tfmem --as r\n" + source),
            nbformat.v4.new_code_cell(probe(model_var)),
        ]
    )
    execute(nb, tmp_path, allow_errors=True)
    _, plain_cell, plain_probe, magic_cell, magic_probe = nb.cells
    plain_s, magic_s = seconds(plain_cell), seconds(magic_cell)
    record_property("plain_s", plain_s)
    record_property("tfmem_s", magic_s)
    print(f"\n{program}: plain {plain_s:.1f} s, under %%tfmem {magic_s:.1f} s")

    # the program itself is sound: it trains without the magic
    assert error_of(plain_cell) is None, f"{program} fails without the magic:\n{error_of(plain_cell)}"
    plain = result_of(plain_probe)
    assert plain["keys"] and plain["loss"] and all(math.isfinite(v) for v in plain["loss"]), plain
    assert plain["layers"], plain

    # under the magic: the same program behaves the same
    assert error_of(magic_cell) is None, f"{program} raised under %%tfmem:\n{error_of(magic_cell)}"
    profiled = result_of(magic_probe)
    print(
        f"{program}: losses plain {plain['loss']}, under %%tfmem {profiled.get('loss')}; findings "
        f"{[f[0] for f in profiled.get('report', {}).get('findings', [])]}"
    )
    assert profiled.get("keys") == plain["keys"], (profiled.get("keys"), plain["keys"])
    # same seed, same data: the profiler and the wrappers must not change what the program computes
    tolerance = NONDETERMINISTIC.get(program, 1e-5)
    assert profiled["loss"] == pytest.approx(plain["loss"], rel=tolerance), (profiled["loss"], plain["loss"])

    # and its report describes this program's own model
    report = profiled.get("report")
    assert report is not None, "`%%tfmem --as r` bound no report to r"
    assert report["status"] == "ok", report["error"]
    assert report["model_layers"] is not None, "the report has no model"
    assert report["model_layers"] == profiled["layers"], (
        report["model_name"],
        report["model_layers"],
        profiled["layers"],
    )
    false = FALSE_FOR_SMALL_PROGRAMS | (set() if fed_arrays else {"input-copy"})
    wrong = [f for f in report["findings"] if f[0] in false]
    assert not wrong, (wrong, report["tf_function_traces"])

    # the what-if at twice the batch, against a run at twice the batch in a fresh kernel
    twice = report["twice"]
    assert isinstance(twice, list), twice
    predicted, band, basis = twice
    rewritten = rewrite_batch(source, report["batch"], 2 * report["batch"])
    assert rewritten.source is not None, rewritten.message
    nb2 = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext tfmem_magic"),
            nbformat.v4.new_code_cell(rewritten.source),  # the run before, as in the first kernel
            nbformat.v4.new_code_cell("%%tfmem --as r\n" + rewritten.source),
            nbformat.v4.new_code_cell(probe(model_var)),
        ]
    )
    execute(nb2, tmp_path, allow_errors=True)
    assert error_of(nb2.cells[2]) is None, error_of(nb2.cells[2])
    measured = result_of(nb2.cells[3])["report"]
    assert measured["batch"] == 2 * report["batch"]
    error = predicted / measured["tf_peak"] - 1
    print(
        f"{program}: batch {report['batch']} -> {2 * report['batch']}: predicted {predicted / 2**20:.1f} MiB "
        f"({basis}), measured {measured['tf_peak'] / 2**20:.1f} MiB: {error:+.1%}"
    )
    record_property("error_at_2x", error)
    print(report.get("slope"))
    if program in UPPER_BOUND_ONLY:
        # the trace did not see fit's peak: the prediction is the cell's own point (an upper bound) or, when the
        # budget was not marked spent, the layer outputs' prior; on a 1.4 MiB step either lands on the safe side
        # (+34% from the prior here), not within the band
        assert measured["tf_peak"] <= predicted <= 3 * measured["tf_peak"], (program, predicted, measured["tf_peak"])
    else:
        assert abs(error) <= band, (program, predicted, measured["tf_peak"], error, band)
