"""Accuracy and cost of the pre-flight: its prediction of a call's step at a large batch against the same call run
for real, each model in a fresh process, by both of its bases side by side: the step replay (a clone's steps traced
at two small odd batches, about 1/14 and 1/9 of the call's or smaller where such probes' steps would cost more than
`preflight.REPLAY_PROBE_MACS`, replayed through the BFC simulator; the same uncapped as "replay at 1/10") and the line
through two probe steps at 1/16 and 1/8 of the batch (what stands in where the replay cannot be used).

For each model, one process builds it, trains one small batch (TensorFlow is running, as in a notebook), asks the
pre-flight both ways (advise/preflight.py: `check` with no room, so the probes always run) and then runs the call at
the batch, unguarded, under tfmem's quick mode. It prints the predicted and measured TF allocator growth of the
step, the predicted and measured process peak (RSS), its error over the peak and over what the process grew by in
the call (what the band widens), and the seconds each pre-flight took.

    .venv/bin/python benchmarks/preflight_accuracy.py [--models cnn,mlp,...]

The bands the pre-flight uses (advise/bands.py: PREFLIGHT_GROWTH_HIGH, PREFLIGHT_GROWTH_LOW, PROBE_LINE_BAND) are set
from these errors: docs/preflight.md.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time

from _fresh import run_fresh_json

MODELS = {  # name -> (batch, code that builds m, x, y; or m and call(batch), for a model not compiled as the others)
    "cnn": (
        1024,
        """
        m = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
        x = np.random.rand(2048, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 2048)
    """,
    ),
    "mlp": (
        8192,
        """
        m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
        x = np.random.rand(16384, 784).astype("float32"); y = np.random.randint(0, 10, 16384)
    """,
    ),
    "mobilenetv2": (
        512,
        """
        m = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)
        x = np.random.rand(1024, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 1024)
    """,
    ),
    "lstm": (
        1024,
        """
        m = keras.Sequential([keras.Input((100, 32)), keras.layers.LSTM(128), keras.layers.Dense(10)])
        x = np.random.rand(2048, 100, 32).astype("float32"); y = np.random.randint(0, 10, 2048)
    """,
    ),
    "attention": (
        512,
        """
        inp = keras.Input((64, 64))
        h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(inp, inp)
        h = keras.layers.Dense(256, activation="relu")(keras.layers.LayerNormalization()(h + inp))
        m = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
        x = np.random.rand(1024, 64, 64).astype("float32"); y = np.random.randint(0, 10, 1024)
    """,
    ),
    # the replay's probes capped by their step's cost far below 1/10 of the batch (preflight.REPLAY_PROBE_MACS)
    "mlp-wide": (
        16384,
        """
        m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(4096, activation="relu"),
                              keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(10)])
        x = np.random.rand(32768, 784).astype("float32"); y = np.random.randint(0, 10, 32768)
    """,
    ),
    "gru": (
        4096,
        """
        m = keras.Sequential([keras.Input((200, 32)), keras.layers.GRU(128), keras.layers.Dense(10)])
        x = np.random.rand(8192, 200, 32).astype("float32"); y = np.random.randint(0, 10, 8192)
    """,
    ),
    # keras-io's DCGAN (benchmarks/custom_step_accuracy.py's, 32x32): a train_step of its own, two Adams not built
    # yet (never fitted: the step the pre-flight saves builds their slots). Only the replay: the line needs a clone
    "dcgan": (
        1024,
        "from custom_step_accuracy import PROGRAMS\n"
        "exec(textwrap.dedent(PROGRAMS['dcgan'][0]).replace('data = data.batch(BATCH).take(4)', ''))\n"
        "m = gan\ntf.zeros((4, 4)) + 1  # TensorFlow is running\n"
        "call = lambda b: gan.fit(data.batch(b).take(2), epochs=1, verbose=0)",
    ),
}

WORKER = """
import json, sys, textwrap, time, psutil
import tfmem_magic
tfmem_magic.prepare()
import numpy as np, keras, tensorflow as tf
from keras import layers
from tfmem_magic.advise import preflight
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.errors import TfmemUsageError
sys.path.insert(0, {here!r})
{build}
if "call" not in globals():
    m.compile("adam", "sparse_categorical_crossentropy")
    m.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)  # TensorFlow is running, the optimizer is built
    call = lambda b: m.fit(x, y, batch_size=b, epochs=1, steps_per_epoch=2, verbose=0)
