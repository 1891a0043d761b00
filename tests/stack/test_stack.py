"""What must hold on every supported stack: each TensorFlow of the matrix with Keras 3, and tf_keras (Keras 2,
`TF_USE_LEGACY_KERAS=1`) on the newest TensorFlow. The models are written with `tf.keras`, which is whichever
Keras the stack gives a user's code. `./dev test` runs this module in each stack's own environment (see
`./dev stacks`); in the main suite it runs on TensorFlow 2.21 with Keras 3."""

from __future__ import annotations

import os
import re

import numpy as np
import psutil
import pytest

from tfmem_magic import pipeline, predict
from tfmem_magic.advise import fixes
from tfmem_magic.measure import capabilities, kerases
from tfmem_magic.measure.guard import MemoryLimitExceeded

tf = pytest.importorskip("tensorflow")
MiB = 2**20
LEGACY = kerases.legacy_requested()
EXPECTED_KERAS = "tf_keras" if LEGACY else "keras"
keras = tf.keras  # what a user's `tf.keras` code gets on this stack


def test_the_stack_is_the_one_asked_for():
    """Each stack's run says what it ran on (visible in CI's output), and the Keras is the one tf.keras gives."""
    made = type(keras.layers.Dense(1)).__module__.split(".")[0]
    assert made == EXPECTED_KERAS
    print(f"\nstack: TensorFlow {tf.__version__}, {EXPECTED_KERAS} {kerases.version(EXPECTED_KERAS)}; "
          f"capabilities missing: {[c.name for c in capabilities.missing()] or 'none'}")


def test_a_known_allocation_is_measured():
    """In a fresh process (TensorFlow's allocator as a new kernel has it: nothing an earlier test left running)."""
    from fresh import run_in_fresh_shell

    out = run_in_fresh_shell("""
        sh.run_cell("%%tfmem --as rep\\nimport tensorflow as tf\\nx = tf.ones((2048, 4096))\\ny = x * 2\\n"
                    "total = float(tf.reduce_sum(y))")
        rep = sh.user_ns["rep"]
        print(json.dumps({"status": rep.status, "complete": rep.env.allocator_complete, "peak": rep.tf_peak_bytes,
                          "events": rep.trace.events, "keras": rep.env.keras_package,
                          "ops": [[g.op, g.bytes] for g in rep.trace.at_peak[:2]]}))
    """)
    assert out["status"] == "ok" and out["complete"] and out["events"] > 0
    # x and y (32 MiB each) are live together at the peak
    assert 62 * MiB <= out["peak"] <= 70 * MiB, out
    assert [bytes_ for _, bytes_ in out["ops"]] == [32 * MiB, 32 * MiB], out
    assert out["keras"] == EXPECTED_KERAS


def _wide_model(name: str):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((256,)), keras.layers.Dense(1024, activation="relu", name="wide"),
                              keras.layers.Dense(10, name="head")], name=name)
    model.compile(keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n: int = 1024):
    rng = np.random.default_rng(0)
    return rng.random((n, 256), dtype="float32"), rng.integers(0, 10, n)


def test_a_fit_with_validation_is_broken_down_by_layer_and_phase(shell):
    x, y = _data()
    shell.user_ns.update(model=_wide_model("stack_mlp"), x=x, y=y)
    result = shell.run_cell("%%tfmem --as rep\nmodel.fit(x, y, batch_size=128, epochs=1, verbose=0, "
                            "validation_data=(x[:256], y[:256]))")
    assert result.success, result.error_in_exec
    report = shell.user_ns["rep"]
    model = report.model
    assert model is not None and model.keras_package == EXPECTED_KERAS
    assert model.name == "stack_mlp" and model.batch_size == 128 and model.optimizer == "Adam"
    assert model.optimizer_slots == 2 and [layer.name for layer in model.layers] == ["wide", "head"]
    assert model.params == 256 * 1024 + 1024 + 1024 * 10 + 10
    assert model.validation and "fit" in model.calls
    layers = {g.layer: g.bytes for g in report.trace.by_layer}
    phases = {g.phase: g.bytes for g in report.trace.by_phase}
    assert layers.get("wide", 0) > 0, layers
    # where the peak falls differs (Keras 3: in the backward pass, with layer outputs live; tf_keras: in Adam's
    # update, which makes its temporaries unfused), but the training step's phases name what is live there
    assert len({"forward", "backward", "optimizer"} & set(phases)) >= 2, phases
    assert phases.get("other", 0) <= 0.25 * sum(phases.values()), phases


