"""The simulator's time per replay, the full record (`bfc.replay_prepared`: every event's bytes in use, chunk and
address, the live set at the peak) against the peaks alone (`bfc.replay_peaks`, what the step replay's searches
ask), side by side in one run, interleaved, on the real EfficientNetB0 trace the unit tests use
(tests/data/regions-efficientnetb0.npz, 166,314 events), at its own sizes and at sizes scaled as another batch's.
No TensorFlow needed.

    python benchmarks/replay_speed.py [--rounds 5]

Prints each method's median seconds and their ratio; docs/bfc-replay.md ("The peaks alone") keeps the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from test_bfc import _efficientnet_events  # noqa: E402

from tfmem_magic.analyze import bfc  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prepared = bfc.self_check(_efficientnet_events()).prepared
    assert prepared is not None
    for name, sizes in (("own sizes", None), ("sizes x1.7", [max(1, round(r * 1.7)) for r in prepared.requested])):
        times: dict[str, list[float]] = {"full": [], "peaks": []}
        for _ in range(args.rounds):
            started = time.perf_counter()
            full = bfc.replay_prepared(prepared, requested=sizes, memory_limit=bfc.UNLIMITED)
            times["full"].append(time.perf_counter() - started)
            started = time.perf_counter()
            peaks = bfc.replay_peaks(prepared, sizes, bfc.UNLIMITED)
            times["peaks"].append(time.perf_counter() - started)
            assert peaks == (full.peak_bytes_in_use, full.peak_region_bytes)
        a, b = statistics.median(times["full"]), statistics.median(times["peaks"])
        print(f"{name}: {prepared.events} events, full record {a:.3f} s, peaks alone {b:.3f} s ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
