"""What a CPU process grows by besides TensorFlow's allocator at a batch above a cell's, from fresh run to fresh run,
by default, with MALLOC_ARENA_MAX=2 (glibc's malloc arenas) and with TF_NUM_INTEROP_THREADS=1 (one op at a time):
what makes the spread that keeps the process margin (advise/bands.py, PROCESS_MARGIN) at +40%.

    python benchmarks/outside_growth.py [--points cnn:128,...] [--settings default,...] [--repeats 3] [--out FILE]

--out adds the runs to FILE's (benchmarks/results/outside_growth.json), with the command that made them.

Each point is a fresh process of benchmarks/predict_accuracy.py's worker ("measure" mode: one fit of the zoo's model
at the batch): TensorFlow's peak and what the process grew by. Read in docs/accuracy.md, "Why the named batch stops
near three quarters of the budget on a CPU".
"""

from __future__ import annotations

import argparse
import json
import os

import predict_accuracy as pa

POINTS = "cnn:128,wide-cnn:128,mobilenetv2:128,cnn:256"
SETTINGS = {
    "default": {},
    "MALLOC_ARENA_MAX=2": {"MALLOC_ARENA_MAX": "2"},
    "TF_NUM_INTEROP_THREADS=1": {"TF_NUM_INTEROP_THREADS": "1"},
}
MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict = {"commands": [], "points": {}}
    if args.out and os.path.exists(args.out):
        with open(args.out) as existing:
            results = json.load(existing)
    results["commands"].append(
        f"python benchmarks/outside_growth.py --points {args.points} --settings {args.settings} "
        f"--repeats {args.repeats}"
    )
    for setting in args.settings.split(","):
        for name in {k for v in SETTINGS.values() for k in v}:
            os.environ.pop(name, None)
        os.environ.update(SETTINGS[setting])  # the fresh processes inherit it (_fresh.fresh_env)
        for point in args.points.split(","):
            model, batch = point.split(":")
            for _ in range(args.repeats):
                run = pa.run(model, "measure", int(batch), [8, 16, 32, 64, 128, 256])
                tf, grown = run["measured"], run["grown"]
                results["points"].setdefault(f"{setting} {model} {batch}", []).append([tf, grown])
                print(
                    f"{setting:<26} {model:<12} {batch:>4}: TF {tf / MiB:6.0f} MiB, outside {(grown - tf) / MiB:+5.0f}"
                )
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
