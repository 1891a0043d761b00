"""What the report's by-line view costs a cell (analyze/lines.py): the resolution of the peak's tensors (and of those
the cell left live, for the leak findings) to lines of code, at the cell's end, timed on small Keras fits in a real
IPython shell with the extension loaded, as a notebook runs them. Each model is profiled twice: its first profiled
cell reads its functions' nodes and stacks from TensorFlow (kept), a later cell finds them kept. Also the cost of
noting each layer's creation line (measure/code_sites.py: Keras' `Layer.__init__` wrapped) per layer made.

Eager ops are named through an op callback that notes the line running each eager op while the trace records
(measure/eager_ops.py): `--eager` times an eager loop (a Dense, a relu, a multiply and an add per step, 4,000 steps,
as in benchmarks/overhead.py) in one shell, bare, in trace mode without the callback and in trace mode with it,
alternating in a rotating order each round; and the callback's own cost per eager op, outside any cell.

    python benchmarks/by_line_cost.py [--rounds 3] [--eager] [--eager-rounds 7]

Prints per model and cell: the resolution's milliseconds (median of the rounds, each round a fresh shell and fresh
models in this process), the bytes at the peak that a line named, and the cell's whole report time for scale.
Target: a few milliseconds per cell (docs/lines.md, 'Cost'); with `--eager`, the eager loop's trace-mode time with
the callback within 1.05x of bare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmem_magic  # noqa: E402

tfmem_magic.prepare()

from IPython.core.displaypub import CapturingDisplayPublisher  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from tfmem_magic.analyze import build, lines  # noqa: E402
from tfmem_magic.core.sizes import format_bytes  # noqa: E402

MODELS = {
    "MLP": """model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
    keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
x = np.random.rand(1024, 64).astype("float32"); y = np.random.rand(1024, 1).astype("float32")""",
    "CNN": """model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
    keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
x = np.random.rand(512, 32, 32, 3).astype("float32"); y = np.random.rand(512, 10).astype("float32")""",
    "custom layer": """class Wide(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 8192))
    def call(self, x):
        return keras.ops.matmul(x, self.w)
model = keras.Sequential([keras.Input((64,)), Wide(), keras.layers.Dense(1)])
x = np.random.rand(1024, 64).astype("float32"); y = np.random.rand(1024, 1).astype("float32")""",
}
FIT = "%%tfmem --no-panel\nmodel.fit(x, y, batch_size=128, epochs=1, verbose=0)\n"


def one_round(spent: dict[str, list[float]]) -> dict[tuple[str, int], tuple[float, float, int, int]]:
    """Each model's two profiled cells: (resolution ms, report ms, bytes named, bytes traced at the peak)."""
    out = {}
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
    shell.history_manager.enabled = False
    shell.run_line_magic("load_ext", "tfmem_magic")
    shell.run_cell("import numpy as np, keras, tensorflow as tf", store_history=True)
    for name, source in MODELS.items():
        shell.run_cell(source + '\nmodel.compile("adam", "mse")', store_history=True)
        for cell in (1, 2):
            spent["resolve"].clear()
            spent["report"].clear()
            assert shell.run_cell(FIT, store_history=True).success
            trace = tfmem_magic.last_report().trace  # type: ignore[union-attr]
            total = sum(g.bytes for g in trace.by_line) if trace else 0
            named = trace.by_line_named_bytes if trace else 0
            out[(name, cell)] = (sum(spent["resolve"]), sum(spent["report"]), named, total)
    shell.reset(new_session=False)
    return out


EAGER_SETUP = """layer = keras.layers.Dense(256)
x0 = tf.random.uniform((64, 256))
def loop(steps=4000):
    h = x0
    for _ in range(steps):
        h = tf.nn.relu(layer(h)) * 0.5 + x0
    return float(tf.reduce_sum(h))
loop(50)"""
EAGER_MODES = ("bare", "trace without callback", "trace with callback")


