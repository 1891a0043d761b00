"""Does a long session grow because of tfmem? Run N profiled cells (a one-epoch Keras `fit` of 512 rows on a small
model) in a real kernel, and the same cells in a control kernel without tfmem, and print each kernel's RSS growth
after the first WARM cells. One fresh kernel per variant: the control, `%%tfmem` (trace, the default) and
`%%tfmem --quick`, each with the panel and with `--no-panel`.

    .venv/bin/python benchmarks/session_growth.py [--cells 200] [--warm 20] [--variants control,trace,...]
    .venv/bin/python benchmarks/session_growth.py --cells 60 --holdings   # what each variant's kernel holds

`--holdings` also prints, at the warm cell and at the end, what tfmem and the kernel hold that could grow with the
cells: the history's reports and their bytes, the live widgets and comms, IPython's output cache, matplotlib's
figures, the session's per-cell maps. docs/session.md has the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import test_kernel_faults as faults  # noqa: E402  the tests' real-kernel driver

MARK = faults.MARK
# the user's cells: a small model and 512 rows, made once; each profiled cell fits it for one epoch
SETUP = """
import gc, json, os, numpy as np, keras
keras.utils.set_random_seed(0)
x = np.random.rand(512, 32).astype("float32"); y = np.random.randint(0, 10, 512)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

def _rss():
    gc.collect()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
"""
FIT = "model.fit(x, y, epochs=1, batch_size=32, verbose=0)"
VARIANTS = {
    "control": "",
    "trace": "%%tfmem\n",
    "trace-no-panel": "%%tfmem --no-panel\n",
    "quick": "%%tfmem --quick\n",
    "quick-no-panel": "%%tfmem --quick --no-panel\n",
}
# what could grow with the cells, read inside the kernel (the control kernel has no tfmem; an older tfmem has no caps)
HOLDINGS = """
def _holdings():
    import sys
    out = {"output_cache": len(get_ipython().user_ns.get("Out", {}))}
    if "ipywidgets" in sys.modules:
        from ipywidgets.widgets import widget
        out["widgets"] = len(widget._instances)
    if "comm" in sys.modules:
        out["comms"] = len(sys.modules["comm"].get_comm_manager().comms)
    if "matplotlib.pyplot" in sys.modules:
        out["figures"] = len(sys.modules["matplotlib.pyplot"].get_fignums())
    if "tfmem_magic" in sys.modules:
        from tfmem_magic.core.report import footprint
        from tfmem_magic.core.session import SESSION
        out["history"] = len(SESSION.history)
        out["history_bytes"] = sum(footprint(r) for r in SESSION.history)
        out["live_panels"] = len(SESSION.panels) if hasattr(SESSION, "panels") else None
        out["session"] = {k: len(v) for k, v in vars(SESSION).items() if isinstance(v, (dict, list)) and v}
    return out
"""


def rss(kernel: faults.Kernel) -> int:
    got = kernel.run(f"print({MARK!r} + json.dumps(_rss()))")
    assert got["error"] is None, got["stdout"]
    return int(got["data"])


def holdings(kernel: faults.Kernel) -> dict:
    got = kernel.run(f"print({MARK!r} + json.dumps(_holdings()))")
    assert got["error"] is None, got["stdout"]
    return dict(got["data"])


def run_variant(variant: str, cells: int, warm: int, holdings_too: bool = False, show: bool = False) -> dict:
    """One fresh kernel: the setup, `cells` cells of the variant; RSS after the warm cells and at the end, and with
    `holdings_too` what the kernel holds at the end (`show`: printed, after the warm cells and at the end)."""
    kernel = faults.Kernel(Path(tempfile.mkdtemp(prefix="session-growth-")))
    try:
        load = "" if variant == "control" else "%load_ext tfmem_magic\n"
        assert kernel.run(load + SETUP + HOLDINGS)["error"] is None
        seconds, readings, held = [], {}, {}
        for i in range(1, cells + 1):
            began = time.perf_counter()
            # a new cell each time (its own source, so its own cell key), as in a notebook: no cell's re-run closes
            # the panel of another
            done = kernel.run(f"{VARIANTS[variant]}{FIT}  # cell {i}")
            seconds.append(time.perf_counter() - began)
            assert done["error"] is None, done["stdout"]
            if i in (warm, cells) or i % 50 == 0:
                readings[i] = rss(kernel)
                if (show or holdings_too) and i in (warm, cells):
                    held = holdings(kernel)
                    if show:
                        print(f"  {variant} after cell {i}: {json.dumps(held)}", flush=True)
        return {
            "warm_bytes": readings[warm],
            "end_bytes": readings[cells],
            "growth_bytes": readings[cells] - readings[warm],
            "readings": readings,
            "median_s": statistics.median(seconds),
            "holdings": held,
        }
    finally:
        kernel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--warm", type=int, default=20, help="growth is counted from this cell on (20)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--holdings", action="store_true", help="also print what each kernel holds")
    args = parser.parse_args()
    mib = 2**20
    results = {}
    for variant in args.variants.split(","):
        began = time.time()
        result = results[variant] = run_variant(variant, args.cells, args.warm, show=args.holdings)
        steps = ", ".join(f"{i}: {b / mib:.0f}" for i, b in result["readings"].items())
        print(f"{variant:>15}: RSS MiB after cell {steps}; {time.time() - began:.0f} s", flush=True)
    control = results.get("control")
    header = f"{'variant':>15} {'RSS at ' + str(args.warm):>10} {'growth':>8} {'over control':>13}"
    print(f"\n{header}  ({args.cells} cells)")
    for variant, result in results.items():
        over = f"{(result['growth_bytes'] - control['growth_bytes']) / mib:+.1f}" if control else "-"
        print(f"{variant:>15} {result['warm_bytes'] / mib:>9.0f}M {result['growth_bytes'] / mib:>+7.1f}M {over:>12}M")


if __name__ == "__main__":
    main()
