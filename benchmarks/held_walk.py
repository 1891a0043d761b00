"""What naming the holders costs each cell: the walk of the namespace (measure/holders.py) and the scan of
TensorFlow's gradient registry (measure/release.registry_pinned), timed on a notebook-like namespace.

The namespace: 12 fitted Keras models (4 in a list, 4 History objects in a dict, 4 dropped, so the registry holds
8+ traced steps), 200 plain names (numbers, strings, numpy arrays), a list of 100,000 floats, a dict of 5,000
entries, nested lists of tensors, and a callback class of the notebook's own. Each is timed `--rounds` times; the
median and the worst are printed in milliseconds, with what was found (so a fast walk that finds nothing shows).

    python benchmarks/held_walk.py [--rounds 20]

Target: the walk and the scan together under 50 ms per cell on this namespace (the walk's own budget is 250 ms, after
which it stops and the report says a holder may be missing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmem_magic  # noqa: E402

tfmem_magic.prepare()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmem_magic.measure import holders, release  # noqa: E402


def fitted(width: int) -> keras.Model:
    m = keras.Sequential([keras.Input((128,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(4)])
    m.compile("adam", "mse")
    m.fit(np.zeros((64, 128), "float32"), np.zeros((64, 4), "float32"), batch_size=32, verbose=0)
    return m


def namespace() -> dict:
    ns: dict = {"__name__": "__main__"}
    ns["models"] = [fitted(64 * (i + 1)) for i in range(4)]
    ns["histories"] = {i: fitted(32 * (i + 1)).history for i in range(4)}
    for i in range(4):
        fitted(16 * (i + 1))  # dropped: only TensorFlow's registry keeps these
    ns.update({f"n{i}": i for i in range(100)})
    ns.update({f"s{i}": "text" * i for i in range(50)})
    ns.update({f"a{i}": np.zeros((100, 100)) for i in range(50)})
    ns["floats"] = [float(i) for i in range(100_000)]
    ns["table"] = {f"k{i}": [i, str(i)] for i in range(5000)}
    ns["nested"] = [[tf.ones((8, 8)) for _ in range(10)] for _ in range(10)]

    class Keep(keras.callbacks.Callback):
        pass

    Keep.__module__ = "__main__"
    keep = Keep()
    keep.set_model(ns["models"][0])
    ns["keep"] = keep
    return ns


def timed(step, rounds: int) -> tuple[float, float, object]:
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), max(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    rounds = parser.parse_args().rounds
    ns = namespace()
    med, worst, found = timed(lambda: holders.walk(ns), rounds)
    print(
        f"walk of {len(ns)} names: median {med:.1f} ms, worst {worst:.1f} ms; complete={found.complete}; "
        f"holders: "
        + ", ".join(f"{h.name} ({h.kind}, {len(h.models)} models, {h.tensors} tensors)" for h in found.holders)
    )
    med2, worst2, pinned = timed(lambda: release.registry_pinned(found.handles), rounds)
    print(
        f"registry scan: median {med2:.1f} ms, worst {worst2:.1f} ms; {pinned.entries} entries hold "
        f"{pinned.bytes / 2**20:.2f} MiB no name reaches"
    )
    print(f"together: median {med + med2:.1f} ms per cell (target < 50 ms)")


if __name__ == "__main__":
    main()
