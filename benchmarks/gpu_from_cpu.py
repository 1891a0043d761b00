"""A step measured on a CPU, modelled for a GPU (`predict(report, gpu=...)`), against real GPU traces of the same
models: two Keras CNNs whose notebooks and TensorBoard profiles (Tesla T4, TF 2.4, batch 256, Adam) are public.

    python benchmarks/gpu_from_cpu.py --traces DIR [--out FILE]

DIR holds the traces as `a22.xplane.pb` and `b23.xplane.pb` (they carry no licence, so they are not in this
repository; `fetch` or clone the repositories below and copy the files named in TRACES). Each model is rebuilt as
its notebook wrote it (Keras 3 here, tf.keras 2.4 there) and trained on random data of Fashion-MNIST's shape in a
fresh process: one warm epoch, then one traced epoch of four steps. Compared: the allocator's limit reckoned from
the card's memory with TensorFlow's; the peak predicted for the GPU with the traced step's (over what its
allocator held at the trace's start); the verdict at the batch that ran; and tensor by tensor, what was live at
each peak (a tensor's shape is taken without its layout: the GPU ran NCHW, the CPU NHWC). Read in docs/gpu.md,
"From a CPU run to a GPU".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu_from_cpu.json"
T4_MEMORY = 15_843_721_216  # nvidia-smi's figure for a Tesla T4 (the traces' machine: 15,843,721,216 B)
T4_CAPABILITY = 7.5
TRACES = {
    "a22": (
        "ecbme4040/e4040-2022fall-assign2-yg2820@2b3d389f: task3_cnn.ipynb, cells 26-30; logs/fit/20221104-215722/"
        "train/plugins/profile/2022_11_04_21_57_24/instance-ecbm.xplane.pb"
    ),
    "b23": (
        "ecbme4040/e4040-2023fall-assign2-hd2551@5b75eba2: task3-cnn.ipynb, cells 28-31; logs/fit/20231107-184716/"
        "train/plugins/profile/2023_11_07_18_47_18/instance-2.xplane.pb"
    ),
}
MODELS = {
    "a22": """[tf.keras.Input((28, 28, 1)),
        L.Conv2D(6, (6, 6), activation="relu", padding="same"), L.Conv2D(6, (3, 3), activation="relu", padding="same"),
        L.Conv2D(6, (3, 3), activation="relu", padding="same"), L.MaxPooling2D((2, 2)), L.Flatten(),
        L.Dense(100, activation="relu"), L.Dense(10, activation="softmax")]""",
    "b23": """[tf.keras.Input((28, 28, 1)),
        L.Conv2D(32, (3, 3), activation="relu"), L.BatchNormalization(), L.MaxPooling2D((2, 2)), L.Dropout(0.25),
        L.Conv2D(64, (3, 3), activation="relu"), L.BatchNormalization(), L.MaxPooling2D((2, 2)), L.Dropout(0.25),
        L.Conv2D(128, (3, 3), activation="relu"), L.BatchNormalization(), L.MaxPooling2D((2, 2)), L.Dropout(0.25),
        L.Flatten(), L.Dense(256, activation="relu"), L.BatchNormalization(), L.Dropout(0.5),
        L.Dense(10, activation="softmax")]""",
}
BATCH = 256
WORKER = """
import json, sys
import numpy as np
import tfmem_magic
tfmem_magic.prepare()
import tensorflow as tf
from tensorflow.keras import layers as L
model = tf.keras.Sequential(LAYERS)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
rng = np.random.default_rng(0)
x = rng.random((BATCH * 4, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, BATCH * 4)
model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
with tfmem_magic.profile() as p:
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
open(OUT, "w").write(p.report.to_json())
"""


def cpu_report(name: str, folder: Path) -> Path:
    out = folder / f"{name}.json"
    code = WORKER.replace("LAYERS", MODELS[name]).replace("BATCH", str(BATCH)).replace("OUT", repr(str(out)))
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=600)
    return out


def _key(dtype: str | None, shape: str | None) -> tuple[str, tuple[int, ...]]:
    """A tensor's dtype and its dimensions without their order: NCHW on the GPU is NHWC on the CPU."""
    dims = tuple(sorted(int(d) for d in (shape or "[]").strip("[]").split(",") if d.strip().isdigit()))
    return dtype or "?", dims


def _live(trace: object) -> Counter[tuple[str, tuple[int, ...]]]:
    """Bytes live at the peak by tensor kind, workspaces and what the trace's start held left out."""
    live: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for g in trace.at_peak:  # type: ignore[attr-defined]
        if g.phase not in ("workspace", "pre-existing"):
            live[_key(g.dtype, g.shape)] += g.bytes
    return live


def _top(live: Counter[tuple[str, tuple[int, ...]]], other: Counter[tuple[str, tuple[int, ...]]]) -> list[list]:
    """The four kinds of tensor `live` holds most more of than `other`, with how much more."""
    more = sorted(live, key=lambda k: other.get(k, 0) - live[k])[:4]
    return [[f"{k[0]}{list(k[1])}", live[k] - other.get(k, 0)] for k in more if live[k] > other.get(k, 0)]


def compare(name: str, trace_path: Path, report_path: Path) -> dict:
    import tfmem_magic
    from tfmem_magic import GpuTarget, Report

    gpu = tfmem_magic.analyze_xplane(str(trace_path), batch_size=BATCH)
    cpu = Report.from_json(report_path.read_text())
    main = gpu.tf[gpu.main_device_name]
    start = main.baseline_bytes
    step = main.peak_bytes - start
    workspace = sum(g.bytes for g in gpu.trace.by_phase if g.phase == "workspace")
    target = GpuTarget(T4_MEMORY, T4_CAPABILITY)
    pred = tfmem_magic.predict(cpu, batch_size=BATCH, gpu=target)
    g_live, c_live = _live(gpu.trace), _live(cpu.trace)
    matched = sum(min(g_live[k], c_live[k]) for k in g_live)
    return {
        "model": name,
        "source": TRACES[name],
        "gpu_limit": gpu.env.device_limit_bytes.get(gpu.main_device_name),
        "limit_reckoned": target.limit_bytes,
        "gpu_step": step,
        "gpu_workspace_at_peak": workspace,
        "gpu_lifetime_over_start": (main.lifetime_peak_bytes or 0) - start,
        "cpu_step": (cpu.tf_peak_bytes or 0) - cpu.main_device.baseline_bytes,
        "predicted": pred.peak_bytes,
        "predicted_workspace": pred.split["workspace"],
        "band": [pred.below, pred.error_band],
        "fits": pred.fits,
        # what "fits" judged: the tensors' upper estimate and a whole workspace cap (TensorFlow's default here)
        "upper": round((pred.peak_bytes - pred.split["workspace"]) * (1 + pred.error_band))
        + target.workspace_cap_bytes,
        "largest_batch": pred.largest_batch,
        "rows": cpu.model.samples if cpu.model else None,  # the rows the rebuild trained on: the largest batch's cap
        "error": pred.peak_bytes / step - 1,
        "in_band": pred.peak_bytes * (1 - pred.below) <= step <= pred.peak_bytes * (1 + pred.error_band),
        "tensors_gpu": sum(g_live.values()),
        "tensors_cpu": sum(c_live.values()),
        "tensors_matched": matched,
        "gpu_only": _top(g_live, c_live),
        "cpu_only": _top(c_live, g_live),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", required=True, type=Path, help="a folder with a22.xplane.pb and b23.xplane.pb")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            trace = args.traces / f"{name}.xplane.pb"
            if not trace.exists():
                sys.exit(f"{trace}: missing; {TRACES[name]}")
            rows.append(compare(name, trace, cpu_report(name, Path(tmp))))
            print(json.dumps(rows[-1]))
    args.out.write_text(json.dumps({"batch": BATCH, "gpu_memory": T4_MEMORY, "models": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
