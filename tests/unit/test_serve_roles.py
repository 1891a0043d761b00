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
