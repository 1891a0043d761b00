"""How long a refusal takes, with the probe processes started cold and warm (advise/probe_runs.py, `warm_up`), side
by side in one run, on several models: each at a batch far too large for a limit 1.5 GiB over the process, in a
real IPython shell with the extension loaded; each round builds the model again in the cell (so no kept replay
answers it) and alternates cold and warm. A warm round's probes were started by `%tfmem limit` and given `--settle`
seconds to import TensorFlow, as a user's next cell would.

    python benchmarks/refusal_time.py [--rounds 3] [--settle 15] [--models cnn,gru] [--out FILE]

Prints each round's seconds from the cell's start to the refusal, and the medians; `--out
benchmarks/results/refusal_time.json` keeps them, and `python benchmarks/doc_tables.py --write` renders them into
docs/preflight.md ("Warm probes"). Target: a refusal in 10 s or less (median) on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmem_magic  # noqa: E402

tfmem_magic.prepare()

import keras  # noqa: E402
import psutil  # noqa: E402
import tensorflow as tf  # noqa: E402
from IPython.core.displaypub import CapturingDisplayPublisher  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from tfmem_magic.advise import probe_runs  # noqa: E402
from tfmem_magic.core.session import SESSION  # noqa: E402

SETUP = """
import numpy as np, keras, psutil
keras.utils.set_random_seed(0)
L = keras.layers
"""
# each model: the code that defines `build()` and the data `x`, `y`, and the batch it is refused at
MODELS = {
    "cnn": (
        """
x = np.random.rand(2048, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 2048)
def build():
    model = keras.Sequential([keras.Input((64, 64, 3)), L.Conv2D(64, 3, activation="relu"), L.MaxPool2D(),
                              L.Conv2D(64, 3, activation="relu"), L.MaxPool2D(), L.Flatten(), L.Dense(10)])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model
""",
        1024,
    ),
    "mlp": (
        """
x = np.random.rand(65536, 784).astype("float32"); y = np.random.randint(0, 10, 65536)
def build():
    model = keras.Sequential([keras.Input((784,)), L.Dense(4096, activation="relu"),
                              L.Dense(4096, activation="relu"), L.Dense(10)])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model
""",
        65536,
    ),
    "gru": (
        """
x = np.random.rand(8192, 200, 32).astype("float32"); y = np.random.randint(0, 10, 8192)
def build():
    model = keras.Sequential([keras.Input((200, 32)), L.GRU(128), L.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
""",
        8192,
    ),
    "transformer": (
        """
x = np.random.randint(0, 2000, (4096, 128)); y = np.random.randint(0, 2, 4096)
def build():
    inp = keras.Input((128,), dtype="int64")
    h = L.Embedding(2000, 64)(inp)
    for _ in range(2):
        h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=4, key_dim=16)(h, h))
        h = L.LayerNormalization()(h + L.Dense(64)(L.Dense(128, activation="relu")(h)))
    model = keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling1D()(h)))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
""",
        4096,
    ),
}
WARM_UP = "build().fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # TensorFlow is running"
HEADROOM_MIB = 1536


def refusal(shell: InteractiveShell, warm: bool, settle: float, batch: int) -> tuple[float, int | None]:
    """Seconds from the cell's start to its refusal, and the batch the refusal named."""
    SESSION.preflight_replays.clear()  # each round probes: no refusal's replay kept from the round before
    probe_runs.end_warm()
    shell.run_line_magic("tfmem", f"limit {shell.user_ns['limit']}MiB")
    if warm:
        time.sleep(settle)
    else:
        probe_runs.end_warm()
    started = time.perf_counter()
    shell.run_cell(
        f"%%tfmem --quick --no-panel --as r\nm = build()\nm.fit(x, y, batch_size={batch}, epochs=1, verbose=0)"
    )
    took = time.perf_counter() - started
    report = shell.user_ns["r"]
    assert report.status == "refused" and report.preflight is not None and not report.preflight.kept, report.notes
    shell.run_line_magic("tfmem", "limit off")
    return took, report.preflight.largest_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None, help="write the seconds to this results file")
    args = parser.parse_args()
    shell = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
    shell.run_line_magic("load_ext", "tfmem_magic")
    shell.run_cell(SETUP)
    results: dict = {
        "command": f"python benchmarks/refusal_time.py --rounds {args.rounds} --settle {args.settle:g} "
        f"--models {args.models}",
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__, "cores": os.cpu_count()},
        "settle": args.settle,
        "models": [],
    }
    for name in args.models.split(","):
        code, batch = MODELS[name]
        shell.run_cell(code + WARM_UP)
        shell.user_ns["limit"] = psutil.Process().memory_info().rss // 2**20 + HEADROOM_MIB
        times: dict[str, list[float]] = {"cold": [], "warm": []}
        named = []
        for n in range(args.rounds):
            for kind in ("cold", "warm"):
                took, largest = refusal(shell, kind == "warm", args.settle, batch)
                times[kind].append(round(took, 2))
                named.append(largest)
                print(f"{name} round {n + 1}: {kind} refusal in {took:.1f} s, named {largest}", flush=True)
        cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
        print(f"{name} median: cold {cold:.1f} s, warm {warm:.1f} s ({warm / cold:.2f}x)", flush=True)
        results["models"].append({"model": name, "batch": batch, "headroom_mib": HEADROOM_MIB, **times, "named": named})
        shell.run_cell("del x, y, build, m, r\nimport gc; gc.collect()")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