def eager_loop(rounds: int) -> None:
    """The eager loop's wall time per mode (fastest and median of the rounds) as a ratio to bare, and what the
    by-line view named at its peak."""
    from tfmem_magic.measure import measurement

    armed = measurement.Measurement._arm_eager_ops
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
    shell.history_manager.enabled = False
    shell.run_line_magic("load_ext", "tfmem_magic")
    assert shell.run_cell("import numpy as np, keras, tensorflow as tf", store_history=True).success
    assert shell.run_cell(EAGER_SETUP, store_history=True).success
    times: dict[str, list[float]] = {mode: [] for mode in EAGER_MODES}
    named = ""
    for r in range(rounds):
        for mode in EAGER_MODES[r % 3 :] + EAGER_MODES[: r % 3]:
            cell = "loop()" if mode == "bare" else "%%tfmem --no-panel\nloop()"
            without = mode == "trace without callback"
            if without:
                measurement.Measurement._arm_eager_ops = lambda self, tracer: None  # type: ignore[method-assign]
            try:
                t = time.perf_counter()
                assert shell.run_cell(cell, store_history=True).success
                times[mode].append(time.perf_counter() - t)
            finally:
                measurement.Measurement._arm_eager_ops = armed  # type: ignore[method-assign]
            if mode == "trace with callback":
                trace = tfmem_magic.last_report().trace  # type: ignore[union-attr]
                if trace is not None and trace.by_line:
                    total = sum(g.bytes for g in trace.by_line)
                    named = f"{format_bytes(trace.by_line_named_bytes)} of {format_bytes(total)}"
    shell.reset(new_session=False)
    fastest = {m: min(v) for m, v in times.items()}
    middle = {m: statistics.median(v) for m, v in times.items()}
    print(f"eager loop, 4,000 steps, {rounds} rounds: fastest / median seconds, ratio to bare")
    for mode in EAGER_MODES:
        print(
            f"  {mode:<24}{fastest[mode]:>7.2f} s {fastest[mode] / fastest['bare']:>6.3f}x"
            f"{middle[mode]:>8.2f} s {middle[mode] / middle['bare']:>6.3f}x"
        )
    print(f"  named by a line at the peak (with the callback): {named or '-'}")
    per_op()


def per_op(n: int = 20_000) -> None:
    """The callback's own cost per eager op (tf.add of two 4x4 tensors): none, added while the trace is paused, and
    added while it records (best of 5 runs of n ops each)."""
    from types import SimpleNamespace

    import tensorflow as tf

    from tfmem_magic.measure.eager_ops import EagerOps

    a = tf.ones((4, 4))

    def run() -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                tf.add(a, a)
            best = min(best, time.perf_counter() - t)
        return best / n * 1e6

    base = run()
    print(f"tf.add of 4x4 tensors: {base:.2f} µs per op without the callback")
    for recording, what in ((-1, "paused"), (0, "recording")):
        ops = EagerOps(SimpleNamespace(recording=recording, _t0=0.0))  # type: ignore[arg-type]
        ops.start()
        try:
            spent = run()
        finally:
            ops.stop()
        print(f"  with the callback, trace {what}: {spent:.2f} µs per op (+{spent - base:.2f} µs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="time the eager loop with and without the op callback")
    parser.add_argument("--eager-rounds", type=int, default=7)
    parser.add_argument("--eager-only", action="store_true", help="only the eager loop")
    args = parser.parse_args()
    if args.eager or args.eager_only:
        eager_loop(args.eager_rounds)
        if args.eager_only:
            return
    spent: dict[str, list[float]] = {"resolve": [], "report": []}
    resolve, trace_info = lines.resolve_cell, build.trace_info

    def timed_resolve(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return resolve(*a, **k)
        finally:
            spent["resolve"].append((time.perf_counter() - t) * 1000)

    def timed_trace_info(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return trace_info(*a, **k)
        finally:
            spent["report"].append((time.perf_counter() - t) * 1000)

    lines.resolve_cell, build.trace_info = timed_resolve, timed_trace_info  # type: ignore[assignment]
    rounds = [one_round(spent) for _ in range(args.rounds)]
    print(f"{'model':<14}{'cell':<7}{'by line ms':>11}{'trace analysis ms':>19}  named at the peak")
    for key in rounds[0]:
        ms = statistics.median(r[key][0] for r in rounds)
        whole = statistics.median(r[key][1] for r in rounds)
        _, _, named, total = rounds[-1][key]
        share = f"{format_bytes(named)} of {format_bytes(total)}" if total else "-"
        print(f"{key[0]:<14}{'first' if key[1] == 1 else 'later':<7}{ms:>11.1f}{whole:>19.1f}  {share}")
    import keras

    from tfmem_magic.measure import code_sites

    for holding in (False, True):
        if holding:
            code_sites.hold("benchmark")
        t = time.perf_counter()
        for _ in range(500):
            keras.layers.Dense(8)
        per = (time.perf_counter() - t) / 500 * 1e6
        print(f"Dense(8) made {'with' if holding else 'without'} the creation line noted: {per:.1f} µs")
        code_sites.release("benchmark")


if __name__ == "__main__":
    main()
