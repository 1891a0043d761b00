"""Overhead of %%tfmem's engine, measured side by side in one process.

For each workload (an MLP fit, a CNN fit, an eager loop; a few seconds each) the script alternates bare / quick /
trace runs, rotating their order every round so that drift (thermal, other load) hits each mode alike, and prints
each mode's wall time as a ratio to bare: from the fastest run of each mode (the intrinsic cost, as timeit does) and
from the medians. Both are printed because on a 2-core machine these fits are bimodal (the same bare fit takes 1.4 s
or 2.6 s from run to run), which makes a median of a few runs jump. Trace time includes stopping the profiler,
parsing the xplane and the analysis. It then times parse + analysis alone on full (unbounded) traces.

    python benchmarks/overhead.py [--rounds 7] [--quick-run]

Targets (issue 2): quick <= 1.03x, trace <= 1.25x, analysis >= 300,000 memory events/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import tfmem_magic

tfmem_magic.prepare()  # BFC allocator before the first op, as %load_ext does

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmem_magic import analysis, xplane  # noqa: E402
from tfmem_magic.tracer import Tracer  # noqa: E402


def mlp_workload(scale: float):
    keras.utils.set_random_seed(0)
    x = np.random.rand(int(60_000 * scale), 128).astype("float32")
    y = np.random.randint(0, 10, len(x))
    model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lambda: model.fit(x, y, batch_size=128, epochs=1, verbose=0)


def cnn_workload(scale: float):
    keras.utils.set_random_seed(0)
    x = np.random.rand(int(3_000 * scale), 32, 32, 3).astype("float32")
    y = np.random.randint(0, 10, len(x))
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
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


WORKLOADS = {"mlp fit": mlp_workload, "cnn fit": cnn_workload, "eager loop": eager_workload}


def timed(fn, mode: str) -> float:
    start = time.perf_counter()
    if mode == "bare":
        fn()
    else:
        with tfmem_magic.profile(mode=mode):
            fn()
    return time.perf_counter() - start


def overhead(rounds: int, scale: float) -> dict[str, dict[str, float]]:
    modes = ["bare", "quick", "trace"]
    results = {}
    for name, make in WORKLOADS.items():
        fn = make(scale)
        fn()  # warm up: graph tracing and oneDNN primitive caches happen once, outside the comparison
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            order = modes[r % 3:] + modes[:r % 3]
            for mode in order:
                times[mode].append(timed(fn, mode))
        best = {m: min(v) for m, v in times.items()}
        med = {m: statistics.median(v) for m, v in times.items()}
        results[name] = {"best": best, "median": med}
        print(f"{name:<11} bare {best['bare']:5.2f} s | quick {best['quick'] / best['bare']:5.3f}x "
              f"(median {med['quick'] / med['bare']:5.3f}x) | trace {best['trace'] / best['bare']:5.3f}x "
              f"(median {med['trace'] / med['bare']:5.3f}x)", flush=True)
    return results


def analysis_throughput(scale: float) -> list[tuple[str, int, float]]:
    """Parse + analysis time on full traces (no step window), the worst case for the analysis."""
    rows = []
    for name, make in WORKLOADS.items():
        fn = make(scale)
        fn()
        tracer = Tracer(time.perf_counter(), max_seconds=0)
        tracer.start()
        fn()
        segments = tracer.finish()
        best = float("inf")
        n = 0
        for _ in range(3):
            start = time.perf_counter()
            trace = xplane.read_segments(segments)
            analysis.summarize(trace, analysis.Context())
            best = min(best, time.perf_counter() - start)
            n = len(trace.events)
        rows.append((name, n, n / best))
        print(f"{name:<11} {n:>9,} memory events  parse+analysis {best:6.3f} s  {n / best:>11,.0f} events/s",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick-run", action="store_true", help="small workloads, 2 rounds: a smoke test")
    args = parser.parse_args()
    scale = 0.1 if args.quick_run else 1.0
    rounds = 2 if args.quick_run else args.rounds
    print(f"tfmem_magic {tfmem_magic.__version__}, TensorFlow {tf.__version__}, {rounds} rounds, "
          "medians; ratios are to the bare run of the same workload\n")
    print("Wall-time overhead")
    overhead(rounds, scale)
    print("\nTrace analysis throughput (full traces)")
    analysis_throughput(scale)


if __name__ == "__main__":
    main()
