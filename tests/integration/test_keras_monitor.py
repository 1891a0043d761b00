"""`tfmem_magic.keras.MemoryMonitor` on real Keras fits, evaluates and predicts (TensorFlow on CPU, BFC allocator)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

import tfmem_magic
from tfmem_magic.core.errors import MemoryGrowthWarning, TfmemUsageError
from tfmem_magic.core.session import SESSION

keras = pytest.importorskip("keras")
from tfmem_magic.keras import MemoryMonitor  # noqa: E402

pytestmark = pytest.mark.slow
MiB = 2**20


def wide_model(name: str = "wide_mlp") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(1024, activation="relu", name="wide"),
            keras.layers.Dense(10, name="head"),
        ],
        name=name,
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def data(n: int = 512):
    rng = np.random.default_rng(0)
    return rng.random((n, 256), dtype="float32"), rng.integers(0, 10, n)


def test_epoch_peaks_reach_history_and_agree_with_an_enclosing_measurement():
    x, y = data()
    model = wide_model()
    monitor = MemoryMonitor()
    with tfmem_magic.profile(label="around the fit", mode="quick") as p:
        history = model.fit(
            x, y, batch_size=64, epochs=2, validation_data=(x[:128], y[:128]), verbose=0, callbacks=[monitor]
        )
    peaks = history.history["tf_peak_bytes"]
    assert len(peaks) == 2 and len(history.history["rss_peak_bytes"]) == 2
    # the window reset TF's peak counter each epoch; the enclosing measurement kept its own (folded) peak
    whole = p.report.main_device.peak_bytes
    assert max(peaks) <= whole and max(peaks) >= 0.97 * whole, (peaks, whole)
    # the model's own state is live through each epoch: weights, gradients and Adam's two slots (~4 x 1 MiB)
    state = sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    assert min(peaks) >= 4 * state
    assert all(r >= 100 * MiB for r in history.history["rss_peak_bytes"])  # a TF process holds hundreds of MiB
    assert monitor.device == "CPU:0" and [r["kind"] for r in monitor.records] == ["epoch", "epoch"]
    assert not SESSION.measuring and not SESSION.abandoned


def test_evaluate_and_predict_report_their_own_peak():
    x, y = data()
    model = wide_model()
    monitor = MemoryMonitor()
    model.evaluate(x, y, batch_size=512, verbose=0, callbacks=[monitor])
    # Keras hands on_test_end a copy of the logs it returns: the figures are the monitor's records
    assert monitor.last["tf_peak_bytes"] > 512 * 1024 * 4  # the first layer's output for 512 samples
    model.predict(x, batch_size=512, verbose=0, callbacks=[monitor])
    assert [(r["call"], r["kind"]) for r in monitor.records] == [("evaluate", "call"), ("predict", "call")]
    assert all(r["tf_peak_bytes"] > 512 * 1024 * 4 for r in monitor.records)


def test_a_standalone_evaluate_and_predict_save_their_figures(tmp_path):
    """No fit: the figures are saved at the end of evaluate and of predict, not only at the end of training."""
    x, y = data()
    model = wide_model()
    monitor = MemoryMonitor(save=tmp_path / "out")
    model.evaluate(x, y, batch_size=512, verbose=0, callbacks=[monitor])
    saved = json.loads((tmp_path / "out" / "tfmem-epochs.json").read_text())
    assert saved["device"] == "CPU:0"
    assert [(r["call"], r["kind"]) for r in saved["records"]] == [("evaluate", "call")]
    assert saved["records"][0]["tf_peak_bytes"] == monitor.last["tf_peak_bytes"] > 512 * 1024 * 4
    model.predict(x, batch_size=512, verbose=0, callbacks=[monitor])
    saved = json.loads((tmp_path / "out" / "tfmem-epochs.json").read_text())
    assert [(r["call"], r["kind"]) for r in saved["records"]] == [("evaluate", "call"), ("predict", "call")]
    assert saved["records"] == monitor.records


class BatchLogs(keras.callbacks.Callback):
    """What a callback listed after the monitor finds in each batch's logs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((batch, (logs or {}).get("tf_peak_bytes")))


