"""The BFC simulator against a real CPU trace recorded in a fresh process (analyze/bfc.py; the simulator's unit
tests on hand-built and public traces are tests/unit/test_bfc.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tfmem_magic.analyze import bfc

MiB = 2**20


RECORD = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"
    os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = "4096"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np
    import tensorflow as tf
    import keras
    side, rows, batch = {side}, {rows}, {batch}
    x = np.random.rand(rows, side, side, 3).astype("float32")
    y = np.random.randint(0, 10, rows)
    tf.profiler.experimental.start(sys.argv[1], options=tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=2, python_tracer_level=0, device_tracer_level=0))
    model = {model}
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    tf.profiler.experimental.stop()
    print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
""")
MODELS = {
    # a few regions, ~3,000 events
    "cnn": dict(
        side=16,
        rows=256,
        batch=64,
        model="keras.Sequential([keras.Input((16, 16, 3)), "
        'keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.Flatten(), keras.layers.Dense(10)])',
    ),
    # eight regions, the later ones mmapped at lower addresses than the earlier: its replay parted from TF's
    # placements when the regions' addresses were learnt from a first replay instead of read from the trace
    "efficientnet": dict(
        side=96,
        rows=70,
        batch=23,
        model="keras.applications.EfficientNetB0(input_shape=(96, 96, 3), weights=None, classes=10)",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_a_fresh_cpu_process_replays_to_the_byte(tmp_path, model):
    """A CPU trace that begins with TensorFlow's allocator empty (model built and trained inside it), with the CPU's
    BFC settings (allow_growth, the TF_CPU_BFC_MEM_LIMIT_IN_MB limit): exact, event by event and in placement."""
    pytest.importorskip("tensorflow")
    from tfmem_magic.measure import xplane

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    out = subprocess.run(
        [sys.executable, "-c", RECORD.format(**MODELS[model]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    peak = int(out.stdout.split()[-1])
    trace = xplane.read_file(next(tmp_path.glob("**/*.xplane.pb")), "CPU:0")
    assert trace.events.allocator == "bfc_cpu_allocator_for_gpu"
    check = bfc.self_check(trace.events)
    assert check.allow_growth and check.limit == 4096 * MiB and check.preexisting_bytes == 0
    regions = [hex(a) for a in check.prepared.region_addresses] if check.prepared else None
    where = f"first divergence at event {check.first_divergence} of {check.events}, regions {regions}"
    assert check.events_exact == check.events and check.chunks_exact == check.allocations, where
    assert check.placements_exact == check.allocations
    assert check.simulated_peak == check.traced_peak == peak and check.passed
