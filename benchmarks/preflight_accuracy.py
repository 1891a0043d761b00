"""Accuracy and cost of the pre-flight: its prediction of a call's step at a large batch (from two probe steps of a
clone at 1/16 and 1/8 of the batch) against the same call run for real, each model in a fresh process.

For each model, one process builds it, trains one small batch (TensorFlow is running, as in a notebook), asks the
pre-flight (advise/preflight.py: `check` with no room, so the probes always run) and then runs the call at the
batch, unguarded, under tfmem's quick mode. It prints the predicted and measured TF allocator growth of the step,
the predicted and measured process peak (RSS), their errors, and the seconds the pre-flight took.

    .venv/bin/python benchmarks/preflight_accuracy.py [--models cnn,mlp,...]

The band the pre-flight uses (preflight.BAND) is set from these errors: docs/preflight.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

MODELS = {  # name -> (batch, code that builds m, x, y)
    "cnn": (1024, """
        m = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
        x = np.random.rand(2048, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 2048)
    """),
    "mlp": (8192, """
        m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
        x = np.random.rand(16384, 784).astype("float32"); y = np.random.randint(0, 10, 16384)
    """),
    "mobilenetv2": (512, """
        m = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)
        x = np.random.rand(1024, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 1024)
    """),
    "lstm": (1024, """
        m = keras.Sequential([keras.Input((100, 32)), keras.layers.LSTM(128), keras.layers.Dense(10)])
        x = np.random.rand(2048, 100, 32).astype("float32"); y = np.random.randint(0, 10, 2048)
    """),
    "attention": (512, """
        inp = keras.Input((64, 64))
        h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(inp, inp)
        h = keras.layers.Dense(256, activation="relu")(keras.layers.LayerNormalization()(h + inp))
        m = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
        x = np.random.rand(1024, 64, 64).astype("float32"); y = np.random.randint(0, 10, 1024)
    """),
}

WORKER = """
import json, time, psutil
import tfmem_magic
tfmem_magic.prepare()
import numpy as np, keras, tensorflow as tf
from tfmem_magic.advise import preflight
from tfmem_magic.measure.instrument import Instrumentation
{build}
m.compile("adam", "sparse_categorical_crossentropy")
m.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)  # TensorFlow is running, the optimizer is built
batch = {batch}
seen = {{}}

def spy(model, call, use, threshold, rss, source, current, held):  # the cell's own pre-flight, forced to probe
    started = time.perf_counter()
    info = preflight.check(model, call, use, 0, rss, current, held)
    info.seconds = round(time.perf_counter() - started, 2)
    seen["info"] = info

with tfmem_magic.profile(mode="quick", preflight=True) as p:
    p._measurement._preflight = spy
    p._measurement.instrumentation.preflight = p._measurement._preflight_check()
    m.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=2, verbose=0)
info, r = seen["info"], p.report
print(json.dumps({{"step_predicted": info.step_bytes, "step_measured": r.tf_peak_bytes,
                  "rss_predicted": info.predicted_rss_bytes, "rss_measured": r.rss.peak_bytes,
                  "probes": info.probe_batches, "seconds": info.seconds}}))
"""


def run(name: str) -> dict:
    batch, build = MODELS[name]
    code = WORKER.format(build=textwrap.dedent(build), batch=batch)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CPU", "TF_ENABLE_ONEDNN"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"{'model':<12} {'batch':>5} {'probes':>9} | {'step pred':>9} {'measured':>9} {'error':>6} | "
          f"{'RSS pred':>9} {'measured':>9} {'error':>6} | {'seconds':>7}")
    errors = []
    for name in args.models.split(","):
        r = run(name)
        step_error = (r["step_predicted"] - r["step_measured"]) / r["step_measured"]
        rss_error = (r["rss_predicted"] - r["rss_measured"]) / r["rss_measured"]
        errors.append(rss_error)
        mib = 2**20
        print(f"{name:<12} {MODELS[name][0]:>5} {'/'.join(map(str, r['probes'])):>9} | "
              f"{r['step_predicted'] / mib:>8.0f}M {r['step_measured'] / mib:>8.0f}M {step_error:>+6.1%} | "
              f"{r['rss_predicted'] / mib:>8.0f}M {r['rss_measured'] / mib:>8.0f}M {rss_error:>+6.1%} | "
              f"{r['seconds']:>7.1f}", flush=True)
    print(f"process peak: max |error| {max(abs(e) for e in errors):.1%}; took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
