"""Faults a long-lived kernel meets must never leave tfmem half-armed: the cell runs, its report says what was lost,
and the next cell is measured normally."""

from __future__ import annotations

import tempfile
import threading

import pytest

from tfmem_magic.measure.sampling import AllocatorStats

pytestmark = pytest.mark.slow


def test_an_unwritable_temp_dir_costs_the_trace_only_and_only_for_that_cell(shell, tmp_path):
    shell.run_cell("import tensorflow as tf")
    threads = {t.name for t in threading.enumerate()}
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp_path / "does-not-exist")
    try:
        result = shell.run_cell("%%tfmem --as r\nx = tf.ones((256, 256))\nran = True")
    finally:
        tempfile.tempdir = saved
    assert result.success and shell.user_ns["ran"] is True  # the user's code ran
    report = shell.user_ns["r"]
    assert report.mode == "quick" and any("could not start" in n for n in report.notes)
    assert AllocatorStats.nesting_depth() == 0  # nothing armed stays behind
    assert {t.name for t in threading.enumerate()} <= threads
    assert shell.run_cell("%%tfmem --as r2\ny = tf.ones((256, 256))").success
    after = shell.user_ns["r2"]
    assert after.mode == "trace" and not any("Nested" in n for n in after.notes) and after.trace.events > 0


def test_a_failure_while_arming_undoes_what_was_armed(monkeypatch):
    """Ctrl-C (or any error) between two probes: the ones already armed are disarmed before it leaves start()."""
    from tfmem_magic import pipeline
    from tfmem_magic.measure import instrument

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(instrument.Instrumentation, "install", interrupted)
    profiler = pipeline.Profiler(mode="quick")
    threads = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        profiler.start()
    assert AllocatorStats.nesting_depth() == 0
    assert set(threading.enumerate()) <= threads  # the sampler thread was stopped
    monkeypatch.undo()
    with pipeline.profile(mode="quick") as p:  # and the next measurement is not "nested"
        pass
    assert not any("Nested" in n for n in p.report.notes)


def test_the_plateau_rule_pauses_at_a_step_end_never_inside_a_step():
    """A step longer than the plateau rule's 1 s (a slow input, a long forward pass) whose big tensors come late
    (its backward pass) must be traced whole: once Keras' steps are known the pause waits for the step's end."""
    import time

    import tensorflow as tf  # noqa: F401  (the profiler)

    from tfmem_magic.measure.tracer import PLATEAU_S, Tracer

    for steps_known in (False, True):
        tracer = Tracer(time.perf_counter(), max_seconds=0)
        tracer.start()
        try:
            if steps_known:
                tracer.steps_begin()  # what fit's callback says at on_train_begin
            tracer.observe(0.0, 100, 100)
            tracer.observe(PLATEAU_S + 0.5, 100, 100)  # flat for longer than the rule's second, mid-step
            assert tracer.running == steps_known  # without steps: paused at once (a custom loop's first step)
            tracer.step_boundary()  # the step ended (batch end, or an optimizer's apply)
            assert not tracer.running and "plateau" in tracer._holds
            tracer.observe(PLATEAU_S + 1.0, 200, 200)  # the peak grows again: traced again
            assert tracer.running
        finally:
            tracer.finish()
