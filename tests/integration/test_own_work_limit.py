"""Under a memory limit, tfmem's own work in the kernel after a cell (the report's analysis, calibration) counts
against the limit like the cell's code (docs/preflight.md, "tfmem's own work counts"): it does not start without the
room it needs, and it is stopped before the process passes the limit; the cell keeps its report."""

from __future__ import annotations

import time

import psutil
import pytest

from tfmem_magic.advise import calibration

pytestmark = pytest.mark.slow
MiB = 2**20

SETUP = """
import numpy as np, keras
model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096), keras.layers.Dense(1)])
model.compile("sgd", "mse")
x = np.random.rand(64, 4096).astype("float32"); y = np.zeros((64, 1), "float32")
model.fit(x, y, batch_size=32, verbose=0)
"""
FIT = "model.fit(x, y, batch_size=32, verbose=0)"


def above_now(mib: int) -> str:
    return f"{psutil.Process().memory_info().rss // MiB + mib}MiB"


def limit_above_now(mib: int) -> str:
    return f"--limit {above_now(mib)}"


def greedy_into(held: list[bytearray]):
    """tfmem's own work as it would grow the process: real pages, 4 MiB at a time, up to 1 GiB."""

    def greedy(report, *args, **kwargs):
        for _ in range(256):
            held.append(bytearray(b"\1" * (4 * MiB)))
            time.sleep(0.005)
        raise AssertionError("the watch did not stop it")

    return greedy


def test_calibration_without_room_under_the_limit_does_not_start(shell):
    assert shell.run_cell(SETUP).success
    # the model's 64 MiB of weights: the calibration's export needs ~80 MiB, and at most 72 MiB are left under the
    # limit (the least a limit may leave)
    result = shell.run_cell(f"%%tfmem --as rep --calibrate --no-panel {limit_above_now(72)}\n{FIT}")
    assert result.success, result.error_in_exec
    rep = shell.user_ns["rep"]
    assert rep.status == "ok" and rep.whatif_basis is not None and rep.whatif_basis.name == "analytic"
    said = [n for n in rep.notes if n.startswith("Calibration (--calibrate) did not run: it works in the kernel")]
    assert said and "left under the memory limit" in said[0], rep.notes


def test_own_work_that_reaches_the_limit_is_stopped_and_the_cell_keeps_its_report(shell, monkeypatch):
    assert shell.run_cell(SETUP).success
    held: list[bytearray] = []
    monkeypatch.setattr(calibration, "measured_basis", greedy_into(held))
    # room for the calibration to start (the weights' 80 MiB), not for the 1 GiB it would grow by
    result = shell.run_cell(f"%%tfmem --as rep --calibrate --no-panel {limit_above_now(160)}\n{FIT}")
    grown = len(held) * 4
    held.clear()
    assert result.success, result.error_in_exec
    rep = shell.user_ns["rep"]
    assert rep.status == "ok" and rep.model is not None, rep.notes
    assert any(n.startswith("tfmem stopped its own work on this cell") for n in rep.notes), rep.notes
    assert grown < 160, grown
    # the next cell runs as usual: no stop left pending
    again = shell.run_cell("%%tfmem --as rep2 --no-panel --no-calibrate\nimport time; time.sleep(0.2)")
    assert again.success and shell.user_ns["rep2"].status == "ok"


def run_until_stopped_holding_it(shell):
    """A cell that grows the process until the guard stops it, and keeps what it grew: its report."""
    assert shell.run_cell("import tensorflow as tf").success  # the limit is set above a process that has it loaded
    result = shell.run_cell(
        f"%%tfmem --as rep --no-panel {limit_above_now(200)}\nkept = []\nwhile True:\n"
        "    kept.append(bytearray(b'\\1' * (4 * 2**20)))"
    )
    shell.user_ns.pop("kept", None)
    assert not result.success
    return shell.user_ns["rep"]


def _limit_now(shell, mib: int) -> None:
    shell.run_line_magic("tfmem", f"limit {above_now(mib)}")


def test_a_calibration_asked_later_without_room_under_the_session_limit_does_not_start(shell):
    import tfmem_magic
    from tfmem_magic.core.errors import TfmemUsageError

    assert shell.run_cell(SETUP).success
    assert shell.run_cell(f"%%tfmem --as rep --no-calibrate --no-panel\n{FIT}").success
    rep = shell.user_ns["rep"]
    _limit_now(shell, 72)  # the export needs the weights' 64 MiB and the reserve: not there
    try:
        with pytest.raises(TfmemUsageError, match="left under the memory limit"):
            tfmem_magic.predict(rep, batch_size=64, calibrate=True)
    finally:
        shell.run_line_magic("tfmem", "limit off")
    assert rep.whatif_basis is not None and rep.whatif_basis.name == "analytic"


def test_a_calibration_asked_later_is_stopped_at_the_session_limit(shell, monkeypatch):
    import tfmem_magic
    from tfmem_magic.core.errors import TfmemUsageError

    assert shell.run_cell(SETUP).success
    assert shell.run_cell(f"%%tfmem --as rep --no-calibrate --no-panel\n{FIT}").success
    rep = shell.user_ns["rep"]
    held: list[bytearray] = []
    monkeypatch.setattr(calibration, "measured_basis", greedy_into(held))
    _limit_now(shell, 160)
    try:
        with pytest.raises(TfmemUsageError, match="calibration stopped"):
            tfmem_magic.largest_batch(rep, calibrate=True)
    finally:
        grown = len(held) * 4
        held.clear()
        shell.run_line_magic("tfmem", "limit off")
    assert grown < 160, grown
    assert rep.whatif_basis is not None and rep.whatif_basis.name == "analytic"


def test_a_cell_stopped_for_memory_keeps_its_oom_finding_when_its_analysis_is_stopped(shell, monkeypatch):
    """Where tfmem's analysis of a cell stopped for memory is stopped itself, the report still says it ran out and
    that the kernel and its variables are intact (the oom finding), with the note."""
    from tfmem_magic import pipeline
    from tfmem_magic.measure.guard import OwnWorkStopped

    def stopped(self, report, measured):
        raise OwnWorkStopped("the process reached the limit")

    monkeypatch.setattr(pipeline.Profiler, "_analyse_and_advise", stopped)
    rep = run_until_stopped_holding_it(shell)
    assert rep.stopped_for_memory, rep.status
    assert any(n.startswith("tfmem stopped its own work on this cell") for n in rep.notes), rep.notes
    assert [f.id for f in rep.findings][:1] == ["oom"] and "variables are intact" in rep.findings[0].evidence


def test_a_cell_that_ends_holding_what_reached_the_limit_is_still_analysed(shell, monkeypatch):
    """The cell keeps what reached the limit, so the process is past the own-work line as the analysis starts: the
    analysis runs (however long it takes: a loaded machine's is slower than the watch's sampling) and the report has
    its findings, with no note of a stop."""
    from tfmem_magic import pipeline

    analysed = []
    original = pipeline.Profiler._analyse_and_advise

    def slow(self, report, measured):
        time.sleep(0.3)
        original(self, report, measured)
        analysed.append(True)

    monkeypatch.setattr(pipeline.Profiler, "_analyse_and_advise", slow)
    rep = run_until_stopped_holding_it(shell)
    assert rep.stopped_for_memory and analysed, rep.notes
    assert not any(n.startswith("tfmem stopped its own work") for n in rep.notes), rep.notes
    assert [f.id for f in rep.findings][:1] == ["oom"]
