"""Which processes `tfmem_magic.serve()` refuses to serve by default: a MultiWorkerMirroredStrategy worker that is
not the chief (TensorFlow 2.21 can crash it when a capture ends: docs/capture-safety.md), read from TF_CONFIG."""

from __future__ import annotations

import json
import socket

import pytest

from tfmem_magic.measure import remote

WORKERS = ["h:1", "h:2"]


@pytest.mark.parametrize(
    "config, refused",
    [
        ({"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 1}}, True),
        ({"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 0}}, False),  # worker 0 is the chief
        ({"cluster": {"chief": ["h:0"], "worker": WORKERS}, "task": {"type": "worker", "index": 0}}, True),
        ({"cluster": {"chief": ["h:0"], "worker": WORKERS}, "task": {"type": "chief", "index": 0}}, False),
        ({"cluster": {"worker": WORKERS, "ps": ["h:3"]}, "task": {"type": "worker", "index": 1}}, False),  # PS
        ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}, False),  # one worker: no collective
        (None, False),
    ],
)
def test_only_a_mirrored_worker_other_than_the_chief_is_refused(monkeypatch, config, refused):
    if config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert (remote.mwms_non_chief() is not None) is refused


def _no_allocator_switch(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(remote.environment, "prepare_allocator", lambda: SimpleNamespace(loaded_after_first_op=False))
    monkeypatch.setattr(remote, "_serving", None)
    monkeypatch.setattr(remote, "_peaks_server", None)
    monkeypatch.delenv(remote.ALLOW_ENV, raising=False)


def test_the_refusal_warns_names_the_risk_and_serves_peaks_where_its_cluster_reaches_it(monkeypatch):
    """No profiler server: the worker's peaks, on the address TF_CONFIG names for it (loopback here), never on
    every interface; a capture reads them over its window (tests/integration/test_cluster_capture.py)."""
    _no_allocator_switch(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = ["127.0.0.1:1", "127.0.0.1:2"]
    config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.warns(RuntimeWarning, match="not serving traces on this worker 1") as said:
        assert remote.serve(port) == port
    try:
        message = str(said[0].message)
        assert "allow_crash_risk=True" in message and "TraceMeRecorder::Consume" in message
        assert f"peaks instead, on 127.0.0.1:{port} only" in message
        assert remote._peaks_server is not None and remote._peaks_server.address == ("127.0.0.1", port)
        answer = remote.read_peaks("127.0.0.1", port, 0.1)
        assert answer is not None and answer["schema"] == remote.PEAKS_SCHEMA
        assert answer["role"] == "worker 1 of a MultiWorkerMirroredStrategy job" and answer["rss_peak_bytes"] > 0
        # a reading that fails is said to the capture, not printed on the job's stderr
        monkeypatch.setattr(remote, "window_peaks", lambda seconds: 1 / 0)
        with pytest.raises(remote.TfmemUsageError, match="could not read its peaks: ZeroDivisionError"):
            remote.read_peaks("127.0.0.1", port, 0.1)
        with socket.create_connection(("127.0.0.1", port)) as conn:  # only its one path answers
            conn.sendall(b"GET /other HTTP/1.0\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.0 404")
    finally:
        remote._peaks_server.stop()


def test_a_worker_whose_address_cannot_listen_serves_nothing_and_says_so(monkeypatch):
    _no_allocator_switch(monkeypatch)
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 1}})
    )
    with pytest.warns(RuntimeWarning, match="not serving traces on this worker 1") as said:
        assert remote.serve(6009) is None  # "h" is no address of this machine
    assert "Its peaks are not served either: h:6009 could not listen" in str(said[0].message)
    assert remote.serving_port() is None


def test_the_host_a_task_is_reached_at_is_read_from_tf_config(monkeypatch):
    config = {"cluster": {"worker": ["10.0.0.2:2222", "[::1]:2223"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert remote.own_host() == "::1"
    config["task"]["index"] = 0
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert remote.own_host() == "10.0.0.2"
    monkeypatch.delenv("TF_CONFIG")
    assert remote.own_host() == "127.0.0.1"


def test_a_broken_tf_config_is_no_refusal(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    assert remote.mwms_non_chief() is None


def test_serving_logs_that_the_port_is_open_to_every_interface_and_how_to_keep_it_private(monkeypatch, caplog):
    """TensorFlow's profiler server binds [::]:PORT with no authentication; serve() says so as it starts it, with the
    mitigations (docs/multi-worker.md). TensorFlow's server itself is not started here: a stand-in records the port."""
    import logging
    import sys
    from types import SimpleNamespace

    started: list[int] = []
    server = SimpleNamespace(start=started.append)
    fake_tf = SimpleNamespace(profiler=SimpleNamespace(experimental=SimpleNamespace(server=server)))
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tf)
    monkeypatch.setattr(remote.environment, "prepare_allocator", lambda: SimpleNamespace(loaded_after_first_op=False))
    monkeypatch.setattr(remote, "_serving", None)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        assert remote.serve(6123) == 6123
    assert started == [6123]
    (record,) = [r for r in caplog.records if r.name == remote.__name__]
    said = record.getMessage()
    assert record.levelno == logging.WARNING
    for words in (
        "every network interface ([::]:6123)",
        "no authentication",
        "firewall",
        "ssh -N -L 6123:localhost:6123",
    ):
        assert words in said
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        assert remote.serve(6123) == 6123  # already serving: nothing started, nothing said again
    assert started == [6123] and len([r for r in caplog.records if r.name == remote.__name__]) == 1
