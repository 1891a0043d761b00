"""How much of what a CPU process grows by besides TensorFlow's peak is the allocator's own address range: the pages
its regions' chunks have ever been handed out from (RSS counts a page once it is written, and BFC keeps its regions),
against the bytes in use that TensorFlow's peak counts.

    python benchmarks/touched_slack.py [--models bilstm,attention,cnn,mlp] [--out FILE]

For each model, the zoo's cell (benchmarks/predict_accuracy.py's worker, "anchor" mode at batch 32) runs with
`calibrate=True`, and the step replay's two probe traces are kept. Both probes' op orders are replayed at each batch
through the simulator (analyze/bfc.py), and for each region the highest chunk end any allocation reached is summed:
"touched". The fresh runs are the ones benchmarks/results/predict_accuracy*.json hold (no new ones): TensorFlow's
peak and what the process grew by, medians. Read in docs/accuracy.md, "Part of it is the allocator's own pages".
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import predict_accuracy as pa

from tfmem_magic.analyze import step_replay

ROOT = Path(__file__).resolve().parents[1]
RESULTS = [ROOT / "benchmarks" / "results" / name for name in ("predict_accuracy.json", "predict_accuracy_held.json")]
BATCHES = [8, 16, 64, 128, 256]
MiB = 2**20

# prepended to the worker: the step replay's probe traces, written where the benchmark reads them
KEEP = """
from tfmem_magic.analyze import step_replay as _kept
_checked = _kept.checked
def _keep(low, high, low_batch, high_batch, gpu_growth=True):
    _kept.save_events(low, FOLDER + "/probe-%d.npz" % low_batch)
    _kept.save_events(high, FOLDER + "/probe-%d.npz" % high_batch)
    return _checked(low, high, low_batch, high_batch, gpu_growth)
_kept.checked = _keep
"""


def touched(batch: int, check: step_replay.CheckedReplays) -> tuple[int, int, int]:
    """The larger op order's (peak in use, pages ever handed out, peak region bytes) at `batch`."""
    rows = []
    for replay in check.replays:
        result = replay.run(batch)
        ends: dict[int, int] = {}
        for address, chunk, base in zip(result.addresses, result.chunk_bytes, result.region_bases, strict=True):
            if chunk:
                ends[base] = max(ends.get(base, 0), address + chunk - base)
        rows.append((result.peak_bytes_in_use, sum(ends.values()), result.peak_region_bytes))
    return max(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bilstm,attention,cnn,mlp")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fresh = {m["model"]: m for path in RESULTS for m in json.loads(path.read_text())["models"]}
    results: dict = {"command": f"python benchmarks/touched_slack.py --models {args.models}", "models": {}}
    worker = pa.WORKER
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as folder:
            pa.WORKER = KEEP.replace("FOLDER", repr(folder)) + worker
            cell = pa.run(model, "anchor", 32, [*BATCHES, 32], 10**12)
            low_batch, high_batch = cell["replay"]["probes"]
            low, high = (step_replay.load_events(f"{folder}/probe-{b}.npz") for b in (low_batch, high_batch))
        check = step_replay.checked(low, high, low_batch, high_batch)
        rows = {}
        for batch in BATCHES:
            in_use, pages, regions = touched(batch, check)
            tf = statistics.median(fresh[model]["runs"][str(batch)])
            grown = statistics.median(fresh[model]["grown"][str(batch)])
            rows[batch] = {"in use": in_use, "touched": pages, "regions": regions, "fresh tf": tf, "fresh grown": grown}
            print(
                f"{model:<10} {batch:>4}: replayed {in_use / MiB:6.1f} MiB in use, {pages / MiB:6.1f} touched "
                f"(+{(pages - in_use) / MiB:5.1f}), {regions / MiB:6.1f} in regions | fresh: TF {tf / MiB:6.1f}, "
                f"outside {(grown - tf) / MiB:6.1f}",
                flush=True,
            )
        results["models"][model] = {"probes": [low_batch, high_batch], "batches": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
