"""The what-if's `replicas` knob against real data-parallel workers: a cell trains a model with `fit` at a global
batch in one process (what a user profiles in the notebook before distributing), and `predict(report,
replicas=N)` says what one replica will hold; then N MultiWorkerMirroredStrategy workers on loopback run the same
`fit` at the same global batch (each its share), and each measures its own TensorFlow peak with tfmem's quick mode.

    python benchmarks/replicas_check.py [--batch 256] [--replicas 2 3] [--model mlp|cnn|both] [--no-calibrate]

Prints, per model and N: the prediction (analytic, and calibrated), each worker's measured peak over its baseline,
and the error. Both sides use tf_keras (see RUNNER). Every number comes from fresh processes, one configuration
at a time (the workers of one configuration together).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _fresh import fresh_env

MiB = 2**20

MODELS = {
    "mlp": (
        'keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"), '
        'keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)], name="mlp")',
        (256,),
    ),
    "cnn": (
        'keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"), '
        'keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(), '
        'keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)], '
        'name="cnn")',
        (32, 32, 3),
    ),
}

# One process: the user's `fit` cell without a strategy (mode "fit": the report and the predictions), or one
# MultiWorkerMirroredStrategy worker running the same `fit` ("mwms", TF_CONFIG from the arguments). Both use
# tf_keras (Keras 2): Keras 3's fit fails under MultiWorkerMirroredStrategy on TensorFlow 2.21 ("Attempt to
# convert a value (PerReplica...)"), and the comparison must be the same training code on both sides.
RUNNER = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    spec = json.loads(sys.argv[1])
    if spec["mode"] == "mwms":
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in spec["ports"]]},
                                              "task": {"type": "worker", "index": spec["index"]}})
    import tfmem_magic
    tfmem_magic.prepare()                         # BFC before the first op, as serve() does
    import numpy as np, tensorflow as tf
    keras = tf.keras
    tf.random.set_seed(0); np.random.seed(0)
    B, shape = spec["batch"], tuple(spec["shape"])
    x = np.random.rand(B * 4, *shape).astype("float32"); y = np.random.randint(0, 10, B * 4)
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if spec["mode"] == "mwms" else tf.distribute.get_strategy()
    with strategy.scope():
        model = MODEL
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)   # the global batch: each worker gets its share
    with tfmem_magic.profile(mode="quick" if spec["mode"] == "mwms" else "trace") as p:
        model.fit(data, epochs=1, verbose=0)
    out = {"peak": p.report.tf_peak_bytes, "devices": list(p.report.tf)}
    if spec["mode"] == "mwms":  # the worker's own report: its replicas, and what it predicts for one process
        m = p.report.model
        from tfmem_magic.advise import prediction
        basis = prediction.analytic_basis(p.report)  # printed with the result: why `own` differs when it does
        out.update(status=p.report.status, anchored=basis.measured_peak is not None, other=basis.other,
                   slope_source=basis.slope_source)
        out.update(replicas=m.replicas if m else None, model_batch=m.batch_size if m else None,
                   own=tfmem_magic.predict(p.report).peak_bytes,
                   as_one=tfmem_magic.predict(p.report, replicas=1).peak_bytes)
    if spec["mode"] == "fit":
        out["predicted"] = {n: tfmem_magic.predict(p.report, batch_size=B, replicas=n).peak_bytes
                            for n in spec["replicas"]}
        if spec["calibrate"]:  # after the analytic ones: the calibrated basis is kept on the report
            out["calibrated"] = {n: tfmem_magic.predict(p.report, batch_size=B, replicas=n, calibrate=True).peak_bytes
                                 for n in spec["replicas"]}
    print("RESULT " + json.dumps(out), flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: Path, specs: list[dict], timeout: float = 240) -> list[dict]:
    """Start one process per spec (together: MWMS workers wait for each other) and collect their RESULT lines."""
    env = fresh_env()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), json.dumps(s)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in specs
    ]
    results = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            errs = [p.communicate()[1][-1500:] for p in procs]
            raise SystemExit(
                f"a process did not finish in time ({specs[procs.index(proc)]['mode']}):\n" + "\n---\n".join(errs)
            ) from None
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"a process failed (exit {proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def check(model: str, batch: int, replicas: list[int], calibrate: bool = True, say=print) -> list[dict]:
    """For each N in `replicas`: the fit cell's predictions for one of N replicas, and N MWMS workers' measured
    peaks. Returns one row per N and basis."""
    code, shape = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="tfmem-replicas-") as folder:
        script = Path(folder) / "runner.py"
        script.write_text(RUNNER.replace("MODEL", code))
        base = {"batch": batch, "shape": list(shape), "replicas": replicas, "calibrate": calibrate}
        fit = run(script, [dict(base, mode="fit")])[0]
        say(f"\n{model}, global batch {batch}: the fit cell's peak {fit['peak'] / MiB:.1f} MiB")
        rows = []
        for n in replicas:
            ports = [free_port() for _ in range(n)]  # one cluster: every worker gets the same list
            workers = run(script, [dict(base, mode="mwms", ports=ports, index=i) for i in range(n)])
            peaks = [w["peak"] for w in workers]
            if None in peaks:
                raise SystemExit(f"a worker measured no TensorFlow peak: {workers}")
            say(
                f"  {n} workers: measured " + ", ".join(f"{p / MiB:.1f}" for p in peaks) + " MiB each; each "
                "worker's own report, asked for one process at the global batch: "
                + ", ".join(f"{w['as_one'] / MiB:.1f} ({w['as_one'] / fit['peak'] - 1:+.0%})" for w in workers)
                + f" MiB against the cell's {fit['peak'] / MiB:.1f}"
            )
            for basis in ("predicted", "calibrated") if calibrate else ("predicted",):
                predicted = fit[basis][str(n)]
                errors = [predicted / p - 1 for p in peaks]
                rows.append(
                    {
                        "model": model,
                        "replicas": n,
                        "basis": basis,
                        "predicted": predicted,
                        "measured": peaks,
                        "errors": errors,
                        "cell": fit["peak"],
                        "workers": workers,
                    }
                )
                say(
                    f"    {'analytic' if basis == 'predicted' else 'calibrated':>10}: predicted "
                    f"{predicted / MiB:6.1f} MiB per replica; error " + ", ".join(f"{e:+.0%}" for e in errors)
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--no-calibrate", action="store_true", help="the analytic prediction only (faster)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    for model in MODELS if args.model == "both" else [args.model]:
        rows += check(model, args.batch, args.replicas, calibrate=not args.no_calibrate)
    worst = max(abs(e) for r in rows for e in r["errors"])
    print(f"\nlargest error over {len(rows)} predictions: {worst:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
