"""What TensorFlow's CPU allocator holds free, read from one small allocation traced by the profiler: the pool's free
bytes and its largest free chunk, checked against what the process does when a tensor of about that size is made.

TensorFlow's BFC allocator writes a `fragmentation` stat on every memory event (1 - largest free chunk / free bytes,
with the free bytes the regions less the bytes in use; `BFCAllocator::AddTraceMe`, `GetFragmentation`). One
uninitialised tensor of `PROBE` bytes, made and freed under the profiler, gives two events: before the free (in use
u1, fragmentation f1) and after it (u0, f0). Where the probe came from a chunk other than the largest (f1 < f0: the
free bytes fell and the largest chunk did not), the free bytes before it are A = c (1 - f1) / (f0 - f1), c the
probe's chunk, and the largest free chunk L = A (1 - f0). Where f1 >= f0 the probe took the largest chunk, and this
says "not known".

Each scenario runs in a fresh process (TF_CPU_ALLOCATOR_USE_BFC=1, as tfmem sets it), reads L, then makes a tensor
of 0.95 L and, in a second fresh process of the same scenario, one of 1.10 L (both written, so their pages count).
What the first grew the process by says how much of the largest free chunk was resident: a region's pages are
resident only where a chunk was written before, and the largest free chunk is often the untouched end of the
newest region, so the chunk's size alone does not say what a step placed there would cost the process.

    python benchmarks/held_layout.py

Prints one line per scenario; docs/preflight.md ("What TensorFlow's allocator holds free") keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MiB = 1 << 20
PROBE = 1 << 20  # small against a held pool, large enough for the stat's six digits (docs/preflight.md)

SCENARIOS = {
    "six 32 MiB tensors, the 2nd and 4th freed": "layout",
    "a CNN's fit at batch 256, model kept": "cnn",
    "an MLP's fit at batch 2048, then deleted": "mlp",
}

CHILD = r"""
import glob, json, os, sys, tempfile
import numpy as np, psutil
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

scenario, scale = sys.argv[1], float(sys.argv[2])
keep = []
if scenario == "layout":
    big = [tf.zeros([8 << 20]) for _ in range(6)]
    del big[1], big[3]
    keep.append(big)
else:
    import keras
    if scenario == "cnn":
        model = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                                  keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                                  keras.layers.Dense(10)])
        x, y = np.random.rand(512, 64, 64, 3).astype("float32"), np.random.randint(0, 10, 512)
        batch = 256
    else:
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
        x, y = np.random.rand(4096, 512).astype("float32"), np.random.randint(0, 10, 4096)
        batch = 2048
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    if scenario == "cnn":
        keep.append(model)
    else:
        del model

def events(nbytes):
    folder = tempfile.mkdtemp()
    tf.profiler.experimental.start(folder)
    t = tf.raw_ops.Empty(shape=[nbytes // 4], dtype=tf.float32, init=False)
    del t
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    space.ParseFromString(open(glob.glob(folder + "/**/*.xplane.pb", recursive=True)[0], "rb").read())
    found = []
    for plane in space.planes:
        stats = {k: v.name for k, v in plane.stat_metadata.items()}
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                if names.get(ev.metadata_id) in ("MemoryAllocation", "MemoryDeallocation"):
                    s = {stats[x.metadata_id]: (x.double_value if x.HasField("double_value") else x.int64_value
                         if x.HasField("int64_value") else x.uint64_value) for x in ev.stats}
                    found.append((ev.offset_ps + line.timestamp_ns * 1000, names[ev.metadata_id], s))
    found.sort(key=lambda e: e[0])
    return [(kind, s) for _, kind, s in found]

evs = [(k, s) for k, s in events(%(probe)d) if s.get("allocation_bytes", 0) >= %(probe)d]
(_, after_alloc), (_, after_free) = evs[0], evs[-1]
c, f1, f0 = after_alloc["allocation_bytes"], after_alloc["fragmentation"], after_free["fragmentation"]
out = {"in_use": after_free["bytes_allocated"], "f0": f0, "f1": f1, "chunk": c}
if f1 < f0:
    free = c * (1 - f1) / (f0 - f1)
    out.update(free=free, largest=free * (1 - f0))
if scale > 0 and "largest" in out:
    rss = psutil.Process().memory_info().rss
    t = tf.ones([int(out["largest"] * scale) // 4])
    _ = float(tf.reduce_sum(t[:1]))
    out["grew"] = psutil.Process().memory_info().rss - rss
print("RESULT " + json.dumps(out))
"""


def child(scenario: str, scale: float) -> dict:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", CHILD % {"probe": PROBE}, scenario, str(scale)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{scenario}: no result\n{done.stderr[-2000:]}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for label, scenario in SCENARIOS.items():
        fits, over = child(scenario, 0.95), child(scenario, 1.10)
        if "largest" not in fits:
            print(f"{label}: the probe took the largest chunk (f {fits['f1']} >= {fits['f0']}): not known")
            continue
        print(
            f"{label}: in use {fits['in_use'] / MiB:.1f} MiB, free {fits['free'] / MiB:.1f} MiB, largest free chunk "
            f"{fits['largest'] / MiB:.1f} MiB (the second process read {over.get('largest', 0) / MiB:.1f}); "
            f"a tensor of 0.95x it grew the process by {fits['grew'] / MiB:.1f} MiB, "
            f"one of 1.10x by {over.get('grew', 0) / MiB:.1f} MiB"
        )


if __name__ == "__main__":
    main()
