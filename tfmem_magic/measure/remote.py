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
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.measure import environment

_log = logging.getLogger(__name__)

DEFAULT_PORT = 6009
_ADDRESS = re.compile(r"^(?:grpc://)?(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")
_serving: int | None = None
_peaks_server: PeaksServer | None = None  # where serve() serves peaks instead of traces


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

    On a MultiWorkerMirroredStrategy worker other than the chief (read from TF_CONFIG), it starts no profiler: a
    capture can crash such a worker, and the whole job with it (MWMS_RISK). It serves the worker's peaks instead
    (PeaksServer: TensorFlow's allocator and the process, over the capture's window, read without the profiler, on
    the address TF_CONFIG names for this worker) and warns; None where even that cannot listen.
    `allow_crash_risk=True` (or TFMEM_ALLOW_MWMS_CAPTURE=1) serves traces anyway. The chief is always traced."""
    global _serving
    if not 0 < int(port) < 65536:
        raise TfmemUsageError(f"serve(port={port}): give a TCP port, 1 to 65535 (6009 is usual)")
    if _serving is not None:
        if _serving != port:
            raise TfmemUsageError(
                f"this process already serves its traces on port {_serving}; TensorFlow starts one "
                "profiler server per process"
            )
        return port
    role = mwms_non_chief()
    if role and not (allow_crash_risk or os.environ.get(ALLOW_ENV) == "1"):
        environment.prepare_allocator()  # BFC: the CPU's plain allocator keeps no statistics to read
        host = own_host()
        try:
            peaks = PeaksServer(host, int(port))
        except OSError as exc:
            served = f"Its peaks are not served either: {host}:{port} could not listen ({exc})."
        else:
            global _peaks_server
            _serving, _peaks_server = int(port), peaks
            peaks.start()
            served = (
                f"Serving its allocator's and process's peaks instead, on {host}:{port} only (the address TF_CONFIG "
                "names for it): a capture reads them over its window, with no profiler and no trace."
            )
        warnings.warn(
            f"tfmem_magic.serve(): not serving traces on this {role}. {MWMS_RISK}. {served} "
            f"serve(port, allow_crash_risk=True) or {ALLOW_ENV}=1 serves traces anyway.",
            RuntimeWarning,
            stacklevel=2,
        )
        return _serving
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
    cluster, task = _tf_config()
    if "ps" in cluster:
        return None
    kind, index = task.get("type"), task.get("index", 0)
    workers = cluster.get("worker") or []
    if kind != "worker" or len(workers) + len(cluster.get("chief") or []) < 2:
        return None
    if "chief" not in cluster and int(index or 0) == 0:  # without a chief task, worker 0 is the chief
        return None
    return f"worker {index} of a MultiWorkerMirroredStrategy job"


def _tf_config() -> tuple[dict[str, Any], dict[str, Any]]:
    """TF_CONFIG's cluster and task ({} each where it is unset or unreadable)."""
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    except ValueError:
        return {}, {}
    cluster, task = (config.get("cluster"), config.get("task")) if isinstance(config, dict) else (None, None)
    return (cluster if isinstance(cluster, dict) else {}), (task if isinstance(task, dict) else {})


def own_host() -> str:
    """The host TF_CONFIG names for this task (the address its cluster reaches it at), else loopback."""
    cluster, task = _tf_config()
    try:
        address = cluster[task["type"]][int(task.get("index", 0))]
    except (ValueError, KeyError, IndexError, TypeError):
        return "127.0.0.1"
    host = str(address).rsplit(":", 1)[0].strip("[]")
    return host or "127.0.0.1"


PEAKS_PATH = "/tfmem/peaks"
PEAKS_SCHEMA = "tfmem.peaks/1"


def window_peaks(seconds: float) -> dict[str, Any]:
    """This process's peaks over the next `seconds`, read as MemoryMonitor reads a window (measure/window.py:
    TensorFlow's peak counter and the kernel's RSS high-water mark, each reset at the window's start), with no
    profiler: what a capture gets from a worker it must not trace. TensorFlow is read only where it runs already
    (this may be a server thread: starting TensorFlow here could come before a strategy configured it)."""
    from tfmem_magic.measure import window
    from tfmem_magic.measure.sampling import bytes_in_use, process_rss

    started = time.time()
    device = None
    if environment.tensorflow_initialized():
        try:
            device = window.stats_device(None, "capture")
        except TfmemUsageError:  # no device keeps statistics: the process's peaks alone
            device = None
    tf_start = bytes_in_use(device) if device is not None else None
    opened = window.PeakWindow(device)
    time.sleep(seconds)
    peaks = opened.close()
    tf_version = sys.modules["tensorflow"].__version__ if device is not None else None
    return {
        "schema": PEAKS_SCHEMA,
        "role": mwms_non_chief(),
        "pid": os.getpid(),
        "started_at": started,
        "seconds": seconds,
        "tensorflow": tf_version,
        "device": device,
        "tf_start_bytes": tf_start,
        "tf_peak_bytes": peaks.tf_bytes,
        "tf_end_bytes": bytes_in_use(device) if device is not None else None,
        "rss_start_bytes": opened.rss_start,
        "rss_peak_bytes": peaks.rss_bytes,
        "rss_end_bytes": process_rss(),
        "rss_peak_source": "hwm" if opened.hwm_reset else "sampled",
    }


