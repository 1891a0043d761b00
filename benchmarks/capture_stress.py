"""Capture a training job again and again, and count the workers the captures killed (docs/capture-safety.md).

    python benchmarks/capture_stress.py [--strategy mwms|plain|ps] [--captures 20] [--seconds 3] [--budget 900]
        [--host 2] [--python 1] [--device 1] [--default-options] [--analyze] [--gdb] [--hold-mib 256]

A job on loopback (two `MultiWorkerMirroredStrategy` workers by default; or two plain workers training alone; or
a parameter server, two workers and a coordinator) trains a Keras model in a custom `strategy.run` loop, every
server started with `tfmem_magic.serve(PORT)`; worker 1 also holds an extra `--hold-mib` tensor. This process
then captures the job `--captures` times in a row (`tfmem_magic.measure.remote.trace_workers`, the engine of
`%tfmem capture`; `--analyze` runs the full `tfmem_magic.capture`, reports included), each `--seconds` long. When
a worker dies, its exit code and the tail of its log (faulthandler's Python stacks, or gdb's native stacks with
`--gdb`) are kept, the job is killed and a fresh one started, and the captures go on.

By default the capture asks for what `tfmem_magic.capture` asks for. `--host/--python/--device` send explicit
`tf.profiler.experimental.ProfilerOptions` instead (the bisect of docs/capture-safety.md); `--default-options`
sends none (TensorFlow's client defaults). A non-chief MWMS worker's `serve()` refuses by default
(docs/capture-safety.md): its captures then report it unreachable and nothing can crash it; `--allow-crash-risk`
serves every worker, as the bisect did.

Stops by itself: after `--captures`, or when `--budget` seconds are spent; every process it started is killed.
Prints one line per capture and a summary (captures, crashed workers with exit codes, time); `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _fresh import fresh_env

# one replica's training step, in both jobs' scripts (a custom loop: Keras 3's fit fails under MWMS on TF 2.21)
REPLICA_STEP = """def replica(b):
    with tf.GradientTape() as tape:
        loss = loss_fn(b[1], model(b[0], training=True)) / 128
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss"""

WORKER = textwrap.dedent("""
    import faulthandler, json, os, sys, time
    faulthandler.enable(all_threads=True)
    spec = json.loads(sys.argv[1])
    if spec["strategy"] == "mwms":
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in spec["ports"]]},
                                              "task": {"type": "worker", "index": spec["index"]}})
    import tfmem_magic
    tfmem_magic.serve(spec["profiler"])
    import numpy as np, tensorflow as tf, keras
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if spec["strategy"] == "mwms"
                else tf.distribute.get_strategy())
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu", name="wide"),
                                  keras.layers.Dense(1024, activation="relu", name="wide2"),
                                  keras.layers.Dense(10, name="head")])
        optimizer = keras.optimizers.Adam()
    held = tf.ones((spec["hold_mib"] * 256, 1024)) if spec["hold_mib"] else None   # this worker's extra memory
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    x, y = np.random.rand(2048, 256).astype("float32"), np.random.randint(0, 10, 2048)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(128).repeat()
    batches = iter(strategy.experimental_distribute_dataset(data) if spec["strategy"] == "mwms" else data)

    REPLICA_STEP

    @tf.function
    def step(batch):
        return strategy.run(replica, args=(batch,))

    step(next(batches))
    print("READY", flush=True)
    end = time.time() + spec["train_seconds"]
    while time.time() < end:
        step(next(batches))
    print("DONE", flush=True)
""").replace("REPLICA_STEP", REPLICA_STEP)

PS_JOB = textwrap.dedent("""
    import faulthandler, json, sys, time
    faulthandler.enable(all_threads=True)
    spec = json.loads(sys.argv[1])
    role, index, cluster = spec["role"], spec["index"], spec["cluster"]
    import tfmem_magic
    if spec["profiler"]:
        tfmem_magic.serve(spec["profiler"])
    import tensorflow as tf
    cluster_spec = tf.train.ClusterSpec(cluster)
    if role in ("ps", "worker"):
        server = tf.distribute.Server(cluster_spec, job_name=role, task_index=index, protocol="grpc", start=True)
        held = tf.ones((spec["hold_mib"] * 256, 1024)) if spec["hold_mib"] else None
        print("READY", flush=True)
        server.join()
    import numpy as np, keras
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc"))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu", name="wide"),
                                  keras.layers.Dense(10, name="head")])
        optimizer = keras.optimizers.Adam()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def dataset_fn():
        x, y = np.random.rand(2048, 256).astype("float32"), np.random.randint(0, 10, 2048)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(128).repeat()

    batches = iter(coordinator.create_per_worker_dataset(dataset_fn))

    REPLICA_STEP

    @tf.function
    def step(iterator):
        return strategy.run(replica, args=(next(iterator),))

    for _ in range(5):
        coordinator.schedule(step, args=(batches,))
    coordinator.join()
    print("READY", flush=True)
    end = time.time() + spec["train_seconds"]
    while time.time() < end:
        for _ in range(10):
            coordinator.schedule(step, args=(batches,))
        coordinator.join()
    print("DONE", flush=True)