def test_every_batch_is_a_window_of_its_own():
    x, y = data()
    monitor, after = MemoryMonitor(every="batch"), BatchLogs()
    history = wide_model().fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[monitor, after])  # 8 steps each
    for epoch in (0, 1):
        windows = [r for r in monitor.records if r["kind"] == "batches" and r["epoch"] == epoch]
        # one window per batch, then what followed the last batch up to the epoch's end
        assert [r["batch"] for r in windows] == [*range(8), None]
        # each step holds the first layer's activations and their gradient for 64 samples (256 KiB each) at least
        assert all(r["tf_peak_bytes"] > 2 * 64 * 1024 * 4 for r in windows[:-1]), windows
        epoch_record = [r for r in monitor.records if r["kind"] == "epoch" and r["epoch"] == epoch]
        assert epoch_record[0]["tf_peak_bytes"] == max(r["tf_peak_bytes"] for r in windows)
    # each batch's logs carry its own window's peak, for the callbacks listed after the monitor
    batch_windows = [r for r in monitor.records if r["kind"] == "batches" and r["batch"] is not None]
    assert after.seen == [(r["batch"], r["tf_peak_bytes"]) for r in batch_windows]
    assert history.history["tf_peak_bytes"] == monitor.epoch_peaks()


def test_windows_of_n_batches_and_the_epoch_as_their_largest():
    x, y = data()
    monitor = MemoryMonitor(every=2)
    history = wide_model().fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[monitor])  # 8 steps
    windows = [r for r in monitor.records if r["kind"] == "batches"]
    assert [r["batch"] for r in windows] == [1, 3, 5, 7, None]  # every 2 batches, then what followed the last
    epoch = [r for r in monitor.records if r["kind"] == "epoch"]
    assert epoch[0]["tf_peak_bytes"] == max(r["tf_peak_bytes"] for r in windows)
    assert history.history["tf_peak_bytes"] == [epoch[0]["tf_peak_bytes"]]


