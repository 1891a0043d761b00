"""Private TensorFlow/Keras APIs behind capability checks: all present on the tested stack; one that a release
moves degrades its feature with a note in the report and in `%tfmem status`, never an exception."""

from __future__ import annotations

import sys
import types

import pytest

import tfmem_magic
from tfmem_magic.adapters.magics import status_text
from tfmem_magic.measure import capabilities

pytestmark = pytest.mark.slow


@pytest.fixture
def fresh_checks():
    capabilities.forget()
    yield
    capabilities.forget()


def test_every_capability_is_there_on_the_tested_stack(fresh_checks):
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    assert capabilities.missing() == []
    status = status_text()
    assert f"Capabilities all {len(capabilities.CAPABILITIES)} available on TensorFlow " in status


def test_a_moved_private_api_degrades_its_feature_with_a_note(fresh_checks, monkeypatch):
    import keras
    import tensorflow as tf
    import tensorflow.python.profiler as profiler_package

    tf.constant(0)
    # as a release that moved them would look to us: the modules, as imported by name, lack the attribute. (Deleting
    # the attribute itself would break TensorFlow, whose own code calls it through the module's globals.)
    for name in ("tensorflow.python.eager.polymorphic_function.tracing_compilation",
                 "tensorflow.python.profiler.profiler_v2"):
        stub = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, stub)
    monkeypatch.setattr(profiler_package, "profiler_v2", sys.modules["tensorflow.python.profiler.profiler_v2"])
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name="moved")
    model.compile("sgd", "mse")
    with tfmem_magic.profile(label="moved") as p:
        model.fit(tf.ones((32, 8)), tf.ones((32, 4)), batch_size=8, verbose=0)
    report = p.report
    notes = " ".join(report.notes)
    assert report.status == "ok" and report.mode == "trace" and report.trace.events > 0
    assert "retracing count is unavailable" in notes and "_create_concrete_function is missing" in notes
    assert "your own profiler session is unavailable" in notes
    assert report.model is not None and report.model.name == "moved"
    assert report.tf_function_traces == {}  # not counted, rather than counted wrong
    status = status_text()
    assert "Capability   retracing count: unavailable on TensorFlow" in status
    assert "tf.function retraces are not counted" in status


def test_an_attribute_a_release_no_longer_assigns_is_reported(fresh_checks, monkeypatch):
    """Instance attributes (a batch dataset's `_batch_size`) are judged from the names the class's code assigns:
    a release whose `__init__` keeps the batch under another name is caught without building a dataset."""
    import keras  # noqa: F401
    import tensorflow.python.data.ops as data_ops

    class Moved:
        def __init__(self, input_dataset, batch_size, drop_remainder, name=None):
            self._batch = batch_size

    name = "tensorflow.python.data.ops.batch_op"
    stub = types.ModuleType(name)
    stub._BatchDataset = stub._ParallelBatchDataset = Moved
    monkeypatch.setitem(sys.modules, name, stub)
    monkeypatch.setattr(data_ops, "batch_op", stub)
    assert [c.name for c in capabilities.missing()] == ["batch of a tf.data pipeline"]
    assert "Capability   batch of a tf.data pipeline: unavailable on TensorFlow" in status_text()
