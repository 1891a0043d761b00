"""Accuracy of the what-if prediction: predicted vs measured TF peak over a zoo of Keras models and feeding styles.

For each model, one process runs the "cell" at the anchor batch under %%tfmem's engine (trace mode, as a user's
cell) and predicts the peak at every batch size twice: analytic (from the model, no extra run) and measured
(calibrated with probe steps of a clone). Then every other batch size runs in fresh processes (the allocator's state
must not carry over), --repeats times, and its real peak is measured: the TF allocator peak over the cell's baseline
(the quantity reports and predictions give; BFC's chunk reuse makes it vary from run to run, so the median and the
spread are printed). Each model is fed the way its kind usually is: numpy arrays, a tf.data pipeline
(batch -> take -> prefetch) or a Python generator; every run trains at most STEPS steps (the peak comes in the first
steps: the optimizer's slots are made in the first, BFC's chunks are reused after). The script prints the relative
error per point, the max/mean per basis, and a Markdown table (--table) for docs/what-if.md.

    python benchmarks/predict_accuracy.py             # the first five models (arrays)
    python benchmarks/predict_accuracy.py --zoo       # all models, batches 8 to 256 (about 40 minutes, 2 cores)
    python benchmarks/predict_accuracy.py --models resnet50,gru --batches 16,64 --repeats 3
    python benchmarks/predict_accuracy.py --zoo --cells 3 --runs runs.json --table   # 3 runs of each cell, scored

Columns: analytic (no extra run), measured (the probes' parts), replay (what `predict(..., calibrate=True)` gives:
the step replay where its self-check passed, else the parts) and the replay's range (0 when the real median lies
between the replay's two op orders).
Targets: the replay within 10% on 95% of points and never beyond 15%, below the cell's batch too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import textwrap
import time

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
out = {{"measured": p.report.tf_peak_bytes, "batch read": p.report.model.batch_size}}
if mode == "anchor":
    out["analytic"] = {{b: prediction.predict(p.report, batch_size=b).peak_bytes for b in batches}}
    out["calibrated"] = {{b: tfmem_magic.predict(p.report, batch_size=b, calibrate=True).peak_bytes
                         for b in batches}}  # the replay wherever its self-check passed
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
                     "curve": [[b, one, two] for b, one, two in zip(curve.batches, curve.peaks, curve.second_peaks)]
                              if curve else []}}
print(json.dumps(out))
"""


