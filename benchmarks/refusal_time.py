"""How long a refusal takes, with the probe processes started cold and warm (advise/probe_runs.py, `warm_up`), side
by side in one run: a CNN (two Conv2D(64) over 64x64x3 images, the real-kernel test's) at batch 1024 under a limit
1.5 GiB over the process, in a real IPython shell with the extension loaded; each round builds the model again in
the cell (so no kept replay answers it) and alternates cold and warm. A warm round's probes were started by
`%tfmem limit` and given `--settle` seconds to import TensorFlow, as a user's next cell would.

    python benchmarks/refusal_time.py [--rounds 3] [--settle 15]

Prints each round's seconds from the cell's start to the refusal, and the medians (docs/preflight.md, "Warm
probes"). Target: a refusal in 10 s or less (median) on a 2-core machine.
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

from tfmem_magic.advise import probe_runs  # noqa: E402
from tfmem_magic.core.session import SESSION  # noqa: E402

SETUP = """
import numpy as np, keras, psutil
keras.utils.set_random_seed(0)
x = np.random.rand(2048, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 2048)
def build():
    model = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model
build().fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # TensorFlow is running
limit = psutil.Process().memory_info().rss // 2**20 + 1536
"""


def refusal(shell: InteractiveShell, warm: bool, settle: float) -> float:
    SESSION.preflight_replays.clear()  # each round probes: no refusal's replay kept from the round before
    probe_runs.end_warm()
    shell.run_line_magic("tfmem", f"limit {shell.user_ns['limit']}MiB")
    if warm:
        time.sleep(settle)
    else:
        probe_runs.end_warm()
    started = time.perf_counter()
    shell.run_cell("%%tfmem --quick --no-panel --as r\nm = build()\nm.fit(x, y, batch_size=1024, epochs=1, verbose=0)")
    took = time.perf_counter() - started
    report = shell.user_ns["r"]
    assert report.status == "refused" and report.preflight is not None and not report.preflight.kept, report.notes
    shell.run_line_magic("tfmem", "limit off")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0)
    args = parser.parse_args()
    shell = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
    shell.run_line_magic("load_ext", "tfmem_magic")
    shell.run_cell(SETUP)
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    for n in range(args.rounds):
        for kind in ("cold", "warm"):
            times[kind].append(refusal(shell, kind == "warm", args.settle))
            print(f"round {n + 1}: {kind} refusal in {times[kind][-1]:.1f} s", flush=True)
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    print(f"median: cold {cold:.1f} s, warm {warm:.1f} s ({warm / cold:.2f}x)")


if __name__ == "__main__":
    main()
