"""What `tfmem_magic.serve()` costs a training worker: step time without the profiler server, with it idle, and
while `tfmem capture` traces the worker. One run, side by side, in fresh processes (one worker at a time).

    python benchmarks/serve_overhead.py [--seconds 20]

Prints the median step time of each phase and its ratio to the worker without the server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from _fresh import fresh_env

WORKER = textwrap.dedent("""
    import json, sys, time
    import tfmem_magic
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    if port:
        tfmem_magic.serve(port)
    else:
        tfmem_magic.prepare()                     # the same allocator (BFC), no server
    import numpy as np, keras
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("adam", "sparse_categorical_crossentropy")
    x, y = np.random.rand(4096, 256).astype("float32"), np.random.randint(0, 10, 4096)
    times = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.time())

    model.fit(x[:256], y[:256], batch_size=64, verbose=0)
    print("READY", flush=True)
    end = time.time() + seconds
    while time.time() < end:
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[Steps()])
    print(json.dumps(times), flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(serve: bool, seconds: float, capture_at: float | None) -> tuple[list[float], tuple[float, float]]:
    """Step end times of one worker; with `capture_at`, a capture of 2 s starts that many seconds after READY."""
    script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    script.write(WORKER)
    script.close()
    port = free_port() if serve else 0
    env = fresh_env()
    proc = subprocess.Popen(
        [sys.executable, script.name, str(port), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    window = (0.0, 0.0)
    try:
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != "READY":
            if proc.poll() is not None:
                raise SystemExit("the worker died before it was ready")
        if capture_at is not None:
            time.sleep(capture_at)
            start = time.time()
            subprocess.run(
                [sys.executable, "-m", "tfmem_magic", "capture", f"127.0.0.1:{port}", "--seconds", "2"],
                capture_output=True,
                timeout=300,
                env=env,
            )
            window = (start, time.time())
        out = proc.stdout.read()
    finally:
        proc.wait(timeout=seconds + 120)
        os.unlink(script.name)
    return json.loads(out.strip().splitlines()[-1]), window


def median_step(times: list[float], keep=lambda t: True) -> float:
    steps = [b - a for a, b in zip(times, times[1:], strict=False) if keep(b) and b - a < 1.0]
    return statistics.median(steps) if steps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    plain, _ = run_worker(False, args.seconds, None)
    served, window = run_worker(True, args.seconds, args.seconds / 3)
    base = median_step(plain)
    idle = median_step(served, lambda t: not window[0] - 1 <= t <= window[1] + 1)
    during = median_step(served, lambda t: window[0] <= t <= window[1])
    print(
        f"median step: no server {base * 1000:.2f} ms · server idle {idle * 1000:.2f} ms ({idle / base:.2f}x) · "
        f"during a capture {during * 1000:.2f} ms ({during / base:.2f}x; the capture and its export took "
        f"{window[1] - window[0]:.1f} s)"
    )


if __name__ == "__main__":
    main()