class PeaksServer:
    """A worker's peaks over HTTP (GET /tfmem/peaks?seconds=S answers `window_peaks(S)` as JSON), on one address
    (`host`: the one its cluster reaches it at, never every interface), one reading at a time (each resets the
    process-wide peak counters). Its threads are daemons: the worker's exit ends them."""

    def __init__(self, host: str, port: int) -> None:
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                try:
                    seconds = float(parse_qs(url.query).get("seconds", ["2"])[0])
                except ValueError:
                    seconds = -1.0
                if url.path != PEAKS_PATH or not 0.05 <= seconds <= 600:
                    self.send_error(404 if url.path != PEAKS_PATH else 400)
                    return
                if not lock.acquire(blocking=False):
                    self.send_error(409, "a capture is reading this worker's peaks already")
                    return
                try:
                    # the status line goes first: the capturing side knows at once that peaks, not a trace, come
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.flush()
                    try:
                        answer = window_peaks(seconds)
                    except Exception as exc:  # noqa: BLE001 - said to the capture, never a traceback on the job's stderr
                        fallback(_log, "the peaks of a capture's window could not be read", exc)
                        answer = {"schema": PEAKS_SCHEMA, "error": f"{type(exc).__name__}: {exc}"[:300]}
                    self.wfile.write(json.dumps(answer).encode())
                except OSError:  # the capturing side went away
                    pass
                finally:
                    lock.release()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the training's stderr stays its own
                _log.debug("peaks server: " + format, *args)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("PeaksHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
        self.server = server_class((host, port), Handler)  # ThreadingHTTPServer's request threads are daemons

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="tfmem-peaks-server", daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def read_peaks(host: str, port: int, seconds: float) -> dict[str, Any] | None:
    """The worker's peaks over `seconds` where it serves them (`PeaksServer`), else None: a profiler server (or
    anything else) answers there. TensorFlow's profiler server speaks gRPC: it closes a connection that begins with
    HTTP/1 at once, before the trace is asked for."""
    with socket.create_connection((host, port), timeout=5) as conn:
        try:
            conn.sendall(f"GET {PEAKS_PATH}?seconds={seconds:g} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            first = b""
            while len(first) < 7 and (chunk := conn.recv(12 - len(first))):
                first += chunk
        except OSError:  # closed or reset: not tfmem's server (TensorFlow's gRPC server may reset it)
            return None
        if not first.startswith(b"HTTP/1."):
            return None
        conn.settimeout(seconds + 30)
        data = bytearray(first)
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0]
    if status_line.split()[1:2] != [b"200"]:
        raise TfmemUsageError(f"the worker's peaks server answered {status_line.decode(errors='replace')}")
    answer = json.loads(body)
    if not isinstance(answer, dict) or answer.get("schema") != PEAKS_SCHEMA:
        raise TfmemUsageError("the worker's peaks server answered something that is not tfmem's peaks")
    if answer.get("error"):
        raise TfmemUsageError(f"the worker could not read its peaks: {answer['error']}")
    return answer


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
    peaks: dict[str, Any] | None = None  # a worker that serves its peaks, not traces (window_peaks' answer)


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
                "worker other than the chief serves its peaks, not traces, and nothing where its TF_CONFIG "
                "address cannot listen: docs/capture-safety.md)"
            )
            return
        try:  # a MultiWorkerMirroredStrategy worker other than the chief serves its peaks only
            result.peaks = read_peaks(host, int(port), seconds)
        except (OSError, ValueError, TfmemUsageError) as exc:
            result.error = f"its peaks could not be read ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
            return
        if result.peaks is not None:
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
                if _still_answers(host, int(port))
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


def _still_answers(host: str, port: int) -> bool:
    """Whether a worker whose capture failed still answers a moment later: one that TensorFlow's profiler crashes as
    the capture ends can answer "no trace event" and go down within the second after (a CI run named such a worker
    idle)."""
    if not _answers(host, port):
        return False
    time.sleep(STILL_ANSWERS_S)
    return _answers(host, port)


STILL_ANSWERS_S = 1.5


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
