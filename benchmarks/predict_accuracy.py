"""Accuracy of the what-if prediction: predicted vs measured TF peak over a zoo of Keras models and feeding styles.

For each model, one process runs the "cell" at the anchor batch under %%tfmem's engine (trace mode, as a user's
cell) and predicts the peak at every batch size twice, each with the band it prints: analytic (from the model, no
extra run) and calibrated (what `predict(..., calibrate=True)` gives: the step replay where its self-check passed,
else the probes' parts). Every other batch size runs in fresh processes (the allocator's state must not carry over),
--repeats times, and its real peak is measured: the TF allocator peak over the cell's baseline (the quantity reports
and predictions give; BFC's chunk reuse makes it vary from run to run, so the median and the spread are kept). Each
model is fed the way its kind usually is: numpy arrays, a tf.data pipeline (batch -> take -> prefetch) or a Python
generator; every run trains at most STEPS steps (the peak comes in the first steps: the optimizer's slots are made
in the first, BFC's chunks are reused after). Each basis also names the largest batch for a process budget
(`largest_batch`: the most the fresh runs grew the process by at the largest batch scored), and that batch runs
fresh again.

    python benchmarks/predict_accuracy.py             # the first five models (arrays)
    python benchmarks/predict_accuracy.py --zoo       # all models, batches 8 to 256 (about 70 minutes, 2 cores)
    python benchmarks/predict_accuracy.py --models resnet50,gru --batches 16,64 --repeats 3
    python benchmarks/predict_accuracy.py --runs runs.json --out benchmarks/results/predict_accuracy.json
    python benchmarks/doc_tables.py --write      # docs/accuracy.md from that results file

The scores (errors, band coverage, xMem's three figures, the named batches) are benchmarks/doc_tables.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import textwrap
import time

import doc_tables
from _fresh import run_fresh_json

SAMPLES = 512  # rows of each synthetic dataset (arrays: the in-memory copy fit makes is the same at every batch)
STEPS = 6  # training steps per run, at most
FIRST_FIVE = ["mlp", "cnn", "mobilenetv2", "attention", "cnn-bf16"]
BIG = {"resnet50", "efficientnetb0"}  # --big-repeats fresh runs per point (their runs take ~4x longer)
IMAGES = """
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
"""  # indented as the model code it follows (the worker dedents them together)

MODELS = {  # name -> (how the cell feeds it, the code that builds m, x, y and loss)
    "mlp": (
        "arrays",
        """
        m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)], name="mlp")
        x = np.random.rand(N, 784).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    ),
    "cnn": (
        "arrays",
        """
        m = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)], name="cnn")
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    ),
    "mobilenetv2": (
        "arrays",
        """
        m = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    ),
    "attention": (
        "arrays",
        """
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
    ),
    "cnn-bf16": (
        "arrays",
        """
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        m = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(),
                              keras.layers.Dense(10, dtype="float32")], name="cnn_bf16")
        x = np.random.rand(N, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, N)
        loss = "sparse_categorical_crossentropy"
    """,
    ),
    "resnet50": (
        "dataset",
        """
        m = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    """
        + IMAGES,
    ),
    "efficientnetb0": (
        "generator",
        """
        m = keras.applications.EfficientNetB0(weights=None, input_shape=(64, 64, 3), classes=10)
    """
        + IMAGES,
    ),
    "mobilenetv3small": (
        "dataset",
        """
        m = keras.applications.MobileNetV3Small(weights=None, input_shape=(64, 64, 3), classes=10)
    """
        + IMAGES,
    ),
    "unet": (
        "arrays",
        """
        L = keras.layers
        inp = keras.Input((64, 64, 1))
        c1 = L.Conv2D(16, 3, padding="same", activation="relu")(inp)
        c2 = L.Conv2D(32, 3, padding="same", activation="relu")(L.MaxPool2D()(c1))
        c3 = L.Conv2D(64, 3, padding="same", activation="relu")(L.MaxPool2D()(c2))
        u2 = L.Conv2D(32, 3, padding="same", activation="relu")(L.Concatenate()([L.UpSampling2D()(c3), c2]))
        u1 = L.Conv2D(16, 3, padding="same", activation="relu")(L.Concatenate()([L.UpSampling2D()(u2), c1]))
        m = keras.Model(inp, L.Conv2D(1, 1, activation="sigmoid")(u1), name="unet")
        x = np.random.rand(N, 64, 64, 1).astype("float32"); y = (np.random.rand(N, 64, 64, 1) > 0.5).astype("float32")
        loss = "binary_crossentropy"
    """,
    ),
    "lstm-text": (
        "dataset",
        """
        m = keras.Sequential([keras.Input((None,), dtype="int64"), keras.layers.Embedding(5000, 64),
                              keras.layers.LSTM(64), keras.layers.Dense(2)], name="lstm_text")
        x = np.random.randint(0, 5000, (N, 100)); y = np.random.randint(0, 2, N)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    """,
    ),
    "transformer": (
        "generator",
        """
        L = keras.layers
        inp = keras.Input((64,), dtype="int64")
        h = L.Embedding(2000, 64)(inp)
        for _ in range(2):
            h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=4, key_dim=16)(h, h))
            h = L.LayerNormalization()(h + L.Dense(64)(L.Dense(128, activation="relu")(h)))
        m = keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling1D()(h)), name="transformer")
        x = np.random.randint(0, 2000, (N, 64)); y = np.random.randint(0, 2, N)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    """,
    ),
    "multi-output": (
        "arrays",
        """
        L = keras.layers
        inp = keras.Input((32, 32, 3), name="image")
        h = L.GlobalAveragePooling2D()(L.Conv2D(64, 3, activation="relu")(L.Conv2D(32, 3, activation="relu")(inp)))
        m = keras.Model(inp, {"kind": L.Dense(10, name="kind")(h), "size": L.Dense(1, name="size")(h)},
                        name="multi_output")
        x = np.random.rand(N, 32, 32, 3).astype("float32")
        y = {"kind": np.random.randint(0, 10, N), "size": np.random.rand(N, 1).astype("float32")}
        loss = {"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"}
    """,
    ),
    # held back: models the predictor was never tuned on (docs/accuracy.md, "Held back")
    "bilstm": (
        "arrays",
        """
        L = keras.layers
        m = keras.Sequential([keras.Input((80, 24)), L.Bidirectional(L.LSTM(48, return_sequences=True)),
                              L.Bidirectional(L.LSTM(32)), L.Dense(5)], name="bilstm")
        x = np.random.rand(N, 80, 24).astype("float32"); y = np.random.randint(0, 5, N)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    """,
    ),
    "wide-cnn": (
        "arrays",
        """
        L = keras.layers
        m = keras.Sequential([keras.Input((48, 48, 3)), L.Conv2D(96, 5, padding="same", activation="relu"),
                              L.BatchNormalization(), L.MaxPool2D(),
                              L.Conv2D(192, 3, padding="same", activation="relu"),
                              L.GlobalAveragePooling2D(), L.Dropout(0.2), L.Dense(20)], name="wide_cnn")
        x = np.random.rand(N, 48, 48, 3).astype("float32"); y = np.random.randint(0, 20, N)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    """,
    ),
    "autoencoder": (
        "arrays",
        """
        L = keras.layers
        inp = keras.Input((32, 32, 3))
        h = L.Conv2D(32, 3, strides=2, padding="same", activation="relu")(inp)
        h = L.Conv2D(64, 3, strides=2, padding="same", activation="relu")(h)
        h = L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(h)
        out = L.Conv2DTranspose(3, 3, strides=2, padding="same", activation="sigmoid")(h)
        m = keras.Model(inp, out, name="autoencoder")
        x = np.random.rand(N, 32, 32, 3).astype("float32"); y = x
        loss = "mse"
    """,
    ),
    "gru": (
        "generator",
        """
        m = keras.Sequential([keras.Input((100, 16)), keras.layers.GRU(64), keras.layers.Dense(10)], name="gru")
        x = np.random.rand(N, 100, 16).astype("float32"); y = np.random.randint(0, 10, N)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    """,
    ),
}

WORKER = """
import json, sys
import tfmem_magic
tfmem_magic.prepare()
import numpy as np, keras, tensorflow as tf
from tfmem_magic.advise import bases, prediction
N = {samples}
{build}
m.compile("adam", loss)
mode, style, batch, batches = {mode!r}, {style!r}, {batch}, {batches}
steps = max(1, min(N // batch, {steps}))

def rows(i):
    return keras.tree.map_structure(lambda a: a[i * batch:(i + 1) * batch], (x, y))

def generator():
    for i in range(steps):
        yield rows(i)

if style == "arrays":
    train = lambda: m.fit(x, y, batch_size=batch, steps_per_epoch=steps, epochs=1, verbose=0)
elif style == "dataset":
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).take(steps).prefetch(2)
    train = lambda: m.fit(data, epochs=1, verbose=0)
else:
    train = lambda: m.fit(generator(), epochs=1, verbose=0)
# the cell runs as a user's does (trace mode); the runs it is checked against need only the allocator's peak over
# the whole fit, which the profiler does not change (quick mode: no trace, a third of the time)
with tfmem_magic.profile(mode="trace" if mode == "anchor" else "quick") as p:
    train()
rss = p.report.rss
out = {{"measured": p.report.tf_peak_bytes, "grown": rss.peak_bytes - rss.baseline_bytes,
        "batch read": p.report.model.batch_size}}
if mode == "anchor":
    # the process may grow by what the fresh runs grew by at the largest batch scored (median), from this cell's start
    budget = rss.baseline_bytes + {budget}
    # each basis' peak and printed band at every batch, and the batch `largest_batch` names for the budget (before
    # calibration: the analytic basis is the report's until `calibrate=True` measures one)
    answers = [prediction.predict(p.report, batch_size=b) for b in batches]
    out["analytic"] = {{b: a.peak_bytes for b, a in zip(batches, answers)}}
    out["analytic band"] = {{b: a.error_band for b, a in zip(batches, answers)}}
    out["analytic band below"] = {{b: a.below for b, a in zip(batches, answers)}}
    out["analytic named"] = tfmem_magic.largest_batch(p.report, budget=budget)
    answers = [tfmem_magic.predict(p.report, batch_size=b, calibrate=True) for b in batches]
    out["calibrated"] = {{b: a.peak_bytes for b, a in zip(batches, answers)}}  # the replay where its check passed
    out["calibrated band"] = {{b: a.error_band for b, a in zip(batches, answers)}}
    out["calibrated band below"] = {{b: a.below for b, a in zip(batches, answers)}}
    out["calibrated basis"] = answers[-1].basis
    out["calibrated named"] = tfmem_magic.largest_batch(p.report, budget=budget)
    import dataclasses
    basis = p.report.whatif_basis
    parts = dataclasses.replace(basis, replay=None, name="measured")  # the probes' parts alone, as before the replay
    out["parts"] = {{b: prediction.peak_at(parts, dataclasses.replace(basis.knobs, batch_size=b)) for b in batches}}
    curve = basis.replay
    # the replay with the smaller of its two op orders' changes (the prediction takes the larger)
    spread = {{b: (lambda c: c[1] - c[0])(bases.replay_change(curve, b, batch)) if curve and curve.passed else 0
              for b in batches}}
    out["replay_low"] = {{b: out["calibrated"][b] - round(spread[b]) for b in batches}}
    out["probes"] = basis.calibration
    out["replay"] = {{"passed": bool(curve and curve.passed), "why_not": curve.why_not if curve else "",
                     "seconds": curve.seconds if curve else None, "probes": curve.probes if curve else None,
                     "cross": curve.cross_error if curve else None,
                     "own": curve.own_error if curve else None,
                     "curve": [[b, one, two] for b, one, two in zip(curve.batches, curve.peaks, curve.second_peaks)]
                              if curve else []}}
print(json.dumps(out))
"""


def run(model: str, mode: str, batch: int, batches: list[int], budget: int = 0) -> dict:
    style, build = MODELS[model]
    code = WORKER.format(
        samples=SAMPLES,
        build=textwrap.dedent(build),
        mode=mode,
        style=style,
        batch=batch,
        batches=batches,
        steps=STEPS,
        budget=budget,
    )
    result = run_fresh_json(code, f"{model} {mode} batch {batch}")
    assert result["batch read"] == batch, (model, result["batch read"], batch)  # the batch read from what was fed
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", action="store_true", help="all models, batches 8 to 256")
    parser.add_argument("--batches", default=None, help="default 16,32,64,128,256 (--zoo: 8,16,32,64,128,256)")
    parser.add_argument("--anchor", type=int, default=32)
    parser.add_argument("--models", default=None)
    parser.add_argument("--repeats", type=int, default=5, help="fresh-process runs per point (median; spread shown)")
    parser.add_argument("--big-repeats", type=int, default=3, help=f"runs per point for {', '.join(sorted(BIG))}")
    parser.add_argument(
        "--cells",
        type=int,
        default=1,
        help="runs of each model's cell (each predicts every "
        "batch; the cell's own run varies too, so each is scored; the tables show their range)",
    )
    parser.add_argument(
        "--runs",
        default=None,
        help="a JSON file of fresh-run peaks: read (runs already there are "
        "not repeated, and all of them are used: a change to the predictor needs only the cells "
        "rerun) and written",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="write every number to this results file (benchmarks/doc_tables.py renders docs/accuracy.md "
        "from benchmarks/results/predict_accuracy.json)",
    )
    args = parser.parse_args()
    models = args.models.split(",") if args.models else list(MODELS) if args.zoo else FIRST_FIVE
    batches = [int(b) for b in (args.batches or ("8,16,32,64,128,256" if args.zoo else "16,32,64,128,256")).split(",")]
    scored = [b for b in batches if b != args.anchor]
    started = time.perf_counter()
    saved: dict[str, list[list[int]]] = {}
    if args.runs and os.path.exists(args.runs):
        with open(args.runs) as existing:
            saved = json.load(existing)

    counts = {"new": 0, "reused": 0}  # fresh runs made by this invocation, and taken from the runs file

    def fresh(model: str, batch: int, repeats: int, named: bool = False) -> list[list[int]]:
        """Every fresh run of this point the runs file has, and new ones up to `repeats`: [TF peak, process growth].
        A named batch's runs are its own (a batch scored already is run again for it)."""
        key = f"{model} {MODELS[model][0]} {'named ' if named else ''}batch {batch}"
        runs = saved.get(key, [])
        counts["reused"] += min(len(runs), repeats)
        counts["new"] += max(0, repeats - len(runs))
        for _ in range(repeats - len(runs)):
            one = run(model, "measure", batch, batches)
            runs.append([one["measured"], one["grown"]])
        saved[key] = runs
        if args.runs:
            with open(args.runs, "w") as out:
                json.dump(saved, out, indent=1)
        return runs

    results: dict = {
        "command": "python benchmarks/predict_accuracy.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" if v is not True else f"--{k}"
            for k, v in vars(args).items()
            if v not in (None, False) and k not in ("runs", "out")
        ),
        "versions": _versions(),
        "anchor": args.anchor,
        "samples": SAMPLES,
        "steps": STEPS,
        "models": [],
    }
    print(
        f"{'model':<16} {'feed':<9} {'batch':>5} | {'allocator peak (spread)':>24} {'analytic':>9} {'calibrated':>10}"
    )
    for model in models:
        style = MODELS[model][0]
        repeats = args.big_repeats if model in BIG else args.repeats
        pairs = {str(b): fresh(model, b, repeats) for b in scored}
        runs = {b: [tf for tf, _ in both] for b, both in pairs.items()}
        grown = {b: [g for _, g in both] for b, both in pairs.items()}
        # the named batch's budget: the most the process grew by at the largest batch scored, so that batch fits it in
        # every run measured
        budget = max(grown[str(max(scored))])
        cells = [run(model, "anchor", args.anchor, batches, budget) for _ in range(max(1, args.cells))]
        for batch in scored:
            median = statistics.median(runs[str(batch)])
            lo, hi = min(runs[str(batch)]), max(runs[str(batch)])
            spread = f"{median / 2**20:.1f}Mi ({(lo - median) / median:+.0%}/{(hi - median) / median:+.0%})"
            errors = {
                basis: "/".join(f"{(c[basis][str(batch)] - median) / median:+.1%}" for c in cells)
                for basis in ("analytic", "calibrated")
            }
            print(
                f"{model:<16} {style:<9} {batch:>5} | {spread:>24} {errors['analytic']:>9} {errors['calibrated']:>10}",
                flush=True,
            )
        named = {c[f"{basis} named"] for c in cells for basis in ("analytic", "calibrated")} - {None}
        # a batch above the rows is those rows: fit runs them as one batch
        named_runs = {str(n): fresh(model, min(n, SAMPLES), max(1, repeats - 1), named=True) for n in sorted(named)}
        named_grown = {n: [g for _, g in both] for n, both in named_runs.items()}
        named_tf = {n: [tf for tf, _ in both] for n, both in named_runs.items()}
        for cell in cells:
            replay = cell["replay"]
            used = (
                f"replay probes {replay['probes']}, cross {replay['cross']:+.1%}, {replay['seconds']} s"
                if replay["passed"]
                else f"replay not used: {replay['why_not'][:160]}"
            )
            print(
                f"{'':<16} cell at batch {args.anchor}: {cell['measured'] / 2**20:.1f}Mi; probes at batches "
                f"{cell['probes']['batches']}: {cell['probes']['seconds']} s; {used}; named for the "
                f"process to grow by {budget / 2**20:.1f}Mi: analytic {cell['analytic named']}, "
                f"calibrated {cell['calibrated named']}",
                flush=True,
            )
        results["models"].append(
            {
                "model": model,
                "style": style,
                "budget": budget,
                "runs": runs,
                "grown": grown,
                "cells": cells,
                "named runs": named_grown,
                "named tf": named_tf,
            }
        )
    results["minutes"] = round((time.perf_counter() - started) / 60, 1)
    results["fresh runs"] = counts
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)
    print(doc_tables.render(results))


def _versions() -> dict:
    """The versions the fresh runs use (a child process: this one imports no TensorFlow)."""
    code = "import json, os, keras, tensorflow as tf; print(json.dumps({'tensorflow': tf.__version__, "
    code += "'keras': keras.__version__, 'cores': os.cpu_count()}))"
    return run_fresh_json(code, "versions")


if __name__ == "__main__":
    main()