batch = {batch}
seen = {{}}

def spy(model, what, use, threshold, rss, source, current, held):  # the cell's own pre-flight, forced to probe
    capped = preflight.REPLAY_PROBE_MACS
    for basis in ("replay", "replay at 1/10", "probes"):  # side by side, before the call runs
        started = time.perf_counter()
        # the replay's probes at 1/10 of the batch whatever their steps cost
        preflight.REPLAY_PROBE_MACS = 1e30 if basis == "replay at 1/10" else capped
        SESSION.preflight_replays.clear()  # a refusal's replay is kept for the next call: each basis probes
        if basis == "probes":  # the line through two probe steps, as where the replay cannot be used
            def refuse(*args, **kwargs):
                raise preflight.NoReplay("the benchmark's other basis")
            preflight.replayed_step = refuse
        try:
            info = preflight.check(model, what, use, 0, rss, current, held)
        except TfmemUsageError:  # a step of the model's own has no probes' line (it needs a clone)
            continue
        info.seconds = round(time.perf_counter() - started, 2)
        seen[basis] = info

with tfmem_magic.profile(mode="quick", preflight=True) as p:
    p._measurement._preflight = spy
    p._measurement.instrumentation.preflight = p._measurement._preflight_check()
    call(batch)
r = p.report
print(json.dumps({{basis: {{"step_predicted": info.step_bytes, "step_measured": r.tf_peak_bytes,
                           "rss_predicted": info.predicted_rss_bytes, "rss_measured": r.rss.peak_bytes,
                           "rss_before": info.rss_bytes, "probes": info.probe_batches, "seconds": info.seconds,
                           "basis": info.basis if basis != "replay at 1/10" else basis,
                           "note": info.replay_note}}
                  for basis, info in seen.items()}}))
"""


def run(name: str) -> dict:
    batch, build = MODELS[name]
    code = WORKER.format(build=textwrap.dedent(build), batch=batch, here=os.path.dirname(os.path.abspath(__file__)))
    return run_fresh_json(code, name, timeout=1200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    started = time.perf_counter()
    print(
        f"{'model':<12} {'batch':>5} {'probes':>9} | {'step pred':>9} {'measured':>9} {'error':>6} | "
        f"{'RSS pred':>9} {'measured':>9} {'error':>6} {'growth':>7} | {'seconds':>7} basis"
    )
    errors: dict[str, list[float]] = {}
    growths: dict[str, list[float]] = {}
    for name in args.models.split(","):
        for basis, r in run(name).items():
            step_error = (r["step_predicted"] - r["step_measured"]) / r["step_measured"]
            rss_error = (r["rss_predicted"] - r["rss_measured"]) / r["rss_measured"]
            # what the band widens: what the process grows by over what it held before the call
            growth_error = (r["rss_predicted"] - r["rss_measured"]) / max(1, r["rss_measured"] - r["rss_before"])
            errors.setdefault(r["basis"], []).append(rss_error)
            growths.setdefault(r["basis"], []).append(growth_error)
            mib = 2**20
            print(
                f"{name:<12} {MODELS[name][0]:>5} {'/'.join(map(str, r['probes'])):>9} | "
                f"{r['step_predicted'] / mib:>8.0f}M {r['step_measured'] / mib:>8.0f}M {step_error:>+6.1%} | "
                f"{r['rss_predicted'] / mib:>8.0f}M {r['rss_measured'] / mib:>8.0f}M {rss_error:>+6.1%} "
                f"{growth_error:>+7.1%} | {r['seconds']:>7.1f} {r['basis']}",
                flush=True,
            )
            if r["note"] and r["basis"] != basis:
                print(f"    the replay was not used: {r['note']}")
    for basis in errors:
        print(
            f"{basis}: process peak max |error| {max(abs(e) for e in errors[basis]):.1%}, its growth over the "
            f"call's start max |error| {max(abs(e) for e in growths[basis]):.1%}"
        )
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
