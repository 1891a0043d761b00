"""The GPU check of tfmem_magic: what must hold on a GPU, in one run of a few minutes.

    python benchmarks/gpu_check.py          # on a machine with an NVIDIA GPU and TensorFlow built for it

Each scenario runs in a fresh Python process (TensorFlow reserves the GPU per process) and prints one JSON line;
this script prints them as a table and exits 1 if a check failed. Without a GPU it says so and exits 0. The whole run
keeps within --budget seconds (480 by default: a lent GPU machine's few minutes); a scenario the budget cuts short is
reported as timed out. `--scenario NAME` runs one scenario in this process and prints its JSON line (on a CPU too:
its checks then fail, which is how the script's own code is tested without a GPU).

Scenarios and what each checks:
- device:   a CNN's fit under profile(): the main device is GPU:0, the report's peak equals TensorFlow's own
            get_memory_info('GPU:0') peak, the trace kept GPU_0_bfc, the breakdown names the model's layers, and the
            budget is GPU:0's allocator limit (not the host's RAM)
- xla:      the same fit with jit_compile=True, and with Keras 3's default jit_compile="auto" (XLA on a GPU): the
            report says the step ran as XLA clusters, each time
- oom:      a tensor larger than the GPU: status oom, the request parsed (shape, GPU:0, GPU_0_bfc), process alive
- whatif:   predictions from batch 32 for 64, 128 and 256 against measured fits at those batches
- mixed:    mixed_float16 lowers the peak of the same fit; the what-if works (LossScaleOptimizer)
- fixes:    the memory-growth and gpu-memory-limit fix cells run in a fresh process and take effect there
- calibrate: the calibrated what-if (probes in a child process, next to this one's reservation) answers
- trace:    a fit at batch 32 recorded with TensorFlow's own profiler (as a user on a GPU machine would), read back
            with analyze_xplane(batch_size=32): the trace's own sequence replays (its self-check), and the what-if
            from it predicts batches 64 and 128 within its ±30% band of measured fits at those batches
- workspace: first two fresh processes (before this one reserves the GPU), TensorFlow's default and
            TF_CUDNN_WORKSPACE_LIMIT_IN_MB at half the largest workspace the default's profiled fit held (what the fix
            cell sets): the cap's saving on the peak and its cost in step time; then a CNN's fit at batch 128 here:
            cuDNN's workspaces at the peak are their own phase ("workspace"), the cudnn-workspace finding fires where
            they hold a tenth of the peak (docs/gpu.md, "Workspaces")
- firststep: a fresh model's first fit at batch 128 (autotuning inside it) against its steady fit, then the first
            fit at batch 256 (a new batch autotunes again) against the what-if from the steady 128: how much a first
            step holds over a steady one, and whether the what-if's judgement covers it (docs/gpu.md, "The first step")
- preflight: the kernel holds the GPU as TensorFlow does by default (no memory growth) and a fit's batch cannot fit
            the GPU: the pre-flight reads the GPU's limit, runs its probes on the CPU (every GPU hidden from them),
            refuses on the GPU's judgement, and the process lives on (docs/gpu.md, "A pre-flight while the kernel
            holds the GPU")
- fromcpu:  the model's fit at batch 128 profiled in a fresh process with every GPU hidden, modelled for this GPU
            (`predict(report, batch_size=256, gpu=...)` with nvidia-smi's memory and the compute capability), against
            a fresh model's first and steady fit at 256 on the GPU: the limit reckoned is under TensorFlow's, "fits"
            is never said where the first step did not fit, and how far the modelled peak is from the steady one
            (docs/gpu.md, "From a CPU run to a GPU")
- peaks:    what a MultiWorkerMirroredStrategy worker other than the chief serves instead of traces
            (measure/remote.window_peaks) while a fit runs on the GPU: GPU:0's allocator, its peak over the window
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SCENARIOS = (
    "device",
    "xla",
    "oom",
    "whatif",
    "mixed",
    "fixes",
    "calibrate",
    "trace",
    "workspace",
    "firststep",
    "preflight",
    "peaks",
    "fromcpu",
)
# a fresh process's fit, for the workspace scenario (argv: batch, "trace" or "plain"; the cap from its environment)
FIT_IN_A_FRESH_PROCESS = """
import json, sys, time
sys.path.insert(0, {folder!r})
import tfmem_magic
tfmem_magic.prepare()
import gpu_check, keras, tensorflow as tf
batch, traced = int(sys.argv[1]), sys.argv[2] == "trace"
x, y = gpu_check._data()
model = gpu_check._model(keras)
model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # built, traced and autotuned
device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
tf.config.experimental.reset_memory_stats(device)
started = time.perf_counter()
model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
out = {{"peak": tf.config.experimental.get_memory_info(device)["peak"],
       "step_ms": round(1000 * (time.perf_counter() - started) / (len(x) // batch), 2)}}
if traced:  # the largest workspace at a profiled fit's peak: what the fix's cap is half of
    with tfmem_magic.profile(label="workspaces") as p:
        model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1, verbose=0)
    out["largest_workspace"] = max((g.bytes for g in p.report.trace.at_peak if g.phase == "workspace"), default=0)
print(json.dumps(out))
"""
# a fresh process's profiled fit at batch 128 with every GPU hidden, its report on stdout (the fromcpu scenario)
PROFILE_ON_THE_CPU = """
import sys
sys.path.insert(0, {folder!r})
import tfmem_magic
tfmem_magic.prepare()
import gpu_check, keras
x, y = gpu_check._data()
model = gpu_check._model(keras)
model.fit(x[:128], y[:128], batch_size=128, epochs=1, verbose=0)
with tfmem_magic.profile(label="on the cpu") as p:
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
print(p.report.to_json())
"""
MiB = 2**20


def _model(keras, jit: bool | str = False, name: str = "gpu_cnn"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(64, 3, activation="relu", name="conv_a"),
            keras.layers.Conv2D(64, 3, activation="relu", name="conv_b"),
            keras.layers.GlobalAveragePooling2D(name="gap"),
            keras.layers.Dense(10, name="head"),
        ],
        name=name,
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
    return model


def _data(n: int = 1024):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.random((n, 64, 64, 3), dtype="float32"), rng.integers(0, 10, n)


def _fit(tfmem_magic, keras, batch: int, jit: bool | str = False, label: str = "fit"):
    x, y = _data()
    model = _model(keras, jit)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # build and trace outside the cell
    with tfmem_magic.profile(label=label) as p:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    return p.report


def scenario(name: str) -> dict:
    import tfmem_magic

    tfmem_magic.prepare()
    import keras
    import tensorflow as tf

    out: dict = {"scenario": name}
    if name == "device":
        tf.config.experimental.reset_memory_stats("GPU:0")
        report = _fit(tfmem_magic, keras, 64)
        own = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        layers = {g.layer for g in report.trace.by_layer}
        out.update(
            main=report.main_device_name,
            allocator=report.trace.allocator,
            peak=report.main_device.peak_bytes,
            tf_peak=own,
            budget=report.device_budget,
            layers=sorted(layers - {None})[:6],
            ok=report.main_device_name == "GPU:0"
            and report.trace.allocator == "GPU_0_bfc"
            and abs(report.main_device.peak_bytes - own) <= 0.02 * own
            and {"conv_a", "conv_b"} <= layers
            and report.device_budget is not None
            and report.device_budget[0] == "GPU:0",
        )
    elif name == "xla":
        noted = {}
        for jit in (True, "auto"):  # "auto" is Keras 3's default: XLA whenever a GPU is present
            report = _fit(tfmem_magic, keras, 64, jit=jit, label=f"jit_compile={jit}")
            xla = [n for n in report.notes if "XLA" in n]
            noted[str(jit)] = bool(xla)
            out.setdefault("note", xla[:1])
            out[f"layers_{jit}"] = [g.layer for g in report.trace.by_layer][:6]
        out.update(
            main=report.main_device_name, noted=noted, ok=report.main_device_name == "GPU:0" and all(noted.values())
        )
    elif name == "oom":
        profiler = tfmem_magic.profile(label="oom")
        try:
            with profiler:
                big = tf.random.normal((1 << 18, 1 << 18))  # 256 GiB: more than any single GPU (an H200 has 141 GB)
                float(tf.reduce_sum(big))
        except tf.errors.ResourceExhaustedError:
            pass  # raised through the report, as in a notebook cell
        report = profiler.report
        alive = float(tf.reduce_sum(tf.ones((256, 256)))) == 65536.0
        request = report.error.request if report.error else None
        out.update(
            status=report.status,
            request=request,
            alive=alive,
            ok=alive and report.status == "oom" and request is not None and request["device"] == "GPU:0",
        )
    elif name == "whatif":
        base = _fit(tfmem_magic, keras, 32, label="b32")
        rows, ok = [], True
        for batch in (64, 128, 256):
            predicted = tfmem_magic.predict(base, batch_size=batch).peak_bytes
            measured = _fit(tfmem_magic, keras, batch, label=f"b{batch}").tf_peak_bytes
            error = predicted / measured - 1
            rows.append(
                {
                    "batch": batch,
                    "predicted_mib": round(predicted / MiB, 1),
                    "measured_mib": round(measured / MiB, 1),
                    "error": round(error, 3),
                }
            )
            ok = ok and abs(error) <= 0.3
        out.update(rows=rows, ok=ok)
    elif name == "mixed":
        plain = _fit(tfmem_magic, keras, 128, label="float32")
        keras.mixed_precision.set_global_policy("mixed_float16")
        half = _fit(tfmem_magic, keras, 128, label="mixed_float16")
        what_if = tfmem_magic.predict(half, batch_size=256).peak_bytes
        out.update(
            float32=plain.tf_peak_bytes,
            mixed=half.tf_peak_bytes,
            optimizer=half.model.optimizer,
            what_if_256=what_if,
            ok=half.tf_peak_bytes < plain.tf_peak_bytes and half.model.optimizer == "Adam",
        )
    elif name == "fixes":
        from tfmem_magic.advise import fixes

        report = _fit(tfmem_magic, keras, 64)
        context = fixes.FixContext(model_name="model")
        checks = {}
        for fix_id, probe in (
            ("memory-growth", "tf.config.experimental.get_memory_growth(gpus[0])"),
            ("gpu-memory-limit", "len(tf.config.get_logical_device_configuration(gpus[0])) == 1"),
        ):
            code = fixes.WRITERS[fix_id](report, context).code
            run = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    code + "\ngpus = tf.config.list_physical_devices('GPU')\ntf.ones(1)\nprint(" + probe + ")",
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            checks[fix_id] = run.stdout.strip().splitlines()[-1:] == ["True"]
        out.update(checks=checks, ok=all(checks.values()))
    elif name == "calibrate":
        base = _fit(tfmem_magic, keras, 32, label="b32")
        try:
            answer = tfmem_magic.predict(base, batch_size=128, calibrate=True)
            measured = _fit(tfmem_magic, keras, 128, label="b128").tf_peak_bytes
            curve = base.whatif_basis.replay
            # the step replay on a GPU (its probes trace the GPU's allocator, with memory growth): whether its
            # self-check passed there, and why not
            out.update(
                basis=answer.basis,
                predicted=answer.peak_bytes,
                measured=measured,
                replay={"passed": curve.passed, "why_not": curve.why_not[:300], "cross": curve.cross_error}
                if curve is not None
                else None,
                ok=answer.basis in ("replay", "measured") and abs(answer.peak_bytes / measured - 1) <= 0.3,
            )
        except Exception as exc:  # noqa: BLE001 - the check reports it: a crash of the probes must not take this process down
            out.update(error=f"{type(exc).__name__}: {exc}"[:300], ok=False)
    elif name == "trace":
        import glob
        import tempfile

        x, y = _data()
        model = _model(keras)
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)  # built and traced before the recording
        logdir = tempfile.mkdtemp(prefix="tfmem-gpu-trace-")
        tf.profiler.experimental.start(logdir)
        model.fit(x[:128], y[:128], batch_size=32, epochs=1, verbose=0)
        tf.profiler.experimental.stop()
        path = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))[0]
        report = tfmem_magic.analyze_xplane(path, batch_size=32)
        basis = report.whatif_basis
        curve = basis.replay if basis is not None else None
        rows, ok = [], curve is not None
        for batch in (64, 128):
            predicted = tfmem_magic.predict(report, batch_size=batch).peak_bytes if curve is not None else None
            measured = _fit(tfmem_magic, keras, batch, label=f"b{batch}").tf_peak_bytes
            error = None if predicted is None else round(predicted / measured - 1, 3)
            rows.append(
                {
                    "batch": batch,
                    "predicted_mib": None if predicted is None else round(predicted / MiB, 1),
                    "measured_mib": round(measured / MiB, 1),
                    "error": error,
                }
            )
            ok = ok and error is not None and abs(error) <= 0.3
        why = [n for n in report.notes if n.startswith("No what-if")]
        out.update(
            main=report.main_device_name,
            allocator=report.trace.allocator,
            events=report.trace.events,
            replay={"passed": curve.passed, "own_error": curve.own_error, "scaled": curve.scaled}
            if curve is not None
            else {"passed": False, "why_not": why[:1]},
            rows=rows,
            ok=ok,
        )
    elif name in CHECKS:
        out.update(CHECKS[name](tfmem_magic, keras, tf))
    return out


def _workspace(tfmem_magic, keras, tf) -> dict:
    """cuDNN's workspaces at the peak, the finding, and the cap's saving and cost (see the module's docstring)."""
    # the fresh processes first: this one reserves the GPU at its first op (no memory growth), and cuDNN sizes its
    # workspaces to the memory left free. The cap is half the largest workspace at a default process's peak
    default = _fit_in_a_fresh_process({}, trace=True)
    cap_mb = max(1, int(default.get("largest_workspace") or 0) // 2 // MiB)
    capped = _fit_in_a_fresh_process({"TF_CUDNN_WORKSPACE_LIMIT_IN_MB": str(cap_mb)})
    report = _fit(tfmem_magic, keras, 128, label="b128")
    peak = max(1, report.main_device.peak_bytes)
    spaces = [g for g in report.trace.at_peak if g.phase == "workspace"]
    largest = max((g.bytes for g in spaces), default=0)
    finding = next((f for f in report.findings if f.id == "cudnn-workspace"), None)
    wanted = largest >= 0.1 * peak or largest >= 256 * MiB
    return {
        "workspaces": [{"op": g.op, "layer": g.layer, "mib": round(g.bytes / MiB, 1)} for g in spaces[:4]],
        "largest_share": round(largest / peak, 3),
        "finding": finding.title if finding else None,
        "cap_mb": cap_mb,
        "runs": {"default": default, "capped": capped},
        "ok": bool(spaces)
        and (finding is not None) == wanted
        and "peak" in default
        and "peak" in capped
        and capped["peak"] <= default["peak"],
    }


def _fit_in_a_fresh_process(extra: dict, trace: bool = False) -> dict:
    """FIT_IN_A_FRESH_PROCESS's answer at batch 128 (its peak and step time; with `trace`, the largest workspace at
    its profiled fit's peak), or {"error": ...}."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FIT_IN_A_FRESH_PROCESS.format(folder=os.path.dirname(os.path.abspath(__file__))),
            "128",
            "trace" if trace else "plain",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **extra},
    )
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-300:]}


def _firststep(tfmem_magic, keras, tf) -> dict:
    """A first step's peak against a steady one's, at two batches, and the what-if from the steady one."""
    out: dict = {}
    x, y = _data()
    model = _model(keras)
    rows = {}
    for batch in (128, 256):
        with tfmem_magic.profile(label=f"first b{batch}") as first:  # its first step: autotuning, if any, inside
            model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
        with tfmem_magic.profile(label=f"steady b{batch}") as steady:  # the same one step, tuned already
            model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
        rows[batch] = {"first": first.report.tf_peak_bytes or 0, "steady": steady.report.tf_peak_bytes or 0}
        if batch == 128:
            rows[128]["what_if_256"] = tfmem_magic.predict(steady.report, batch_size=256).peak_bytes
    out.update(
        main=first.report.main_device_name,
        rows={b: {k: round(v / MiB, 1) if v else v for k, v in r.items()} for b, r in rows.items()},
        first_over_steady=[round(r["first"] / max(1, r["steady"]), 2) for r in rows.values()],
        what_if_256_over_first=round(rows[128]["what_if_256"] / max(1, rows[256]["first"]), 2),
        ok=first.report.main_device_name == "GPU:0" and all(r["first"] >= r["steady"] for r in rows.values()),
    )
    return out


def _preflight(tfmem_magic, keras, tf) -> dict:
    """The pre-flight while the kernel holds the GPU (no memory growth) and the batch cannot fit it."""
    out: dict = {}
    import psutil

    on_gpu = bool(tf.config.list_logical_devices("GPU"))  # the kernel reserves the GPU: no memory growth
    x, y = _data(256)
    model = _model(keras)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    # a batch whose activations (batch x 62 x 62 x 64 floats: 32 GB each, four of them) fit no GPU's memory; its
    # spec states the batch (drop_remainder), so the pre-flight reads it before anything is made
    batch = 1 << 15
    big = tf.data.Dataset.from_tensors((x[:1], y[:1])).repeat().unbatch().batch(batch, drop_remainder=True).take(1)
    limit = psutil.Process().memory_info().rss + (8 << 30)
    profiler = tfmem_magic.profile(label="preflight", limit_bytes=limit, preflight=True)
    started = time.perf_counter()
    try:
        with profiler:
            model.fit(big, epochs=1, verbose=0)
    except Exception as exc:  # noqa: BLE001 - a refusal or an OOM is raised through the report, as in a cell
        out["raised"] = type(exc).__name__
    report = profiler.report
    info = report.preflight
    alive = float(tf.reduce_sum(tf.ones((256, 256)))) == 65536.0
    out.update(
        on_gpu=on_gpu,
        status=report.status,
        verdict=info.verdict if info else None,
        basis=info.basis if info else None,
        gpu=info.gpu and {"verdict": info.gpu.verdict, "limit": info.gpu.limit_bytes, "step": info.gpu.step_bytes},
        notes=[n for n in report.notes if "re-flight" in n][:2],
        seconds=round(time.perf_counter() - started, 1),
        alive=alive,
        # the GPU judged (its limit read in the kernel), by probes on the CPU: refused before anything ran
        ok=alive and on_gpu and info is not None and info.gpu is not None and report.status == "refused",
    )
    return out


def _peaks(tfmem_magic, keras, tf) -> dict:
    """What a worker that serves its peaks answers while a fit runs on the GPU."""
    out: dict = {}
    import threading

    from tfmem_magic.measure import remote

    x, y = _data()
    model = _model(keras)
    model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
    done = threading.Event()

    def train() -> None:  # until the window has closed, whatever the device's speed
        while not done.is_set():
            model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0)

    training = threading.Thread(target=train)
    training.start()
    answer = remote.window_peaks(1.0)
    done.set()
    training.join()
    out.update(
        {k: answer[k] for k in ("device", "tf_start_bytes", "tf_peak_bytes", "rss_peak_bytes")},
        ok=answer["device"] == "GPU:0" and (answer["tf_peak_bytes"] or 0) > (answer["tf_start_bytes"] or 0),
    )
    return out


def _fromcpu(tfmem_magic, keras, tf) -> dict:
    """A CPU run's report modelled for this GPU, against the GPU's own first and steady step at batch 256."""
    out: dict = {}
    done = subprocess.run(
        [sys.executable, "-c", PROFILE_ON_THE_CPU.format(folder=os.path.dirname(os.path.abspath(__file__)))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"},
    )
    if done.returncode != 0:
        return {"error": done.stderr[-300:], "ok": False}
    cpu = tfmem_magic.Report.from_json(done.stdout.strip().splitlines()[-1])
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
    capability = details.get("compute_capability")
    try:  # the card's memory as nvidia-smi gives it (MiB)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        memory = int(smi.stdout.split()[0]) * MiB
    except (OSError, ValueError, IndexError):
        memory = 16 * 2**30  # no GPU here: the scenario's code runs, its check fails
    target = tfmem_magic.GpuTarget(memory, float(".".join(map(str, capability))) if capability else None)
    modelled = tfmem_magic.predict(cpu, batch_size=256, gpu=target)
    x, y = _data()
    model = _model(keras, name="gpu_cnn_256")
    device = "GPU:0" if gpus else "CPU:0"
    tf.config.experimental.reset_memory_stats(device)
    model.fit(x[:256], y[:256], batch_size=256, epochs=1, verbose=0)  # its first step: autotuning inside
    first = tf.config.experimental.get_memory_info(device)["peak"]
    with tfmem_magic.profile(label="steady 256") as steady:
        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
    limit = None
    if gpus:
        from tensorflow.python.client import device_lib

        limit = next((int(d.memory_limit) for d in device_lib.list_local_devices() if d.device_type == "GPU"), None)
    step = (steady.report.tf_peak_bytes or 0) - (
        steady.report.main_device.baseline_bytes if steady.report.main_device else 0
    )
    out.update(
        memory=memory,
        capability=capability,
        limit=limit,
        limit_reckoned=target.limit_bytes,
        modelled=modelled.peak_bytes,
        workspace=modelled.split["workspace"],
        band=[modelled.below, modelled.error_band],
        fits=modelled.fits,
        largest_batch=modelled.largest_batch,
        steady=step,
        first=first,
        steady_over_modelled=round(step / max(1, modelled.peak_bytes), 2),
        ok=bool(gpus)
        and limit is not None
        and target.limit_bytes <= limit
        and (modelled.fits is not True or first <= (limit or 0)),
    )
    return out


CHECKS = {
    "workspace": _workspace,
    "firststep": _firststep,
    "preflight": _preflight,
    "peaks": _peaks,
    "fromcpu": _fromcpu,
}


def _budget(args: list[str]) -> float:
    """Seconds the whole check may take (--budget S), so that it fits a lent GPU machine's time."""
    if "--budget" not in args:
        return 480.0
    try:
        return float(args[args.index("--budget") + 1])
    except (IndexError, ValueError):
        raise SystemExit("gpu_check: --budget takes a number of seconds, e.g. --budget 420") from None


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--scenario":
        print(json.dumps(scenario(sys.argv[2]), default=str))
        return 0
    probe = subprocess.run(
        [sys.executable, "-c", "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    gpus = int((probe.stdout.strip().splitlines() or ["0"])[-1]) if probe.returncode == 0 else 0
    if not gpus:
        print("gpu_check: TensorFlow sees no GPU on this machine; nothing to check (exit 0).")
        return 0
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    failed = 0
    deadline = time.monotonic() + _budget(sys.argv[1:])
    print(f"gpu_check: {gpus} GPU(s)\n{'scenario':<10} {'ok':<5} {'s':>5}  details")
    for name in SCENARIOS:
        start = time.monotonic()
        left = deadline - start
        try:
            if left < 20:
                raise subprocess.TimeoutExpired(name, 0)
            run = subprocess.run(
                [sys.executable, __file__, "--scenario", name], capture_output=True, text=True, timeout=left, env=env
            )
            result = json.loads(run.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            result = {"ok": False, "error": f"timed out: the run's budget had {max(0, left):.0f} s left"}
        except (IndexError, ValueError):
            result = {"ok": False, "error": (run.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        took = time.monotonic() - start
        ok = bool(result.pop("ok", False))
        failed += not ok
        result.pop("scenario", None)
        print(f"{name:<10} {'yes' if ok else 'NO':<5} {took:5.0f}  {json.dumps(result, default=str)[:400]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
