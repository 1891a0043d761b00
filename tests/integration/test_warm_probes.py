"""Probe processes started ahead of a pre-flight (advise/probe_runs.py, `warm_up`; docs/preflight.md, "Warm
probes"): they wait with TensorFlow imported, a probe takes one of its own Keras and environment, gives the answer a
new process gives, and none outlives its use, a change of environment, `%tfmem limit off` or its idle time."""

from __future__ import annotations

import time

import psutil
import pytest

from tfmem_magic.advise import probe_runs
from tfmem_magic.measure.feeding import LEAF

pytestmark = pytest.mark.slow
ROOM = probe_runs.WARM_PROBES * (probe_runs.PROBE_PROCESS_BYTES + probe_runs.WARM_OWN_BYTES) + (1 << 30)
BATCH = {"x": {LEAF: [[1024], "float32"]}, "y": {LEAF: [[16], "float32"]}}


@pytest.fixture
def room():
    if psutil.virtual_memory().available < ROOM:
        pytest.skip("the machine has no room for warm probes: warm_up starts none (tested below)")
    yield
    probe_runs.end_warm()


def model():
    import keras

    m = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096), keras.layers.Dense(16)])
    m.compile("adam", "mse")
    return m


def test_a_probe_takes_a_warm_process_and_answers_as_a_new_one(room):
    cold = probe_runs.probe_peaks(model(), [16, 64], True, BATCH, True)
    assert probe_runs.warm_up("keras") == probe_runs.WARM_PROBES
    waiting = [p.proc.pid for p in probe_runs._warm]
    used = probe_runs._warm_used
    warm = probe_runs.probe_peaks(model(), [16, 64], True, BATCH, True)
    assert probe_runs._warm_used == used + 1 and probe_runs.warm_waiting() == probe_runs.WARM_PROBES - 1
    assert set(warm) == set(cold) == {16, 64}
    # the same step in a fresh allocator: the same bytes, within what two new processes differ by (a few MB of
    # buffers come and go between runs: 50.5-51.4 MB here, within 0.2%)
    for batch in (16, 64):
        assert abs(warm[batch][1] - cold[batch][1]) <= 0.05 * cold[batch][1], (warm, cold)
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in waiting[:1]
    ), "the process a probe took is gone after its use"


def test_a_warm_probe_is_of_its_environment_and_ends_with_the_limit(room, monkeypatch):
    probe_runs.warm_up("keras")
    first = [p.proc for p in probe_runs._warm]
    monkeypatch.setenv("TFMEM_TEST_OTHER", "1")  # the kernel's environment changed: those probes would not see it
    assert probe_runs._take_warm("keras") is None
    probe_runs.warm_up("keras")
    assert all(p.poll() is not None for p in first) and probe_runs.warm_waiting() == probe_runs.WARM_PROBES
    monkeypatch.setattr(probe_runs, "WARM_IDLE_S", 0.0)  # waited too long: ended, not taken
    time.sleep(0.01)
    assert probe_runs._take_warm("keras") is None and probe_runs.warm_waiting() == 0


def test_limit_off_ends_them_and_no_room_starts_none(shell, monkeypatch):
    if psutil.virtual_memory().available >= ROOM:
        probe_runs.warm_up("keras")
        assert probe_runs.warm_waiting() == probe_runs.WARM_PROBES
        shell.run_line_magic("tfmem", "limit off")
        assert probe_runs.warm_waiting() == 0

    class Tight:
        available = ROOM - 1

    monkeypatch.setattr(probe_runs.psutil, "virtual_memory", lambda: Tight)
    assert probe_runs.warm_up("keras") == 0 and probe_runs.warm_waiting() == 0
