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


BFC_CAP_PROGRAM = """
import os, sys, psutil
from collections import namedtuple
real = psutil.virtual_memory()
small = real._replace(total=256 * 2**20)  # a machine of 256 MiB, swap aside
psutil.virtual_memory = lambda: small
psutil.swap_memory = lambda: namedtuple("swap", "total")(0)
import tfmem_magic
tfmem_magic.prepare()
import tensorflow as tf
print("CAP", os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB"))
try:
    t = tf.ones((96 * 2**20,), tf.float32)  # 384 MiB: more than this 'machine' has
    print("ALLOCATED", int(t.shape[0]))
except tf.errors.ResourceExhaustedError:
    print("REFUSED")
"""


@pytest.mark.parametrize("user_cap", [None, "2048"])
def test_the_cpu_bfc_cap_follows_the_machine_unless_the_user_set_it(user_cap):
    """TensorFlow caps its CPU BFC allocator at 64 GiB when TF_CPU_BFC_MEM_LIMIT_IN_MB is unset; tfmem switches BFC on,
    so it sets the cap to what the machine holds (here a pretend 256 MiB: a 384 MiB tensor is refused, which shows
    the cap is in force), and a cap the user set is left alone (the same tensor fits)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    if user_cap:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = user_cap
    out = subprocess.run(
        [sys.executable, "-c", BFC_CAP_PROGRAM], capture_output=True, text=True, env=env, timeout=300
    ).stdout
    if user_cap:
        assert f"CAP {user_cap}" in out and "ALLOCATED" in out, out
    else:
        assert "CAP 256" in out and "REFUSED" in out, out


def test_leftover_trace_folders_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    from tfmem_magic.measure.tracer import TRACE_DIR_PREFIX, remove_leftovers

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    import os

    (tmp_path / f"{TRACE_DIR_PREFIX}{dead}-abc" / "s1").mkdir(parents=True)
    (tmp_path / f"{TRACE_DIR_PREFIX}{dead}-abc" / "s1" / "x.xplane.pb").write_bytes(b"x" * 100)
    (tmp_path / f"{TRACE_DIR_PREFIX}{os.getpid()}-mine").mkdir()  # this process's own: a measurement may be running
    (tmp_path / f"{TRACE_DIR_PREFIX}{os.getppid()}-alive").mkdir()  # a live process's
    (tmp_path / "tfmem-unrelated").mkdir()
    assert remove_leftovers(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{TRACE_DIR_PREFIX}{os.getpid()}-mine", f"{TRACE_DIR_PREFIX}{os.getppid()}-alive", "tfmem-unrelated"]
    )


def test_the_profiler_log_filter_keeps_everything_else_written_to_stderr(capfd):
    """fd 2 is the process's: while the profiler's INFO lines are filtered, the user's own stderr passes through."""
    import os

    from tfmem_magic.measure.tracer import _profiler_logs_filtered

    with _profiler_logs_filtered(True):
        os.write(2, b"I0000 00:00:1796064837.2 1 profiler_session.cc:103] Profiler session initializing.\n")
        os.write(2, b"the user's own warning\n")
        os.write(2, b"I0000 00:00:1796064837.3 1 profiler_session.cc:117] Profiler session started.\n")
    err = capfd.readouterr().err
    assert err == "the user's own warning\n"


def test_the_report_keeps_tensorflows_peak_counter_from_before_the_reset(shell):
    shell.run_cell("import tensorflow as tf\nbig = tf.ones((1024, 1024))\ndel big")
    result = shell.run_cell("%%tfmem --quick --as r\nsmall = tf.ones((16, 16))")
    assert result.success
    device = shell.user_ns["r"].tf["CPU:0"]
    assert device.peak_before_bytes is not None and device.peak_before_bytes >= 4 * 2**20
    assert device.peak_bytes < device.peak_before_bytes  # the counter now holds the cell's own peak
