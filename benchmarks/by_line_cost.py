"""What the report's by-line view costs a cell (analyze/lines.py): the resolution of the peak's tensors (and of those
the cell left live, for the leak findings) to lines of code, at the cell's end, timed on small Keras fits in a real
IPython shell with the extension loaded, as a notebook runs them. Each model is profiled twice: its first profiled
cell reads its functions' nodes and stacks from TensorFlow (kept), a later cell finds them kept. Also the cost of
noting each layer's creation line (measure/code_sites.py: Keras' `Layer.__init__` wrapped) per layer made.

    python benchmarks/by_line_cost.py [--rounds 3]

Prints per model and cell: the resolution's milliseconds (median of the rounds, each round a fresh shell and fresh
models in this process), the bytes at the peak that a line named, and the cell's whole report time for scale.
Target: a few milliseconds per cell (docs/lines.md, 'Cost').
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
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
