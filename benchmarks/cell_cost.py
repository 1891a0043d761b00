"""What one profiled cell costs beyond its own code: a trivial cell run bare, under `%%tfmem --quick` and under
`%%tfmem` (trace), alternating in one IPython shell (TensorFlow started), every round in a rotated order so that
drift hits each alike. It prints the median milliseconds per cell of each and their difference to bare: the fixed
cost of measuring, building the report, its findings and its panel (display included, sent nowhere).

    python benchmarks/cell_cost.py [--rounds 40] [--sleep 0]

`--sleep S` makes the cell sleep S seconds, so the sampler's timeline has points to draw (a cell of fewer than
`figures.MIN_POINTS` samples draws none: docs/overhead.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "tfmem_magic")
    shell.run_cell("import time, tensorflow as tf\nx = tf.ones((4, 4))")
    body = f"v = 1\ntime.sleep({args.sleep})" if args.sleep else "v = 1"
    modes = {"bare": body, "quick": "%%tfmem --quick\n" + body, "trace": "%%tfmem\n" + body}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds + 3):
        order = list(modes)[r % 3 :] + list(modes)[: r % 3]
        for mode in order:
            start = time.perf_counter()
            assert shell.run_cell(modes[mode]).success
            elapsed = time.perf_counter() - start
            if r >= 3:  # the first rounds warm up (matplotlib, the first trace)
                seconds[mode].append(elapsed)
            if hasattr(shell.display_pub, "outputs"):
                shell.display_pub.outputs.clear()
    bare = statistics.median(seconds["bare"])
    for mode, values in seconds.items():
        median = statistics.median(values)
        print(
            f"{mode:6s} {1000 * median:8.1f} ms per cell   (+{1000 * (median - bare):.1f} ms over bare, "
            f"{args.rounds} rounds, cell sleeps {args.sleep:g} s)"
        )


if __name__ == "__main__":
    main()
