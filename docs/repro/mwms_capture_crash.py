"""Minimal reproduction, TensorFlow only (no tfmem): a remote profiler capture corrupts the heap of a
MultiWorkerMirroredStrategy worker that is not the chief, in `tsl::profiler::TraceMeRecorder::Consume()`.

    python docs/repro/mwms_capture_crash.py [--captures 30] [--seconds 2] [--host-level 1] [--strict-malloc]

Two MWMS workers on loopback train a tiny Keras model in a custom `strategy.run` loop; each started TensorFlow's
profiler server (`tf.profiler.experimental.server.start`) and nothing else (TensorFlow's default CPU allocator).
This process traces worker 1 (task 1, not the chief) again and again with `tf.profiler.experimental.client.trace`,
at host tracer level 1 (the lowest that records anything; python and device tracers off), and says after which
capture a worker died and how.

Measured on a 2-core machine (TensorFlow 2.21.0, CPU wheel, Python 3.11, glibc 2.36): worker 1 died with SIGSEGV
after capture 22 (101 s) with `--strict-malloc`, and after capture 7 (45 s) with plain malloc. Worker 0 (the
chief) kept running both times. `--strict-malloc` runs the workers with `GLIBC_TUNABLES=glibc.malloc.tcache_count=0` and
`MALLOC_PERTURB_=165` (freed memory overwritten, so that a stale write fails where it happens); it did not
measurably raise the rate here. The rate varies from job to job (about 1 capture in 4 to 1 in 25): rerun, or
raise --captures, when a run ends with no worker dead.

The cause (xla/tsl/profiler/backends/cpu/traceme_recorder.cc): `TraceMeRecorder::Consume()` walks every
thread's events; for a split activity (`TraceMe::ActivityStart` on one thread, `ActivityEnd` on another, as
`BaseCollectiveExecutor::CompleteParamsAsync` does at the default level 1: in the non-chief worker's traces its
"CollectiveExecutor::CompleteParams" events end on gRPC threads, tf_GrpcWorkerEnvQueues, in the chief's on the
collective_ops threads) whose end is consumed before its start, `SplitEventTracker::AddEnd` keeps a pointer to the end
event inside that thread's `std::deque`. The deque is then moved into `result`, a `std::vector<ThreadEvents>`;
when a later thread's push_back makes that vector grow, libstdc++ copies the elements (std::deque's move
constructor is not noexcept) and frees the old deques. `HandleCrossThreadEvents()` then writes
`event->name = std::move(start_event.name)` through the dangling pointer: a use-after-free write, and a free()
of whatever that memory now holds. A native stack (gdb) of the crash:

    #5  malloc_printerr ("double free or corruption (out)")
    #7  free
    #8  tsl::profiler::(anonymous namespace)::SplitEventTracker::FindStartAndMerge(TraceMeRecorder::Event*)
    #9  tsl::profiler::TraceMeRecorder::Consume()
    #10 tsl::profiler::TraceMeRecorder::Stop()
    #11 xla::profiler::(anonymous namespace)::HostTracer::Stop()
    ...
    #15 tsl::ProfilerSession::CollectDataInternal(XSpace*)
    #18 tsl::profiler::(anonymous namespace)::ProfilerServiceImpl::Profile(...)   (thread "grpcpp_sync_ser")

In TensorFlow 2.21.0's libtensorflow_framework.so.2 (disassembled), `Consume()` does not reserve `result`, and
`std::vector<ThreadEvents>::_M_realloc_insert` relocates with `std::__uninitialized_copy` followed by `~deque()`.
A version of the file stored from tensorflow/tensorflow (commit 0d7247fd990b) adds `result.reserve(
recorders.size());` before the loop, which removes the reallocation (a version stored from openxla/xla, commit
45bd14fdd674, does not have it). Other fixes: collect the end events' pointers only after `result` is complete,
or keep the events in a container whose elements never move.
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
import time

WORKER = r"""
import json, os, sys, time
index, ports, profiler_port = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                      "task": {"type": "worker", "index": index}})
import numpy as np, tensorflow as tf, keras
tf.profiler.experimental.server.start(profiler_port)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD()
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
x, y = np.random.rand(1024, 64).astype("float32"), np.random.randint(0, 10, 1024)
batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat()))

def replica(b):
    with tf.GradientTape() as tape:
        loss = loss_fn(b[1], model(b[0], training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

@tf.function
def step(b):
    return strategy.run(replica, args=(b,))

step(next(batches))
print("READY", flush=True)
end = time.time() + float(sys.argv[4])
while time.time() < end:
    step(next(batches))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--captures", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--host-level", type=int, default=1)
    parser.add_argument("--target", type=int, default=1, help="which worker to trace (0 is the chief)")
    parser.add_argument("--strict-malloc", action="store_true")
    parser.add_argument("--budget", type=float, default=300)
    args = parser.parse_args()
    start = time.monotonic()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    folder = tempfile.mkdtemp(prefix="mwms-capture-crash-")
    script = os.path.join(folder, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if args.strict_malloc:
        env.update(GLIBC_TUNABLES="glibc.malloc.tcache_count=0", MALLOC_PERTURB_="165")
    ports, profilers = [free_port(), free_port()], [free_port(), free_port()]
    logs = [open(os.path.join(folder, f"worker{i}.log"), "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, script, str(i), json.dumps(ports), str(profilers[i]),
                               str(args.budget + 60)], env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                              start_new_session=True) for i in range(2)]
    options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=args.host_level, python_tracer_level=0,
                                                       device_tracer_level=0)
    outcome = "no worker died"
    try:
        while not all("READY" in open(log.name).read() for log in logs):
            if any(p.poll() is not None for p in procs) or time.monotonic() - start > 180:
                raise SystemExit("a worker did not start: see " + folder)
            time.sleep(0.5)
        done = 0
        while done < args.captures and time.monotonic() - start < args.budget:
            try:
                tf.profiler.experimental.client.trace(f"grpc://127.0.0.1:{profilers[args.target]}",
                                                      os.path.join(folder, "logs"), int(args.seconds * 1000),
                                                      num_tracing_attempts=1, options=options)
            except Exception as exc:  # noqa: BLE001 - the worker's death is what is looked at
                print(f"capture {done}: {type(exc).__name__}")
            done += 1
            time.sleep(1.5)
            codes = [p.poll() for p in procs]
            print(f"capture {done - 1}: exit codes {codes}", flush=True)
            if any(c is not None for c in codes):
                outcome = f"worker(s) died after capture {done - 1}: exit codes {codes}"
                break
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(f"RESULT {outcome} ({done} captures of worker {args.target}, host tracer level {args.host_level}, "
          f"{'strict' if args.strict_malloc else 'plain'} malloc, {time.monotonic() - start:.0f} s); logs in {folder}")
    for i, log in enumerate(logs):
        text = open(log.name).read()
        for marker in ("free(): ", "double free", "munmap_chunk", "corrupted", "Segmentation fault", "Aborted"):
            if marker in text:
                print(f"worker{i}: ...{text[text.index(marker) - 200:text.index(marker) + 300]}")
                break


if __name__ == "__main__":
    main()