""").replace("REPLICA_STEP", REPLICA_STEP)

GDB = [
    "gdb",
    "-q",
    "-batch",
    "-ex",
    "set pagination off",
    "-ex",
    "set print thread-events off",
    "-ex",
    "set print inferior-events off",
    "-ex",
    "handle SIGPIPE nostop noprint pass",
    "-ex",
    "handle SIGUSR1 nostop noprint pass",
    "-ex",
    "handle SIGUSR2 nostop noprint pass",
    "-ex",
    "run",
    "-ex",
    "info signal",
    "-ex",
    "thread apply all bt 40",
    "-ex",
    "kill",
    "--args",
]


ALLOW_CRASH_RISK = False  # --allow-crash-risk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc's malloc made strict: no per-thread cache (tcache), and every freed block overwritten with 0xA5. A write
# through a pointer into freed memory then fails at once instead of now and then (see docs/capture-safety.md).
SENSITIZE = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "MALLOC_PERTURB_": "165"}


def worker_env(sensitize: bool = False) -> dict[str, str]:
    env = fresh_env()
    if ALLOW_CRASH_RISK:  # every worker serves, the non-chief MWMS ones too (serve()'s opt-in)
        env["TFMEM_ALLOW_MWMS_CAPTURE"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    if sensitize:
        env.update(SENSITIZE)
    return env


class Job:
    """One training job on loopback: its processes (each in its own process group), their profiler addresses."""

    def __init__(
        self,
        folder: Path,
        strategy: str,
        hold_mib: int,
        train_seconds: float,
        gdb: bool,
        sensitize: bool = False,
        hold_on: int = 1,
    ):
        self.folder, self.procs, self.names, self.logs, self.addresses = folder, [], [], [], []
        folder.mkdir(parents=True, exist_ok=True)
        env = worker_env(sensitize)
        if strategy == "ps":
            script = folder / "ps_job.py"
            script.write_text(PS_JOB)
            cluster = {"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
            specs = [
                ("ps0", dict(role="ps", index=0)),
                ("worker0", dict(role="worker", index=0)),
                ("worker1", dict(role="worker", index=1)),
                ("coordinator", dict(role="coordinator", index=0)),
            ]
            for name, spec in specs:
                port = 0 if name == "coordinator" else free_port()
                spec.update(
                    cluster=cluster,
                    profiler=port,
                    train_seconds=train_seconds,
                    hold_mib=hold_mib if name == f"worker{hold_on}" else 0,
                )
                self._start(name, script, spec, env, gdb and name != "coordinator")
                if port:
                    self.addresses.append(f"127.0.0.1:{port}")
        else:
            script = folder / "worker.py"
            script.write_text(WORKER)
            ports = [free_port(), free_port()]
            for index in range(2):
                profiler = free_port()
                self._start(
                    f"worker{index}",
                    script,
                    dict(
                        strategy=strategy,
                        ports=ports,
                        index=index,
                        profiler=profiler,
                        train_seconds=train_seconds,
                        hold_mib=hold_mib if index == hold_on else 0,
                    ),
                    env,
                    gdb,
                )
                self.addresses.append(f"127.0.0.1:{profiler}")

    def _start(self, name, script, spec, env, gdb):
        log = self.folder / f"{name}.log"
        command = [sys.executable, str(script), json.dumps(spec)]
        # under gdb, everything (gdb's own output too) goes to the log: a pipe nobody reads would fill and stop gdb
        out = log.open("w")
        self.procs.append(
            subprocess.Popen(
                (GDB if gdb else []) + command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        )
        self.names.append(name)
        self.logs.append(log)

    def wait_ready(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        for proc, log in zip(self.procs, self.logs, strict=True):
            while time.monotonic() < deadline and proc.poll() is None:
                if "READY\n" in log.read_text(errors="replace"):
                    break
                time.sleep(0.5)
        return all(self.alive())

    def wait_gdb(self, seconds: float) -> None:
        """Under gdb, a caught crash is followed by every thread's backtrace: give gdb time to write it."""
        deadline = time.monotonic() + seconds
        for i, proc in enumerate(self.procs):
            while self._gdb_caught(i) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)

    def alive(self) -> list[bool]:
        return [p.poll() is None and not self._gdb_caught(i) for i, p in enumerate(self.procs)]

    def _gdb_caught(self, i: int) -> bool:  # under gdb the program's crash does not end gdb at once
        try:
            text = self.logs[i].read_text(errors="replace")
        except OSError:
            return False
        return "received signal SIG" in text

    def deaths(self) -> list[tuple[str, object, str]]:
        out = []
        for name, proc, log in zip(self.names, self.procs, self.logs, strict=True):
            code = proc.poll()
            text = log.read_text(errors="replace") if log.exists() else ""
            if "received signal SIG" in text:  # gdb: the signal it stopped on
                sig = text.split("received signal ", 1)[1].split(",", 1)[0]
                code = f"{sig} (under gdb)"
            if code is not None and code != 0:
                out.append((name, code, text))
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own group: gdb and the worker under it
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def options_patch(args):
    """What the capture sends: tfmem's own (None: unchanged), TensorFlow's client defaults, or explicit levels."""
    import tensorflow as tf

    if args.default_options or args.host is not None or args.python is not None or args.device is not None:
        levels = None
        if not args.default_options:
            levels = tf.profiler.experimental.ProfilerOptions(
                host_tracer_level=2 if args.host is None else args.host,
                python_tracer_level=0 if args.python is None else args.python,
                device_tracer_level=1 if args.device is None else args.device,
            )
        real = tf.profiler.experimental.client.trace

        def trace(service, logdir, duration_ms, worker_list="", num_tracing_attempts=3, options=None):
            return real(service, logdir, duration_ms, worker_list, num_tracing_attempts, options=levels)

        tf.profiler.experimental.client.trace = trace
        return "default (none sent)" if levels is None else dict(levels._asdict())
    return "tfmem's (remote.trace_workers unchanged)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["mwms", "plain", "ps"], default="mwms")
    parser.add_argument("--captures", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=3.0, help="each capture's length")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between captures")
    parser.add_argument("--budget", type=float, default=900, help="stop after this many seconds in all")
    parser.add_argument("--hold-mib", type=int, default=256, help="the extra tensor one worker holds")
    parser.add_argument("--hold-on", type=int, default=1, help="which worker holds it (0 is MWMS's chief)")
    parser.add_argument(
        "--sensitize",
        action="store_true",
        help="strict malloc in the servers (no tcache, freed memory overwritten): a use-after-free "
        "crashes at once, so a few captures tell a configuration apart",
    )
    parser.add_argument("--host", type=int), parser.add_argument("--python", type=int)
    parser.add_argument("--device", type=int)
    parser.add_argument("--default-options", action="store_true", help="send no options (TF's client defaults)")
    parser.add_argument("--analyze", action="store_true", help="tfmem_magic.capture: the reports too")
    parser.add_argument("--gdb", action="store_true", help="run the servers under gdb (native stacks on a crash)")
    parser.add_argument("--keep", help="keep the logs of crashed jobs in this folder")
    parser.add_argument(
        "--per-job",
        type=int,
        default=0,
        help="start a fresh job after this many captures (0: keep a job until it crashes)",
    )
    parser.add_argument("--only", type=int, help="capture only this server (its index among the job's servers)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument(
        "--allow-crash-risk",
        action="store_true",
        help="serve the non-chief MWMS workers too (what tfmem did before it refused them by default)",
    )
    args = parser.parse_args()
    global ALLOW_CRASH_RISK
    ALLOW_CRASH_RISK = args.allow_crash_risk

    start = time.monotonic()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfmem_magic
    from tfmem_magic.measure import remote

    sent = options_patch(args)
    print(
        f"{args.strategy}: {args.captures} captures of {args.seconds} s, options {sent}, budget {args.budget} s",
        flush=True,
    )
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tfmem-stress-"))
    root.mkdir(parents=True, exist_ok=True)
    done, crashes, jobs, rows, failed = 0, [], 0, [], []
    job, on_job = None, 0
    try:
        while done < args.captures and time.monotonic() - start < args.budget:
            if job is None:
                left = args.budget - (time.monotonic() - start)
                job = Job(
                    root / f"job{jobs}",
                    args.strategy,
                    args.hold_mib,
                    train_seconds=left + 60,
                    gdb=args.gdb,
                    sensitize=args.sensitize,
                    hold_on=args.hold_on,
                )
                jobs += 1
                if not job.wait_ready(min(240, max(30, left))):
                    crashes.append(
                        {
                            "capture": None,
                            "job": jobs - 1,
                            "deaths": [(n, str(c)) for n, c, _ in job.deaths()],
                            "when": "start",
                        }
                    )
                    print(f"job {jobs - 1} died before it was ready: {[(n, c) for n, c, _ in job.deaths()]}")
                    for name, _, text in job.deaths():
                        print(f"--- {name}\n{text[-4000:]}")
                    job.kill()
                    job = None
                    continue
                time.sleep(1.0)
                on_job = 0
            t0 = time.monotonic()
            logdir = root / f"job{jobs - 1}" / f"capture{done}"
            targets = job.addresses if args.only is None else [job.addresses[args.only]]
            if args.analyze:
                view = tfmem_magic.capture(targets, seconds=args.seconds, logdir=logdir)
                parts = [(r.worker, r.report is not None, r.error) for r in view.rows]
                events = [r.report.trace.events if r.report else None for r in view.rows]
            else:
                got = remote.trace_workers(targets, args.seconds, logdir)
                parts = [(c.worker, c.path is not None, c.error) for c in got]
                events = [c.path.stat().st_size if c.path else None for c in got]
            took = time.monotonic() - t0
            time.sleep(1.0)  # a crash at the capture's end shows as an exit a moment later
            deaths = job.deaths() if not all(job.alive()) else []
            ok = sum(1 for _, good, _ in parts if good)
            rows.append({"capture": done, "seconds": round(took, 1), "traced": ok, "sizes_or_events": events})
            line = (
                f"capture {done:2d}: {took:5.1f} s, {ok}/{len(parts)} traces, "
                f"{'events' if args.analyze else 'bytes'} {events}"
            )
            if deaths:
                time.sleep(2.0)
                if args.gdb:
                    job.wait_gdb(180)
                deaths = job.deaths() or deaths
                crashes.append({"capture": done, "job": jobs - 1, "deaths": [(n, str(c)) for n, c, _ in deaths]})
                line += f"  CRASH: {[(n, c) for n, c, _ in deaths]}"
                print(line, flush=True)
                for name, _, text in deaths:
                    tail = text[-12000:] if args.gdb else text[-6000:]
                    print(f"--- {name}'s log (tail)\n{tail}\n---", flush=True)
                job.kill()
                job = None
            else:
                errors = [e for _, good, e in parts if not good]
                if errors:
                    failed.append({"capture": done, "errors": errors})
                    line += f"  no trace: {errors}"
                print(line, flush=True)
            done += 1
            on_job += 1
            if job is not None and args.per_job and on_job >= args.per_job:
                job.kill()
                job = None
            time.sleep(args.gap)
    finally:
        if job is not None:
            job.kill()
    crashed = sum(len(c["deaths"]) for c in crashes)
    summary = {
        "strategy": args.strategy,
        "options": sent,
        "sensitized": args.sensitize,
        "hold_on": args.hold_on,
        "only": args.only,
        "per_job": args.per_job,
        "captures": done,
        "seconds_each": args.seconds,
        "jobs": jobs,
        "crashed_captures": sum(1 for c in crashes if c.get("capture") is not None),
        "crashed_workers": crashed,
        "crashes": crashes,
        "captures_without_trace": failed,
        "elapsed_s": round(time.monotonic() - start, 1),
        "rows": rows,
        "stopped_by_budget": done < args.captures,
    }
    print(
        f"SUMMARY {args.strategy} options={sent}{' sensitized' if args.sensitize else ''}: {done} captures in "
        f"{summary['elapsed_s']} s, "
        f"{summary['crashed_captures']} captures with a crash, {crashed} worker(s) died "
        f"{[c['deaths'] for c in crashes]}, {len(failed)} capture(s) missing a trace, jobs started {jobs}"
        + (" (stopped by the budget)" if summary["stopped_by_budget"] else ""),
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
