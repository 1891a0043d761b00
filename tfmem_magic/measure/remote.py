"""Profiling TensorFlow processes from outside, with TensorFlow's own machinery (no protocol of ours): a worker
starts TensorFlow's profiler server (`serve`), and a notebook or a shell asks each worker for a trace with
TensorFlow's profiler client (`trace_workers`). The worker writes the trace itself, under the log directory it is given
(`<logdir>/plugins/profile/<run>/<host>_<port>.xplane.pb`), so that directory must be one both can reach (a shared
path; on one machine, any path)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.measure import environment

_log = logging.getLogger(__name__)

DEFAULT_PORT = 6009
_ADDRESS = re.compile(r"^(?:grpc://)?(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")
_serving: int | None = None


ALLOW_ENV = "TFMEM_ALLOW_MWMS_CAPTURE"  # "1": serve on a non-chief MultiWorkerMirroredStrategy worker anyway
MWMS_RISK = (
    "TensorFlow 2.21 can crash a MultiWorkerMirroredStrategy worker other than the chief when a capture of "
    "it ends (its profiler frees memory it still writes to: TraceMeRecorder::Consume, measured 2 of 65 "
    "captures; the chief and plain or parameter-server workers were never hit): see tfmem's "
    "docs/capture-safety.md"
)


EXPOSED = (
    "TensorFlow's profiler server listens on every network interface ([::]:{port}) and asks for no authentication: "
    "anyone who can reach this port can start a capture (it slows this job) and read the trace (the model's "
    "structure, op names, tensor shapes). Keep the port on a private network or behind a firewall rule that admits "
    "only the machine that captures, or block it on every interface but loopback and capture through an SSH tunnel "
    "(ssh -N -L {port}:localhost:{port} THIS_HOST, then tfmem capture localhost:{port}): see tfmem's "
    'docs/multi-worker.md, "What a served port exposes"'
)


def serve(port: int = DEFAULT_PORT, allow_crash_risk: bool = False) -> int | None:
    """Make this process capturable: call it at the top of a training script, before TensorFlow's first op. It
    switches the CPU allocator to BFC (without it a CPU worker's trace holds only oneDNN's allocations of 256 KiB or
    more) and starts TensorFlow's profiler server on `port`. Returns the port. Calling it again with the same port
    does nothing. The server listens on every interface without authentication (TensorFlow's own: no address or
    credentials can be given), so starting it logs a warning that says so and what keeps the port private (EXPOSED).

    On a MultiWorkerMirroredStrategy worker other than the chief (read from TF_CONFIG), it does not start the
    server and warns, returning None: a capture can crash such a worker, and the whole job with it (MWMS_RISK).
    `allow_crash_risk=True` (or TFMEM_ALLOW_MWMS_CAPTURE=1) serves anyway. The chief is always served."""
    global _serving
    if not 0 < int(port) < 65536:
        raise TfmemUsageError(f"serve(port={port}): give a TCP port, 1 to 65535 (6009 is usual)")
    role = mwms_non_chief()
    if role and not (allow_crash_risk or os.environ.get(ALLOW_ENV) == "1"):
        warnings.warn(
            f"tfmem_magic.serve(): not serving traces on this {role}. {MWMS_RISK}. Capture the chief, or "
            f"save each worker's report (tfmem_magic.keras.MemoryMonitor / %tfmem cluster); "
            f"serve(port, allow_crash_risk=True) or {ALLOW_ENV}=1 serves anyway.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    if _serving is not None:
        if _serving != port:
            raise TfmemUsageError(
                f"this process already serves its traces on port {_serving}; TensorFlow starts one "
                "profiler server per process"
            )
        return port
    setup = environment.prepare_allocator()
    import tensorflow as tf

    if setup.loaded_after_first_op and not environment.allocator_view().complete:
        warnings.warn(
            "tfmem_magic.serve() ran after TensorFlow's first op: the CPU allocator is not BFC, so a capture "
            "of this worker holds few or no memory events. Call it first thing in the script.",
            RuntimeWarning,
            stacklevel=2,
        )
    tf.profiler.experimental.server.start(int(port))
    _serving = int(port)
    _log.warning(EXPOSED.format(port=_serving))
    return _serving


def serving_port() -> int | None:
    return _serving


def mwms_non_chief() -> str | None:
    """'worker 1 of a MultiWorkerMirroredStrategy job' when TF_CONFIG makes this process a worker that is not its
    chief in a job without parameter servers (MWMS's cluster: workers, maybe a chief), else None. Read from the
    environment only: the strategy is not built yet when serve() runs."""
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    except ValueError:
        return None
    cluster, task = config.get("cluster") or {}, config.get("task") or {}
    if not isinstance(cluster, dict) or not isinstance(task, dict) or "ps" in cluster:
        return None
    kind, index = task.get("type"), task.get("index", 0)
    workers = cluster.get("worker") or []
    if kind != "worker" or len(workers) + len(cluster.get("chief") or []) < 2:
        return None
    if "chief" not in cluster and int(index or 0) == 0:  # without a chief task, worker 0 is the chief
        return None
    return f"worker {index} of a MultiWorkerMirroredStrategy job"


def parse_workers(text: str | list[str]) -> list[str]:
    """'host:port,host:port' (or a list) -> ['host:port', ...]; a clear error for anything else."""
    items = text if isinstance(text, list) else [w for w in re.split(r"[,\s]+", text) if w]
    if not items:
        raise TfmemUsageError(
            "name the workers to capture: HOST:PORT[,HOST:PORT...] (each started with "
            "tfmem_magic.serve(PORT) or `tfmem run --serve PORT train.py`)"
        )
    out = []
    for item in items:
        match = _ADDRESS.match(item.strip())
        if match is None or not 0 < int(match.group("port")) < 65536:
            raise TfmemUsageError(f"{item!r} is not a worker address: write HOST:PORT, e.g. 10.0.0.2:6009")
        out.append(f"{match.group('host')}:{int(match.group('port'))}")
    if len(set(out)) != len(out):
        raise TfmemUsageError("a worker is named twice: " + ", ".join(out))
    return out


@dataclass
class Captured:
    """One worker's part of a capture: the trace file it wrote, or why there is none."""

    worker: str
    path: Path | None = None
    error: str | None = None


def trace_workers(workers: list[str], seconds: float, logdir: str | os.PathLike[str] | None = None) -> list[Captured]:
    """Trace every worker for `seconds`, all at once (one client call per worker, started together, so that one
    unreachable worker fails alone), and return where each worker wrote its trace. The traces land under
    `logdir/<host>_<port>/plugins/profile/<run>/` (a temporary folder by default: fine on one machine)."""
    if not 0.05 <= seconds <= 600:
        raise TfmemUsageError(f"--seconds {seconds}: capture for 0.05 to 600 seconds")
    import tensorflow as tf

    base = Path(logdir) if logdir is not None else Path(tempfile.mkdtemp(prefix="tfmem-capture-"))
    results = [Captured(w) for w in workers]

    def one(result: Captured) -> None:
        host, port = result.worker.rsplit(":", 1)
        if not _answers(host, int(port)):  # TF's client says "no trace event" for a refused connection too
            result.error = (
                "unreachable: no profiler server answered there; start the worker with "
                "tfmem_magic.serve(PORT) or `tfmem run --serve PORT` (a MultiWorkerMirroredStrategy "
                "worker other than the chief does not serve unless asked to: a capture can crash it, "
                "docs/capture-safety.md)"
            )
            return
        folder = base / result.worker.replace(":", "_")
        folder.mkdir(parents=True, exist_ok=True)
        try:
            tf.profiler.experimental.client.trace(
                f"grpc://{result.worker}", str(folder), int(seconds * 1000), num_tracing_attempts=2
            )
        except Exception as exc:  # noqa: BLE001 - unreachable, idle, refused: said per worker, the others still count
            fallback(_log, "a worker could not be traced", exc)
            result.error = (
                _why(exc)
                if _answers(host, int(port))
                else (
                    "the worker stopped answering during the capture: it may have crashed (TensorFlow 2.21 crashes "
                    "MultiWorkerMirroredStrategy workers other than the chief when a capture ends, now and then: "
                    "docs/capture-safety.md)"
                )
            )
            return
        found = sorted(folder.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        if found:
            result.path = found[-1]
        else:
            result.error = (
                f"the worker answered but no trace appeared under {folder}: a worker on another machine "
                "writes it on its own disk, so give --logdir a folder both can reach"
            )

    threads = [threading.Thread(target=one, args=(r,), name=f"tfmem-capture-{r.worker}", daemon=True) for r in results]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds + 120  # the client retries an unreachable worker for a while
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for thread, result in zip(threads, results, strict=True):
        if thread.is_alive() and result.path is None and result.error is None:
            result.error = "no answer within the capture's time and two minutes more"
    return results


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if "No trace event" in text or "no trace event" in text.lower():
        # TensorFlow's answer is the same for a worker that profiles itself (one profiler session per process)
        return (
            "the worker recorded nothing while it was traced: it was idle (capture while it trains), or it is "
            "profiling itself already (a %%tfmem trace, tfmem_magic.profile() or tf.profiler.experimental.start "
            "in it: TensorFlow allows one profiler session per process, so capture outside those)"
        )
    if "UNAVAILABLE" in text.upper() or "failed to connect" in text.lower() or "Connection refused" in text:
        return "unreachable: no profiler server answered there (start it with tfmem_magic.serve(PORT))"
    return f"{type(exc).__name__}: {text[:200]}"
