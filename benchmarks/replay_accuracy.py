"""The step replay from a fresh allocator, measured: a process traces a model from TensorFlow's first op (the clone
built, two training steps at the cell's batch) with nothing paused, and that whole allocation sequence is replayed
through tfmem's BFC simulator (analyze/bfc.py) at other batches, each allocation whose shape carries the batch scaled
to it. The predictions are compared with the same process run for real at those batches, each in a fresh process.

    .venv/bin/python benchmarks/replay_accuracy.py [--models mobilenetv2,cnn,mlp] [--anchor 32] [--batches 8,16,64]
                                                   [--probes 23,37]

It prints, per model: the self-check (the replay at the cell's own batch against TensorFlow's bytes in use after
every event), and per batch the real peak, the replayed one and the error, with each replay's time; with `--probes`,
also the replay from per-allocation lines through two odd-batch probe traces (a first form of the replay basis). The
trace is unbounded here (no segment budget, no plateau pause): what a probe process records; docs/bfc-replay.md has
the results and what the replay basis still needs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _fresh import KEEP_TRACE, run_fresh

MODELS = {
    "mobilenetv2": ("(64, 64, 3)", "keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)"),
    "cnn": (
        "(64, 64, 3)",
        """keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPool2D(),
        keras.layers.Flatten(), keras.layers.Dense(10)])""",
    ),
    "mlp": (
        "(784,)",
        """keras.Sequential([keras.Input((784,)), keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])""",
    ),
}

# one process: everything from TensorFlow's first op traced, unpaused; the trace's columns saved for the replay
WORKER = (
    """
import pickle, sys
import numpy as np
import tfmem_magic
tfmem_magic.prepare()
from tfmem_magic.measure import tracer, xplane
tracer.TRACE_BUDGET_BYTES = 0  # one segment: nothing rotated, nothing lost between segments
tracer.PLATEAU_S = 1e9  # never paused: graph building's flat stretches are part of the sequence
"""
    + KEEP_TRACE
    + """
import tensorflow as tf
with tfmem_magic.profile(trace_seconds=1200) as p:
    import keras
    m = {build_model}
    m.compile("adam", "sparse_categorical_crossentropy")
    x = tf.constant(np.random.rand({batch}, *{shape}).astype("float32"))
    y = tf.constant(np.random.randint(0, 10, {batch}))
    m.train_on_batch(x, y)
    m.train_on_batch(x, y)
ev = kept["trace"].events
names = ("t_ps", "is_alloc", "live", "requested", "chunk", "addr", "dtype", "op", "region", "shape", "thread",
         "strings", "threads", "allocator", "limit")