class KeepsATensorPerEpoch(keras.callbacks.Callback):
    """A leak across epochs: 8 MiB kept at the start of every epoch."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def on_epoch_begin(self, epoch, logs=None):
        import tensorflow as tf

        self.kept.append(tf.ones((2 * MiB,)) * 2.0)


def test_a_peak_that_grows_every_epoch_warns_once_and_a_steady_one_does_not():
    x, y = data(256)
    with pytest.warns(MemoryGrowthWarning, match=r"grew in each of the last 3 epochs") as caught:
        wide_model().fit(x, y, batch_size=64, epochs=6, verbose=0, callbacks=[KeepsATensorPerEpoch(), MemoryMonitor()])
    assert len([w for w in caught if issubclass(w.category, MemoryGrowthWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGrowthWarning)
        wide_model().fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=[MemoryMonitor()])


def test_the_first_steps_traced_into_a_saved_report(tmp_path):
    # activations (256 x 4096 floats, 4 MiB per tensor) outweigh the weights and Adam's slots (1 + 2 MiB), so the
    # first steps' peak is in a training step, not in the slots' creation (the first_cnn-like MLP above peaked
    # there in CI, with no layer at the peak)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(4096, activation="relu", name="wide"),
            keras.layers.Dense(10, name="head"),
        ],
        name="traced_mlp",
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    monitor = MemoryMonitor(trace_steps=3, save=tmp_path)
    model.fit(
        rng.random((1024, 64), dtype="float32"),
        rng.integers(0, 10, 1024),
        batch_size=256,
        epochs=2,
        verbose=0,
        callbacks=[monitor],
    )
    report = monitor.report
    assert report is not None and report.mode == "trace" and report.label == "traced_mlp: first 3 steps of fit"
    assert "wide" in {g.layer for g in report.trace.by_layer}
    assert {"forward", "backward"} & {g.phase for g in report.trace.by_phase}
    assert report.model is not None and report.model.name == "traced_mlp"
    assert (tmp_path / "tfmem-traced_mlp-first-steps.json").exists()
    assert "<html" in (tmp_path / "tfmem-traced_mlp-first-steps.html").read_text()[:200].lower()
    saved = json.loads((tmp_path / "tfmem-epochs.json").read_text())
    assert saved["device"] == "CPU:0" and len(saved["records"]) == 2
    assert not math.isnan(saved["records"][0]["tf_peak_bytes"])
    assert not SESSION.measuring and not SESSION.abandoned


class FailsAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("stop in a traced step")


def test_a_fit_that_raises_in_a_traced_step_leaves_nothing_armed():
    x, y = data()
    monitor = MemoryMonitor(trace_steps=5)
    with pytest.raises(RuntimeError, match="stop in a traced step"):
        wide_model().fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[monitor, FailsAtBatch()])
    assert SESSION.abandoned and SESSION.measuring  # the trace is still open: Keras calls no hook on an error
    with tfmem_magic.profile(label="next") as p:  # the next measurement ends it first, and traces as usual
        wide_model().fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)
    assert p.report.mode == "trace" and p.report.trace.events > 0
    assert monitor.report is not None and "raised before its traced steps ended" in " ".join(monitor.report.notes)
    assert not SESSION.measuring and not SESSION.abandoned
    # the same monitor on the next fit starts clean: its first epoch is that fit's, not the failed one's
    history = wide_model().fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[monitor])
    assert history.history["tf_peak_bytes"] == monitor.epoch_peaks()[-2:]
    assert [r["kind"] for r in monitor.records[-2:]] == ["epoch", "epoch"]


def test_a_raising_fit_inside_a_tfmem_cell_leaves_keras_as_it_was(shell):
    x, y = data()
    shell.user_ns.update(
        model=wide_model("raising_mlp"), x=x, y=y, MemoryMonitor=MemoryMonitor, FailsAtBatch=FailsAtBatch
    )
    originals = (keras.Model.fit, keras.Layer.__call__)
    result = shell.run_cell(
        "%%tfmem --as r\nmonitor = MemoryMonitor(trace_steps=5)\n"
        "model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[monitor, FailsAtBatch()])"
    )
    assert isinstance(result.error_in_exec, RuntimeError)
    # the cell's end ended the monitor's trace first (inner before outer): no patch, slot or session is left
    assert (keras.Model.fit, keras.Layer.__call__) == originals
    assert not SESSION.measuring and not SESSION.abandoned
    assert shell.user_ns["monitor"].report is not None and shell.user_ns["r"].status == "error"


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"every": "epochs"}, "use 'epoch', 'batch', or a number of batches"),
        ({"every": 0}, "use 'epoch', 'batch', or a number of batches"),
        ({"trace_steps": -1}, "a number of steps"),
    ],
)
def test_bad_arguments_say_what_to_write(kwargs, expected):
    with pytest.raises(TfmemUsageError, match=expected):
        MemoryMonitor(**kwargs)


def test_an_unknown_device_is_named():
    x, y = data(64)
    with pytest.raises(TfmemUsageError, match=r"device='GPU:3'.*devices with statistics: CPU:0"):
        wide_model().fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[MemoryMonitor(device="GPU:3")])


def test_a_script_that_builds_its_pipeline_before_creating_the_monitor_sees_every_allocation():
    """A script imports the monitor at the top and creates it after its tf.data pipeline (TensorFlow's first op):
    the import set BFC up, so nothing warns and the epoch's peak holds the model's small tensors too."""
    from fresh import run_python

    out = run_python("""
        import json, warnings
        import numpy as np
        from tfmem_magic.keras import MemoryMonitor
        import keras, tensorflow as tf
        x, y = np.random.rand(256, 64).astype("float32"), np.random.randint(0, 10, 256)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)       # TensorFlow's first op
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.Dense(10)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor = MemoryMonitor()
            model.fit(train, epochs=1, verbose=0, callbacks=[monitor])
        print(json.dumps({"warnings": [str(w.message) for w in caught if "MemoryMonitor" in str(w.message)],
                          "peak": monitor.epoch_peaks()[0]}))
    """)
    assert out["warnings"] == []
    # every tensor here is under oneDNN's 256 KiB threshold: without BFC the epoch would read 0 bytes or so
    assert 20_000 <= out["peak"] <= 4 * 2**20, out


def test_keras_tensorboard_callback_listed_after_it_records_the_peaks(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    x, y = data(256)
    monitor = MemoryMonitor()
    wide_model().fit(
        x, y, batch_size=64, epochs=2, verbose=0, callbacks=[monitor, keras.callbacks.TensorBoard(str(tmp_path))]
    )
    acc = EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "epoch_tf_peak_bytes" in acc.Tags()["tensors"], acc.Tags()
    logged = [float(make_ndarray(e.tensor_proto)) for e in acc.Tensors("epoch_tf_peak_bytes")]
    assert logged == pytest.approx(monitor.epoch_peaks(), rel=1e-6)  # float32 in the summary


def test_inside_a_tfmem_cell_the_cells_peak_stays_whole(shell):
    x, y = data()
    shell.user_ns.update(model=wide_model("cell_mlp"), x=x, y=y, MemoryMonitor=MemoryMonitor)
    result = shell.run_cell(
        "%%tfmem --quick --as r\nmonitor = MemoryMonitor()\n"
        "model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[monitor])"
    )
    assert result.error_in_exec is None
    report, monitor = shell.user_ns["r"], shell.user_ns["monitor"]
    # each epoch reset TensorFlow's peak counter; the cell's peak folds every window in
    whole = report.main_device.peak_bytes
    assert max(monitor.epoch_peaks()) <= whole and max(monitor.epoch_peaks()) >= 0.97 * whole
    assert not SESSION.measuring