def run(model: str, mode: str, batch: int, batches: list[int]) -> dict:
    style, build = MODELS[model]
    code = WORKER.format(
        samples=SAMPLES, build=textwrap.dedent(build), mode=mode, style=style, batch=batch, batches=batches, steps=STEPS
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
        "batch; the cell's own run varies too, so each is scored; the table shows their range)",
    )
    parser.add_argument("--table", action="store_true", help="print a Markdown table at the end")
    parser.add_argument(
        "--runs",
        default=None,
        help="a JSON file of fresh-run peaks: read (runs already there are "
        "not repeated, and all of them are used: a change to the predictor needs only the cells "
        "rerun) and written",
    )
    args = parser.parse_args()
    models = args.models.split(",") if args.models else list(MODELS) if args.zoo else FIRST_FIVE
    batches = [int(b) for b in (args.batches or ("8,16,32,64,128,256" if args.zoo else "16,32,64,128,256")).split(",")]
    started = time.perf_counter()
    saved: dict[str, list[int]] = {}
    if args.runs and os.path.exists(args.runs):
        with open(args.runs) as existing:
            saved = json.load(existing)
    # |error|, batch; "replay": the calibrated prediction (the replay where its self-check passed, else the parts),
    # "replay range": 0 when the real median lies between the replay's two op orders' changes, else the nearer one's
    errors: dict[str, list[tuple[float, int]]] = {"analytic": [], "measured": [], "replay": [], "replay range": []}
    between: dict[str, list[tuple[float, int]]] = {"analytic": [], "measured": [], "replay": []}
    rows = []
    print(
        f"{'model':<16} {'feed':<9} {'batch':>5} | {'allocator peak (spread)':>24} {'analytic':>8} {'measured':>8} "
        f"{'replay':>8} {'range':>8}"
    )
    for model in models:
        style = MODELS[model][0]
        anchors = [run(model, "anchor", args.anchor, batches) for _ in range(max(1, args.cells))]
        repeats = args.big_repeats if model in BIG else args.repeats
        row = {
            "model": model,
            "style": style,
            "repeats": None,
            "spread": 0.0,
            "analytic": {},
            "measured": {},
            "replay": {},
            "replay range": {},
        }
        for batch in [b for b in batches if b != args.anchor]:
            key = f"{model} {style} batch {batch}"
            runs = saved.get(key, [])  # every run the file has (more than --repeats are kept and used)
            runs += [run(model, "measure", batch, batches)["measured"] for _ in range(repeats - len(runs))]
            saved[key] = runs
            row["repeats"] = len(runs) if row["repeats"] is None else min(row["repeats"], len(runs))
            if args.runs:
                with open(args.runs, "w") as out:
                    json.dump(saved, out, indent=1)
            alloc, lo, hi = statistics.median(runs), min(runs), max(runs)
            for basis, key in (("analytic", "analytic"), ("measured", "parts"), ("replay", "calibrated")):
                row[basis][batch] = [(anchor[key][str(batch)] - alloc) / alloc for anchor in anchors]
                errors[basis] += [(abs(e), batch) for e in row[basis][batch]]
                # against the runs' range: 0 between the lowest and the highest run (a two-valued peak's honest
                # score), else the distance to the nearer one
                between[basis] += [(abs(_outside(anchor[key][str(batch)], lo, hi)), batch) for anchor in anchors]
            ranged = []
            for anchor in anchors:
                a, b = sorted((anchor["calibrated"][str(batch)], anchor["replay_low"][str(batch)]))
                ranged.append(0.0 if a <= alloc <= b else (a - alloc) / alloc if alloc < a else (b - alloc) / alloc)
            row["replay range"][batch] = ranged
            errors["replay range"] += [(abs(e), batch) for e in ranged]
            row["spread"] = max(row["spread"], (hi - lo) / alloc)
            spread = f"{alloc / 2**20:.1f}Mi ({(lo - alloc) / alloc:+.0%}/{(hi - alloc) / alloc:+.0%})"
            print(
                f"{model:<16} {style:<9} {batch:>5} | {spread:>24} {_errors(row['analytic'][batch], '.1%'):>8} "
                f"{_errors(row['measured'][batch], '.1%'):>8} {_errors(row['replay'][batch], '.1%'):>8} "
                f"{_errors(row['replay range'][batch], '.1%'):>8}",
                flush=True,
            )
        for anchor in anchors:
            replay = anchor["replay"]
            used = (
                f"replay probes {replay['probes']}, cross {replay['cross']:+.1%}, {replay['seconds']} s"
                if replay["passed"]
                else f"replay not used: {replay['why_not'][:160]}"
            )
            print(
                f"{'':<16} cell at batch {args.anchor}: {anchor['measured'] / 2**20:.1f}Mi; probes at batches "
                f"{anchor['probes']['batches']}: {anchor['probes']['seconds']} s; {used}",
                flush=True,
            )
            shown = [
                f"{b}: {one / 2**20:.1f}" + (f"/{two / 2**20:.1f}" if one != two else "")
                for b, one, two in replay["curve"]
                if b in batches or b in (replay["probes"] or [])
            ]
            if shown:
                print(f"{'':<16} replay curve (MiB, probe one's order/probe two's): {', '.join(shown)}", flush=True)
        rows.append(row)
    for basis, scored in errors.items():
        values = [e for e, _ in scored]
        above = [e for e, batch in scored if batch > args.anchor]
        print(
            f"{basis:>26}: max error {max(values):.1%}, mean {statistics.mean(values):.1%} over {len(values)} "
            f"points; within 10% / 15% / 20%: {_within(values)}; above the cell's batch: {_within(above)} of "
            f"{len(above)}, max {max(above, default=0):.1%}"
        )
    for basis, scored in between.items():
        values = [e for e, _ in scored]
        above = [e for e, batch in scored if batch > args.anchor]
        below = [e for e, batch in scored if batch < args.anchor]
        print(
            f"{basis + ' vs the runs range':>26}: within 10% / 15% / 20%: {_within(values)} of {len(values)}, max "
            f"{max(values):.1%}; below the cell's batch {_within(below)} of {len(below)}, max "
            f"{max(below, default=0):.1%}; above it {_within(above)} of {len(above)}, "
            f"max {max(above, default=0):.1%}"
        )
    print(f"took {(time.perf_counter() - started) / 60:.1f} min")
    if args.table:
        print_table(rows, [b for b in batches if b != args.anchor])


def _outside(predicted: float, low: float, high: float) -> float:
    """The error against a range of runs: 0 inside it, else relative to its nearer end."""
    if low <= predicted <= high:
        return 0.0
    end = low if predicted < low else high
    return (predicted - end) / end


def _within(values: list[float]) -> str:
    return " / ".join(str(sum(v <= limit for v in values)) for limit in (0.10, 0.15, 0.20))


def _errors(values: list[float], spec: str) -> str:
    """One cell's error ("+4%"), or the range over several cells' ("-7..+13%")."""
    low, high = min(values), max(values)
    return f"{low:+{spec}}" if len(values) == 1 else f"{low:+{spec}}..{high:+{spec}}"


def print_table(rows: list[dict], batches: list[int]) -> None:
    names = " / ".join(str(b) for b in batches)
    print(
        f"\n| model | fed as | runs per point | spread | analytic error (batch {names}) | measured-basis error "
        "| replay error | replay range's error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = (
            " / ".join(_errors(row[key][b], ".0%") for b in batches)
            for key in ("analytic", "measured", "replay", "replay range")
        )
        print(f"| {row['model']} | {row['style']} | {row['repeats']} | {row['spread']:.0%} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