out = {{k: getattr(ev, k) for k in names}}
out["peak"] = p.report.tf_peak_bytes
out["windows"] = len(p._measurement.tracer.windows)
out["weight_shapes"] = sorted({{"[" + ",".join(str(d) for d in v.shape) + "]" for v in m.weights}})
pickle.dump(out, open({path!r}, "wb"))
"""
)


def record(model: str, batch: int, folder: Path) -> dict:
    shape, build_model = MODELS[model]
    path = folder / f"{model}-{batch}.pkl"
    code = WORKER.format(build_model=textwrap.dedent(build_model), batch=batch, shape=shape, path=str(path))
    run_fresh(code, f"{model} at batch {batch}", timeout=1800)
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def replay_at(data: dict, anchor: int, batches: list[int]) -> tuple[object, dict[int, tuple[int, float]]]:
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tfmem_magic.analyze import bfc
    from tfmem_magic.analyze.analysis import batch_dimension
    from tfmem_magic.measure.xplane import MemoryEvents

    columns = {
        k: data[k]
        for k in ("t_ps", "is_alloc", "live", "requested", "chunk", "addr", "dtype", "op", "region", "shape", "thread")
    }
    events = MemoryEvents(
        **columns, strings=data["strings"], threads=data["threads"], allocator=data["allocator"], limit=data["limit"]
    )
    check = bfc.self_check(events)
    weights = set(data["weight_shapes"])
    shapes = [events.string(int(i)) for i in events.shape]
    scaled = np.array(
        [
            bool(events.is_alloc[i])
            and shapes[i] is not None
            and shapes[i] not in weights
            and batch_dimension(shapes[i], anchor)
            for i in range(len(events))
        ]
    )
    requested = np.array(check.prepared.requested, dtype=np.int64)
    out = {}
    for batch in batches:
        started = time.perf_counter()
        sizes = np.where(scaled, requested * batch // anchor, requested).tolist()
        peak = bfc.replay_prepared(check.prepared, requested=sizes).peak_bytes_in_use
        out[batch] = (peak, time.perf_counter() - started)
    return check, out


def probe_lines(low: dict, high: dict, b_low: int, b_high: int) -> tuple[object, list[tuple[int, float]]]:
    """A first form of the replay basis: two probe traces at odd batches (no layer width collides with them),
    their allocations aligned by (op, dtype, rank) and occurrence, and a line per allocation (intercept + slope x
    batch) through the two sizes. Allocations that do not align keep probe one's size. Returns probe one's prepared
    replay and the (intercept, slope) of each of its events' requested bytes."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tfmem_magic.analyze import bfc
    from tfmem_magic.measure.xplane import MemoryEvents

    def events_of(data: dict) -> MemoryEvents:
        columns = {
            k: data[k]
            for k in (
                "t_ps",
                "is_alloc",
                "live",
                "requested",
                "chunk",
                "addr",
                "dtype",
                "op",
                "region",
                "shape",
                "thread",
            )
        }
        return MemoryEvents(
            **columns,
            strings=data["strings"],
            threads=data["threads"],
            allocator=data["allocator"],
            limit=data["limit"],
        )

    def keyed(ev: MemoryEvents) -> dict[tuple, list[int]]:
        out: dict[tuple, list[int]] = {}
        for i in np.nonzero(ev.is_alloc)[0]:
            shape = ev.string(int(ev.shape[i])) or ""
            key = (
                ev.string(int(ev.op[i])) if ev.op[i] >= 0 else None,
                int(ev.dtype[i]),
                shape.count(",") if shape else -1,
            )
            out.setdefault(key, []).append(int(i))
        return out

    ev_low, ev_high = events_of(low), events_of(high)
    check = bfc.self_check(ev_low)
    lines = [(int(r), 0.0) for r in ev_low.requested]  # frees too: replay_prepared reads allocations' sizes only
    high_keys = keyed(ev_high)
    for key, rows in keyed(ev_low).items():
        others = high_keys.get(key, [])
        for i, j in zip(rows, others, strict=False):
            a, b = int(ev_low.requested[i]), int(ev_high.requested[j])
            slope = (b - a) / (b_high - b_low)
            lines[i] = (a - slope * b_low, slope)
    return check, lines


def replay_lines(check: object, lines: list[tuple[int, float]], batch: int) -> int:
    from tfmem_magic.analyze import bfc

    sizes = [max(1, int(round(a + b * batch))) for a, b in lines]
    return bfc.replay_prepared(check.prepared, requested=sizes).peak_bytes_in_use  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--anchor", type=int, default=32)
    parser.add_argument("--batches", default="8,16,64")
    parser.add_argument(
        "--probes",
        default="23,37",
        help="two odd probe batches for the per-allocation lines (empty: shape scaling only)",
    )
    args = parser.parse_args()
    probes = [int(b) for b in args.probes.split(",")] if args.probes else []
    batches = [int(b) for b in args.batches.split(",")]
    began = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="tfmem-replay-"))
    errors: list[float] = []
    probe_errors: list[float] = []
    for model in args.models.split(","):
        cell = record(model, args.anchor, folder)
        check, predicted = replay_at(cell, args.anchor, batches)
        print(
            f"{model}: {check.events} events in {cell['windows']} window(s); self-check at batch {args.anchor}: "
            f"{check.events_exact}/{check.events} events exact, peak {check.peak_error:+.2%}",
            flush=True,
        )
        lined = None
        if probes:
            low, high = (record(model, b, folder) for b in probes)
            lined = probe_lines(low, high, *probes)
        for batch in batches:
            real = record(model, batch, folder)["peak"]
            peak, seconds = predicted[batch]
            error = (peak - real) / real
            errors.append(abs(error))
            line = ""
            if lined is not None:
                from_probes = replay_lines(*lined, batch)
                line_error = (from_probes - real) / real
                probe_errors.append(abs(line_error))
                line = f"; from probes {probes}: {from_probes / 2**20:8.1f} MiB, {line_error:+6.1%}"
            print(
                f"  batch {batch:>4}: real {real / 2**20:8.1f} MiB, shape-scaled {peak / 2**20:8.1f} MiB, "
                f"{error:+6.1%} ({seconds:.2f} s){line}",
                flush=True,
            )
    print(
        json.dumps(
            {
                "max_abs_error": round(max(errors), 4),
                "points": len(errors),
                "probes_max_abs_error": round(max(probe_errors), 4) if probe_errors else None,
                "minutes": round((time.perf_counter() - began) / 60, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