def test_the_what_if_answers_analytically_and_from_probes(shell):
    x, y = _data()
    shell.user_ns.update(model=_wide_model("whatif_mlp"), x=x, y=y)
    shell.run_cell("%%tfmem --as rep\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    report = shell.user_ns["rep"]
    small, large = predict(report, batch_size=32), predict(report, batch_size=512)
    assert small.basis == "analytic" and small.peak_bytes < large.peak_bytes
    assert predict(report, optimizer="sgd").peak_bytes < predict(report).peak_bytes  # no Adam slots
    measured = predict(report, batch_size=512, calibrate=True)  # a clone, built with this stack's Keras
    assert measured.basis == "measured"
    # the 512-batch step holds its activations (2 MiB per 1024 units and 512 rows, a few times over) and the
    # model's weights, gradients and slots (~4 MiB); the probes' answer lies in between those bounds
    assert 4 * MiB < measured.peak_bytes < 64 * MiB, measured


def test_fix_cells_are_written_in_the_models_keras_and_run(shell):
    x, y = _data(512)
    shell.user_ns.update(model=_wide_model("fix_mlp"), x=x, y=y)
    shell.run_cell("%%tfmem --as rep\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    report = shell.user_ns["rep"]
    ctx = fixes.FixContext(source="model.fit(x, y, batch_size=64, epochs=1, verbose=0)", model_name="model",
                           number=report.number)
    lighter = fixes.lighter_optimizer(report, ctx)
    assert f"import {EXPECTED_KERAS}\n" in lighter.code and lighter.predicted_peak_bytes < report.tf_peak_bytes
    assert shell.run_cell(lighter.code).success
    assert type(shell.user_ns["model"].optimizer).__name__ == "SGD"
    after = pipeline.last_report()
    assert after.model.optimizer == "SGD" and after.model.optimizer_slots == 1
    policy = fixes.mixed_precision(report, ctx)
    assert f'{EXPECTED_KERAS}.mixed_precision.set_global_policy("mixed_bfloat16")' in policy.code
    accumulate = fixes.grad_accumulation(report, ctx)
    if LEGACY:
        assert accumulate is None and any("gradient_accumulation_steps" in n for n in report.notes)
    else:
        assert "gradient_accumulation_steps" in accumulate.code
        assert shell.run_cell(accumulate.code).success


def test_the_guard_stops_a_fit_between_steps_and_the_kernel_lives(shell):
    limit = psutil.Process().memory_info().rss + 200 * MiB
    cell = f"""%%tfmem --quick --interval 60000 --limit {limit}
import numpy as np, tensorflow as tf
keras = tf.keras

class Grows(keras.callbacks.Callback):      # stands for a step whose memory keeps growing
    hoard = []
    def on_train_batch_end(self, batch, logs=None):
        self.hoard.append(np.ones(40 * 2**20, np.uint8))

net = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4)])
net.compile("sgd", "mse")
net.fit(np.zeros((640, 8), "float32"), np.zeros((640, 4), "float32"), batch_size=32, callbacks=[Grows()], verbose=0)
"""
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, MemoryLimitExceeded)
    report = pipeline.last_report()
    assert report.status == "oom" and report.guard.tripped_by == "batch-end check"
    assert 4 <= len(shell.user_ns["Grows"].hoard) < 20
    shell.user_ns["Grows"].hoard.clear()
    assert shell.run_cell("%%tfmem --quick\nafter = 1").success


def test_watch_mode_reports_each_cell_and_status_lists_the_stack(shell, capsys):
    shell.run_line_magic("tfmem", "watch on")
    try:
        before = pipeline.last_report()
        shell.run_cell("import tensorflow as tf\nw = tf.ones((512, 512))")
        watched = pipeline.last_report()
        assert watched is not before and watched.mode == "quick"
        assert watched.main_device.peak_bytes - watched.main_device.baseline_bytes >= 1 * MiB
    finally:
        shell.run_line_magic("tfmem", "watch off")
    shell.run_line_magic("tfmem", "status")
    out = capsys.readouterr().out
    assert re.search(rf"TensorFlow {re.escape(tf.__version__)}", out), out
    assert "capabilit" in out.lower(), out
    assert os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "1"


def test_the_keras_callback_records_each_epochs_peak():
    from tfmem_magic.keras import MemoryMonitor

    x, y = _data(512)
    monitor = MemoryMonitor()
    history = _wide_model("monitored_mlp").fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[monitor])
    peaks = history.history["tf_peak_bytes"]
    assert len(peaks) == 2 and peaks == monitor.epoch_peaks()
    # weights, gradients and Adam's two slots of a 1 MiB model are live through each epoch
    assert all(p >= 4 * 2**20 for p in peaks), peaks
    assert len(history.history["rss_peak_bytes"]) == 2
