"""Calibration probes in a fresh Python process: a clone of the model (from its Keras config) trains one step at
each probe batch size on synthetic data under the profiler, and each step's peak comes back (allocator and
requested bytes).

Why another process: Keras 3 on TensorFlow 2.21 keeps a trained model's variables alive after the model is gone
(measured: 288 MiB of a 25M-parameter model stay allocated after `del` and `gc.collect()`, and
`keras.backend.clear_session()` does not free them), so probes in the kernel would leak a clone per batch size.
A fresh process also starts with an empty allocator, like the run being predicted. Cost: TensorFlow's start-up
(~4 s) and its runtime's RSS (~0.5 GiB) for the few seconds the probes take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from .errors import TfmemUsageError

TIMEOUT_S = 600
# steps of each probe's fit: fit's input pipeline holds prefetched batches once it is running, as in the cell
PIPELINE_STEPS = 4

_PROBE = r"""
import json, sys
spec = json.loads(sys.stdin.read())
import tfmem_magic
tfmem_magic.prepare()
import numpy as np, keras, tensorflow as tf
from tfmem_magic.engine import Options, Profiler
keras.mixed_precision.set_global_policy(spec["policy"])
model = keras.models.model_from_json(spec["model"])

def synthetic(shape, batch, dtype):
    dims = [batch] + [int(d) if d is not None else 1 for d in list(shape)[1:]]
    if "int" in str(dtype):
        return np.zeros(dims, str(dtype))
    return np.random.default_rng(0).random(dims, dtype="float32")

if spec["train"]:
    model.compile_from_config(spec["compile"])
STEPS = spec["steps"]

def data(batch):
    inputs = [synthetic(t.shape, batch, t.dtype.name if hasattr(t.dtype, "name") else t.dtype) for t in model.inputs]
    x = inputs[0] if len(inputs) == 1 else inputs
    if not spec["train"]:
        return x, None
    if spec["target"] is not None:
        return x, np.zeros((batch, *spec["target"][0]), spec["target"][1])
    out = model(x)  # targets shaped like the outputs (a model trained from a dataset)
    return x, (np.zeros(tuple(out.shape), "float32") if not isinstance(out, (list, tuple)) else
               [np.zeros(tuple(o.shape), "float32") for o in out])

peaks = {}
for batch in spec["batches"]:
    if spec["pipeline"]:  # the cell gave fit/predict its arrays: Keras' own input pipeline, as there
        # as tensors made before the probe: fit copies numpy arrays, and a copy of the probe's arrays would grow
        # with the probe's batch (the cell's copy is a part of its own, from the arrays' size)
        x, y = [None if v is None else keras.tree.map_structure(tf.constant, v) for v in data(batch * STEPS)]
        if spec["train"]:
            step = lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        else:
            step = lambda: model.predict(x, batch_size=batch, verbose=0)
    else:
        x, y = data(batch)
        step = (lambda: model.train_on_batch(x, y)) if spec["train"] else (lambda: model.predict_on_batch(x))
    step()  # the first run builds the optimizer's slots and traces the graph
    probe = Profiler(Options(mode="trace", publish=False, label="tfmem calibration probe"))
    with probe:
        step()
    trace = probe.report.trace
    peaks[batch] = [probe.report.tf_peak_bytes, trace.peak_requested_bytes if trace is not None else None]
print("TFMEM-PROBE " + json.dumps(peaks))
"""


def probe_peaks(model: Any, batches: list[int], train: bool, target: tuple[tuple, str] | None,
                pipeline: bool = False) -> dict[int, tuple[int, int]]:
    """Per batch size, one step of a clone of `model` (with `pipeline`, a few steps of fit/predict on arrays, as the
    cell ran them): the allocator's peak and the peak of the bytes the step requested, both over the step's start.
    The requested bytes grow in a straight line with the batch; the allocator's chunks add BFC's fragmentation on
    top, which varies from run to run (DESIGN.md §1)."""
    import keras

    try:
        spec = {"model": model.to_json(), "batches": batches, "train": train, "pipeline": pipeline,
                "steps": PIPELINE_STEPS,
                "target": [list(target[0]), target[1]] if target is not None else None,
                "compile": model.get_compile_config() if train else None,
                "policy": keras.mixed_precision.global_policy().name}
        payload = json.dumps(spec)
    except (TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        raise TfmemUsageError(f"calibration needs a model Keras can rebuild from its config (Sequential or "
                              f"functional, registered custom layers): {type(exc).__name__}: {str(exc)[:200]}") from exc
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        run = subprocess.run([sys.executable, "-c", _PROBE], input=payload, capture_output=True, text=True,
                             env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TfmemUsageError(f"calibration probes took more than {TIMEOUT_S} s; the analytic basis stays in use") \
            from None
    line = next((x for x in run.stdout.splitlines() if x.startswith("TFMEM-PROBE ")), None)
    if run.returncode != 0 or line is None:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise TfmemUsageError(f"calibration probes failed ({last[:300]}); the analytic basis stays in use")
    peaks = {int(k): tuple(v) for k, v in json.loads(line.split(" ", 1)[1]).items()}
    if any(None in v for v in peaks.values()):
        raise TfmemUsageError("calibration needs TensorFlow's allocator statistics, which the probe process did not "
                              "have")
    return peaks
