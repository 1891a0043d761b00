"""Which processes `tfmem_magic.serve()` refuses to serve by default: a MultiWorkerMirroredStrategy worker that is
not the chief (TensorFlow 2.21 can crash it when a capture ends: docs/capture-safety.md), read from TF_CONFIG."""

from __future__ import annotations

import json

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


def test_the_refusal_warns_names_the_risk_and_serves_nothing(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 1}})
    )
    monkeypatch.delenv(remote.ALLOW_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="not serving traces on this worker 1") as said:
        assert remote.serve(6009) is None
    assert "allow_crash_risk=True" in str(said[0].message) and "TraceMeRecorder::Consume" in str(said[0].message)
    assert remote.serving_port() is None


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
