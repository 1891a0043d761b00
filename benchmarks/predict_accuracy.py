"""Accuracy of the what-if prediction: predicted vs measured TF peak, five Keras models, batch sizes over 16x.

For each model, one process runs the "cell" at the anchor batch under %%tfmem's engine (trace mode, as a user's
cell) and predicts the peak at every batch size twice: analytic (from the model, no extra run) and measured
(calibrated with probe steps of a clone). Then every batch size runs in fresh processes (the allocator's state must
not carry over), --repeats times, and its real peak is measured: the TF allocator peak over the cell's baseline
(the quantity reports and predictions give; BFC's chunk reuse makes it vary from run to run, so the median and the
spread are printed). The script prints the relative error per point and the max/mean per basis.

    python benchmarks/predict_accuracy.py [--batches 16,32,64,128,256] [--anchor 32] [--models mlp,cnn,...]

Targets (issue 4): measured basis max error <= 10%, analytic <= 30%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

SAMPLES = 1024  # rows of the synthetic dataset: one epoch is 4 to 64 steps over the batch sizes

MODELS = {
    "mlp": """
        m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)], name="mlp")
        x = np.random.rand(N, 784).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    "cnn": """
        m = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)], name="cnn")
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    "mobilenetv2": """
        m = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    "attention": """
        inp = keras.Input((64, 64))
        h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(inp, inp)
        h = keras.layers.LayerNormalization()(h + inp)
        h = keras.layers.Dense(256, activation="relu")(h)
        h = keras.layers.Dense(64)(h)
        out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
        m = keras.Model(inp, out, name="attention")
        x = np.random.rand(N, 64, 64).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    "cnn-bf16": """
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        m = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(),
                              keras.layers.Dense(10, dtype="float32")], name="cnn_bf16")
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
}

WORKER = """
import json, sys
import tfmem_magic
tfmem_magic.prepare()
import numpy as np, keras
from tfmem_magic.advise import prediction
N = {samples}
{build}
m.compile("adam", loss)
mode, batch, batches = {mode!r}, {batch}, {batches}
with tfmem_magic.profile(mode="trace") as p:  # as a user's cell runs; the allocator's peak covers the whole fit
    m.fit(x, y, batch_size=batch, epochs=1, verbose=0)
out = {{"measured": p.report.tf_peak_bytes, "requested": p.report.trace.peak_requested_bytes}}
if mode == "anchor":
    def both(w):
        return [w.peak_bytes, sum(w.split.values())]
    out["analytic"] = {{b: both(prediction.predict(p.report, batch_size=b)) for b in batches}}
    out["calibrated"] = {{b: both(prediction.predict(p.report, batch_size=b, calibrate=True)) for b in batches}}
    out["probes"] = prediction._cached_basis(p.report).calibration
print(json.dumps(out))
"""


def run(model: str, mode: str, batch: int, batches: list[int]) -> dict:
    code = WORKER.format(samples=SAMPLES, build=textwrap.dedent(MODELS[model]), mode=mode, batch=batch,
                         batches=batches)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CPU", "TF_ENABLE_ONEDNN"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {mode} batch {batch} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,32,64,128,256")
    parser.add_argument("--anchor", type=int, default=32)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="fresh-process runs per point (median; spread shown)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    errors: dict[str, list[float]] = {k: [] for k in ("analytic", "measured", "measured, requested bytes")}
    print(f"{'model':<12} {'batch':>5} | {'allocator peak (spread)':>24} {'analytic':>8} {'measured':>8} | "
          f"{'requested peak':>14} {'measured':>8}")
    for model in args.models.split(","):
        anchor = run(model, "anchor", args.anchor, batches)
        for batch in batches:
            runs = [run(model, "measure", batch, batches) for _ in range(args.repeats)]
            alloc = statistics.median(r["measured"] for r in runs)
            lo, hi = min(r["measured"] for r in runs), max(r["measured"] for r in runs)
            requested = statistics.median(r["requested"] for r in runs)
            a_alloc, m_alloc = anchor["analytic"][str(batch)][0], anchor["calibrated"][str(batch)][0]
            m_requested = anchor["calibrated"][str(batch)][1]  # the split's sum: the prediction before fragmentation
            row = {"analytic": (a_alloc - alloc) / alloc, "measured": (m_alloc - alloc) / alloc,
                   "measured, requested bytes": (m_requested - requested) / requested}
            if batch != args.anchor:  # at the anchor both bases give back the anchor's measurement by construction
                for key, value in row.items():
                    errors[key].append(abs(value))
            spread = f"{alloc / 2**20:.1f}Mi ({(lo - alloc) / alloc:+.0%}/{(hi - alloc) / alloc:+.0%})"
            mark = " (anchor)" if batch == args.anchor else ""
            print(f"{model:<12} {batch:>5} | {spread:>24} {row['analytic']:>+8.1%} {row['measured']:>+8.1%} | "
                  f"{requested / 2**20:>12.1f}Mi {row['measured, requested bytes']:>+8.1%}{mark}", flush=True)
        print(f"{'':<12} probes at batches {anchor['probes']['batches']}: {anchor['probes']['seconds']} s",
              flush=True)
    for basis, values in errors.items():
        print(f"{basis:>26}: max error {max(values):.1%}, mean {statistics.mean(values):.1%} over {len(values)} points")


if __name__ == "__main__":
    main()
