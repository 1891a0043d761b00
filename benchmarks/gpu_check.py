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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SCENARIOS = ("device", "xla", "oom", "whatif", "mixed", "fixes", "calibrate", "trace")
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
    return out


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
