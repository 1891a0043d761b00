"""Overhead of %%tfmem's engine: wall time measured side by side in one process, memory in fresh processes.

For each workload (an MLP fit, a CNN fit, an eager loop, an LSTM forecaster fed by `timeseries_dataset_from_array`
with validation data, a bidirectional GRU text model; a few seconds each) the script first measures the RSS that
trace mode adds over quick mode: each mode profiles the workload's first (cold) call in a fresh Python process,
the modes alternating, `--rss-rounds` processes each, and the medians of peak-over-baseline RSS are compared. RSS
is a high-water mark that CPU contention does not distort, and a fresh process is what a user's first cell sees
(graph tracing, oneDNN caches); in one process the second run would reuse the first run's freed memory.

It then alternates bare / quick / trace runs in one process, rotating their order every round so that drift
(thermal, other load) hits each mode alike, and prints each mode's wall time as a ratio to bare: from the fastest run
of each mode (the intrinsic cost, as timeit does) and from the medians. Both are printed because on a 2-core machine
these fits are bimodal (the same bare fit takes 1.4 s or 2.6 s from run to run), which makes a median of a few runs
jump. Trace time includes stopping the profiler, parsing the xplane and the analysis. Last it times parse +
analysis alone on full traces (no step window, no memory budget).

    python benchmarks/overhead.py [--rounds 7] [--rss-rounds 2] [--quick-run] [--only rss,time,analysis]

Targets (docs/overhead.md): quick <= 1.03x, trace <= 1.25x, analysis >= 300,000 memory events/s; trace adds
< 100 MiB of RSS over quick (without the trace's memory budget, the LSTM added 783-888 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import tfmem_magic

tfmem_magic.prepare()  # BFC allocator before the first op, as %load_ext does

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmem_magic.analyze import analysis  # noqa: E402
from tfmem_magic.measure import tracer, xplane  # noqa: E402
from tfmem_magic.measure.tracer import Tracer  # noqa: E402


def mlp_workload(scale: float):
    keras.utils.set_random_seed(0)
    x = np.random.rand(int(60_000 * scale), 128).astype("float32")
    y = np.random.randint(0, 10, len(x))
    model = keras.Sequential(
        [
            keras.Input((128,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lambda: model.fit(x, y, batch_size=128, epochs=1, verbose=0)


def cnn_workload(scale: float):
    keras.utils.set_random_seed(0)
    x = np.random.rand(int(3_000 * scale), 32, 32, 3).astype("float32")
    y = np.random.randint(0, 10, len(x))
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lambda: model.fit(x, y, batch_size=64, epochs=1, verbose=0)


def eager_workload(scale: float):
    layer = keras.layers.Dense(256)
    x = tf.random.uniform((64, 256))
    steps = int(4_000 * scale)

    def run():
        h = x
        for _ in range(steps):
            h = tf.nn.relu(layer(h)) * 0.5 + x
        return float(tf.reduce_sum(h))

    return run


def lstm_workload(scale: float):
    """An LSTM forecaster over `timeseries_dataset_from_array` (120 steps of 5 features, batch 256) with validation
    data, a checkpoint and early stopping: ~70k profiler events per step, 20% of them memory events."""
    import tempfile

    keras.utils.set_random_seed(0)
    seq, batch = 120, 256
    n = int(16_000 * scale) + seq + 2 * batch
    series = np.cumsum(np.random.randn(n, 5).astype("float32"), axis=0)
    split = int(0.8 * n)
    train = keras.utils.timeseries_dataset_from_array(
        series[: split - seq], series[seq:split, 0], seq, batch_size=batch
    )
    val = keras.utils.timeseries_dataset_from_array(series[split:-seq], series[split + seq :, 0], seq, batch_size=batch)
    model = keras.Sequential([keras.Input((seq, 5)), keras.layers.LSTM(64), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    path = os.path.join(tempfile.mkdtemp(prefix="tfmem-bench-"), "best.keras")
    callbacks = [keras.callbacks.ModelCheckpoint(path, save_best_only=True), keras.callbacks.EarlyStopping(patience=2)]
    return lambda: model.fit(train, validation_data=val, epochs=1, callbacks=callbacks, verbose=0)


def gru_workload(scale: float):
    """A bidirectional GRU over 100-token sequences (numpy arrays): its while loops write ~5 MB of xplane per step."""
    keras.utils.set_random_seed(0)
    x = np.random.randint(1, 5_000, (int(1_024 * scale) + 64, 100))
    y = np.random.randint(0, 2, len(x))
    model = keras.Sequential(
        [
            keras.Input((100,)),
            keras.layers.Embedding(5_000, 32),
            keras.layers.Bidirectional(keras.layers.GRU(32)),
            keras.layers.Dense(1),
        ]
    )
    model.compile("adam", keras.losses.BinaryCrossentropy(from_logits=True))
    return lambda: model.fit(x, y, batch_size=64, epochs=1, validation_split=0.1, verbose=0)


WORKLOADS = {
    "mlp fit": mlp_workload,
    "cnn fit": cnn_workload,
    "eager loop": eager_workload,
    "lstm tf.data": lstm_workload,
    "gru text": gru_workload,
}


def timed(fn, mode: str) -> float:
    start = time.perf_counter()
    if mode == "bare":
        fn()
    else:
        with tfmem_magic.profile(mode=mode):
            fn()
    return time.perf_counter() - start


def child(name: str, mode: str, scale: float) -> None:
    """One cold profiled call of a workload in this (fresh) process; prints what the parent compares, as JSON."""
    fn = WORKLOADS[name](scale)
    with tfmem_magic.profile(mode=mode) as p:
        fn()
    report = p.report
    trace = report.trace
    print(
        json.dumps(
            {
                "added": report.rss.peak_bytes - report.rss.baseline_bytes,
                "wall": report.wall_s,
                "events": trace.events if trace else None,
                "note": trace.note if trace else None,
            }
        )
    )


def rss_overhead(rounds: int, scale: float) -> dict[str, dict]:
    """Per workload: medians of the RSS each mode adds (peak over baseline), from fresh processes run in turn."""
    results = {}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in WORKLOADS:
        runs: dict[str, list[dict]] = {"quick": [], "trace": []}
        for r in range(rounds):
            for mode in ("quick", "trace") if r % 2 == 0 else ("trace", "quick"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", name, mode, "--scale", str(scale)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=900,
                )
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                if out.returncode != 0 or not lines:
                    raise RuntimeError(f"{name} / {mode} failed:\n{out.stderr[-2000:]}")
                runs[mode].append(json.loads(lines[-1]))
        med = {m: statistics.median(run["added"] for run in v) for m, v in runs.items()}
        results[name] = {
            "quick": med["quick"],
            "trace": med["trace"],
            "extra": med["trace"] - med["quick"],
            "events": runs["trace"][-1]["events"],
            "note": runs["trace"][-1]["note"] or "",
        }
    return results


def _rss_text(rss: dict | None) -> str:
    if rss is None:
        return ""
    return (
        f" | trace RSS {rss['extra'] / 2**20:+6.0f} MiB over quick (quick +{rss['quick'] / 2**20:.0f}, "
        f"trace +{rss['trace'] / 2**20:.0f})"
    )


def overhead(rounds: int, scale: float, rss: dict[str, dict] | None = None) -> dict[str, dict[str, float]]:
    modes = ["bare", "quick", "trace"]
    results = {}
    for name, make in WORKLOADS.items():
        fn = make(scale)
        fn()  # warm up: graph tracing and oneDNN primitive caches happen once, outside the comparison
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            order = modes[r % 3 :] + modes[: r % 3]
            for mode in order:
                times[mode].append(timed(fn, mode))
        best = {m: min(v) for m, v in times.items()}
        med = {m: statistics.median(v) for m, v in times.items()}
        results[name] = {"best": best, "median": med}
        print(
            f"{name:<12} bare {best['bare']:5.2f} s | quick {best['quick'] / best['bare']:5.3f}x "
            f"(median {med['quick'] / med['bare']:5.3f}x) | trace {best['trace'] / best['bare']:5.3f}x "
            f"(median {med['trace'] / med['bare']:5.3f}x)" + _rss_text((rss or {}).get(name)),
            flush=True,
        )
    return results


def analysis_throughput(scale: float) -> list[tuple[str, int, float]]:
    """Parse + analysis time on full traces (no step window, no budget), the worst case for the analysis."""
    rows = []
    tracer.DECODE_AT_BYTES = float("inf")  # keep the blobs raw: the parse is part of what is timed
    for name, make in WORKLOADS.items():
        # the recurrent fits at a fifth: a full trace of them holds ~25 bytes of RSS per byte of xplane (~1 GB)
        fn = make(scale / 5 if name in ("lstm tf.data", "gru text") else scale)
        fn()
        full = Tracer(time.perf_counter(), max_seconds=0, budget_bytes=0)
        full.start()
        fn()
        segments = full.finish()
        best = float("inf")
        n = 0
        for _ in range(3):
            start = time.perf_counter()
            trace = xplane.read_segments(segments)
            analysis.summarize(trace, analysis.TraceContext())
            best = min(best, time.perf_counter() - start)
            n = len(trace.events)
        rows.append((name, n, n / best))
        print(
            f"{name:<12} {n:>9,} memory events  parse+analysis {best:6.3f} s  {n / best:>11,.0f} events/s", flush=True
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rss-rounds", type=int, default=2, help="fresh processes per mode and workload")
    parser.add_argument("--quick-run", action="store_true", help="small workloads, 2 rounds: a smoke test")
    parser.add_argument("--only", default="rss,time,analysis", help="comma-separated: rss, time, analysis")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    scale = args.scale if args.scale is not None else (0.1 if args.quick_run else 1.0)
    if args.child:
        child(args.child[0], args.child[1], scale)
        return
    rounds = 2 if args.quick_run else args.rounds
    parts = set(args.only.split(","))
    print(
        f"tfmem_magic {tfmem_magic.__version__}, TensorFlow {tf.__version__}, {rounds} rounds, "
        "medians; ratios are to the bare run of the same workload\n"
    )
    rss = None
    if "rss" in parts:
        print(
            f"Memory: RSS added by each mode to a cold call, medians of {args.rss_rounds} fresh processes per mode "
            "(printed with the wall-time line below)",
            flush=True,
        )
        rss = rss_overhead(args.rss_rounds, scale)
        for name, r in rss.items():
            note = r["note"].split(". The allocator")[0]
            print(f"  {name:<12} {r['events'] or 0:>8,} memory events traced{'; ' + note if note else ''}", flush=True)
        print()
    if "time" in parts:
        print("Wall-time overhead")
        overhead(rounds, scale, rss)
    elif rss is not None:
        for name, r in rss.items():
            print(f"{name:<12}" + _rss_text(r))
    if "analysis" in parts:
        print("\nTrace analysis throughput (full traces)")
        analysis_throughput(scale)


if __name__ == "__main__":
    main()
