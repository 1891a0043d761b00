"""The what-if's `replicas` knob against real MultiWorkerMirroredStrategy workers on loopback: a `fit` cell at a
global batch of 256 in one process predicts one replica of two; two workers then run the same `fit` (tf_keras:
Keras 3's fit fails under that strategy on TensorFlow 2.21), each measuring itself with tfmem's quick mode.
benchmarks/replicas_check.py holds the runner and prints the full comparison (two models, 2 and 3 workers)."""

from __future__ import annotations

import pytest
from fresh import load_benchmark

from tfmem_magic.advise.bands import ANALYTIC_BAND

pytestmark = pytest.mark.slow


def test_one_replica_of_two_is_predicted_within_the_band_of_each_workers_measured_peak():
    pytest.importorskip("tf_keras")
    bench = load_benchmark("replicas_check")
    (row,) = bench.check("mlp", 256, [2], calibrate=False, say=lambda _line: None)
    predicted, measured = row["predicted"], row["measured"]
    # each worker measured its own allocator (the devices of a tf.distribute worker carry the task in their names)
    assert len(measured) == 2 and all(m > 8 * 2**20 for m in measured), measured
    # the prediction's own stated band holds for both workers: what a user reads is true of each
    for peak in measured:
        assert predicted * (1 - ANALYTIC_BAND) <= peak <= predicted * (1 + ANALYTIC_BAND), (predicted, measured)
    # each worker's own report knows it is one replica of two: its global batch, its what-if at its own settings
    # gives back what it measured, and asked for one process at the global batch it predicts the cell's peak
    for worker in row["workers"]:
        assert worker["replicas"] == 2 and worker["model_batch"] == 256, worker
        # anchored on its own measurement, its own settings give back its peak; one CI run of 0acbf9f got 27.4 MB
        # for a 23.8 MB peak (not reproduced here; the worker now prints its basis with the result): the stated band
        # is what must hold, and the worker's numbers are in the message when it does not
        assert worker["anchored"] and worker["status"] == "ok", worker
        assert abs(worker["own"] - worker["peak"]) <= ANALYTIC_BAND * worker["peak"], worker
        assert abs(worker["as_one"] - row["cell"]) <= ANALYTIC_BAND * row["cell"], (worker, row["cell"])
