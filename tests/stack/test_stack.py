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


# Capabilities (measure/capabilities.py) a stack is known to lack, by stack, each with the reason: none today. A
# stack whose TensorFlow or Keras moves a private API gets an entry here, and a line in the README's "Supported
# versions" table, rather than a silent pass.
EXPECTED_MISSING: dict[str, dict[str, str]] = {}


def _stack() -> str:
    """The stack's name as ./dev's header says it: 'tf_keras' under TF_USE_LEGACY_KERAS, else 'tf2.16'... (the
    main stack, .venv, is 'tf2.21')."""
    return "tf_keras" if LEGACY else "tf" + ".".join(tf.__version__.split(".")[:2])


def test_the_stack_is_the_one_asked_for():
    """Each stack's run says what it ran on (./dev's header line shows it and the capability summary in CI's
    output), and the Keras is the one tf.keras gives."""
    made = type(keras.layers.Dense(1)).__module__.split(".")[0]
    assert made == EXPECTED_KERAS
    print(
        f"\nstack: TensorFlow {tf.__version__}, {EXPECTED_KERAS} {kerases.version(EXPECTED_KERAS)}; "
        f"{capabilities.summary()}"
    )


def test_no_capability_is_missing_on_this_stack():
    """Every private API tfmem reads is there for TensorFlow and for the Keras that tf.keras is on this stack (or
    exactly those EXPECTED_MISSING names, for its reason)."""
    assert keras.layers.Layer is not None  # the stack's Keras is imported: its capabilities are judged
    capabilities.forget()  # this stack's answers, not what an earlier test of the run left (a module it stubbed)
    expected = EXPECTED_MISSING.get(_stack(), {})
    missing = {c.name: c.api for c in capabilities.missing()}
    assert set(missing) == set(expected), (
        f"{_stack()}: {capabilities.summary()}; missing {missing}, expected {expected or 'none'}"
    )
    needed = {"tensorflow", EXPECTED_KERAS}
    judged = {c.name for c in capabilities.judged()}
    assert {c.name for c in capabilities.CAPABILITIES if c.needs in needed} <= judged, capabilities.summary()


def test_a_known_allocation_is_measured():
    """In a fresh process (TensorFlow's allocator as a new kernel has it: nothing an earlier test left running)."""
    from fresh import run_in_fresh_shell

    out = run_in_fresh_shell("""
        sh.run_cell("%%tfmem --as rep\\nimport tensorflow as tf\\nx = tf.ones((2048, 4096))\\ny = x * 2\\n"
                    "total = float(tf.reduce_sum(y))")
        rep = sh.user_ns["rep"]
        print(json.dumps({"status": rep.status, "complete": rep.env.allocator_complete, "peak": rep.tf_peak_bytes,
                          "events": rep.trace.events, "keras": rep.env.keras_package,
                          "ops": [[g.op, g.requested_bytes, g.bytes] for g in rep.trace.at_peak[:2]]}))
    """)
    assert out["status"] == "ok" and out["complete"] and out["events"] > 0
    # x and y (32 MiB each) are live together at the peak
    assert 62 * MiB <= out["peak"] <= 70 * MiB, out
    assert [requested for _, requested, _ in out["ops"]] == [32 * MiB, 32 * MiB], out
    # BFC hands out a free chunk whole when splitting it would leave less than the request (a 32 MiB + 256 B chunk
    # where a 256 B tensor's chunk was merged with a freed 32 MiB one): the chunk is the request or a little more
    assert all(32 * MiB <= chunk < 64 * MiB for _, _, chunk in out["ops"]), out
    assert out["keras"] == EXPECTED_KERAS


def _wide_model(name: str):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.layers.Input((256,)),
            keras.layers.Dense(1024, activation="relu", name="wide"),
            keras.layers.Dense(10, name="head"),
        ],
        name=name,
    )
    model.compile(keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n: int = 1024):
    rng = np.random.default_rng(0)
    return rng.random((n, 256), dtype="float32"), rng.integers(0, 10, n)


def test_a_fit_with_validation_is_broken_down_by_layer_and_phase(shell):
    x, y = _data()
    shell.user_ns.update(model=_wide_model("stack_mlp"), x=x, y=y)
    # batch 512: the step's layer tensors (2 MiB each) outweigh Adam's update of the 1 MiB kernel; at batch 128 the
    # peak fell in that update, where the layer's last gradient is freed or not (once in CI: no layer at the peak)
    result = shell.run_cell(
        "%%tfmem --as rep\nmodel.fit(x, y, batch_size=512, epochs=1, verbose=0, validation_data=(x[:256], y[:256]))"
    )
    assert result.success, result.error_in_exec
    report = shell.user_ns["rep"]
    model = report.model
    assert model is not None and model.keras_package == EXPECTED_KERAS
    assert model.name == "stack_mlp" and model.batch_size == 512 and model.optimizer == "Adam"
    assert model.optimizer_slots == 2 and [layer.name for layer in model.layers] == ["wide", "head"]
    assert model.params == 256 * 1024 + 1024 + 1024 * 10 + 10
    assert model.validation and "fit" in model.calls
    # per-layer outputs: a Dense layer's output is (batch, units) float32, so units x 4 bytes per sample, exactly
    for layer, units, inputs in zip(model.layers, (1024, 10), (256, 1024), strict=True):
        assert layer.type == "Dense" and layer.params == inputs * units + units, layer
        assert layer.output_shape == f"(None, {units})", layer
        assert layer.activation_bytes_per_sample == units * 4, layer
    layers = {g.layer: g.bytes for g in report.trace.by_layer}
    phases = {g.phase: g.bytes for g in report.trace.by_phase}
    assert layers.get("wide", 0) > 0, (layers, phases, [(g.op, g.phase, g.bytes) for g in report.trace.at_peak[:6]])
    # where the peak falls differs (Keras 3: in the backward pass, with layer outputs live; tf_keras: in Adam's
    # update, which makes its temporaries unfused), but the training step's phases name what is live there
    assert len({"forward", "backward", "optimizer"} & set(phases)) >= 2, phases
    # what no phase names stays a minority (tf2.16's Keras 3.3: 25.4% in one CI run, under load)
    assert phases.get("other", 0) <= 0.3 * sum(phases.values()), phases


def test_the_trace_window_covers_the_first_steps(shell):
    """`--trace-steps N`: the trace pauses after the first N steps of the fit (32 steps here), and the report says
    so: a bounded trace, its windows, and a note naming the first steps."""
    x, y = _data()
    shell.user_ns.update(model=_wide_model("window_mlp"), x=x, y=y)
    result = shell.run_cell("%%tfmem --as rep --trace-steps 3\nmodel.fit(x, y, batch_size=64, epochs=2, verbose=0)")
    assert result.success, result.error_in_exec
    report = shell.user_ns["rep"]
    trace = report.trace
    assert trace is not None and trace.events > 0
    assert report.model is not None and report.model.keras_package == EXPECTED_KERAS and "fit" in report.model.calls
    assert not trace.complete and "traced the first 3 steps of each fit/evaluate/predict call" in (trace.note or ""), (
        trace.note
    )
    assert trace.windows, trace
    # (a window's end is the tracer's clock, read a moment after the cell's: up to a few ms past wall_s)
    assert all(0 <= start < end <= report.wall_s + 0.05 for start, end in trace.windows), (trace.windows, report.wall_s)
    # 29 of the 32 steps ran untraced: the windows leave a gap in the cell
    assert sum(end - start for start, end in trace.windows) < report.wall_s, (trace.windows, report.wall_s)


def test_the_what_if_answers_analytically_and_from_probes(shell, monkeypatch):
    from tfmem_magic.advise import probe_runs

    probe_lines: list[str] = []

    def run_probe(payload, stage):  # probe_runs' own probe process, its stdout kept for the clone's Keras
        returncode, lines, last_error = real_run_probe(payload, stage)
        probe_lines.extend(lines)
        return returncode, lines, last_error

    real_run_probe = probe_runs._run_probe
    monkeypatch.setattr(probe_runs, "_run_probe", run_probe)
    x, y = _data()
    shell.user_ns.update(model=_wide_model("whatif_mlp"), x=x, y=y)
    shell.run_cell("%%tfmem --as rep\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    report = shell.user_ns["rep"]
    small, large = predict(report, batch_size=32), predict(report, batch_size=512)
    assert small.basis == "analytic" and small.peak_bytes < large.peak_bytes
    assert predict(report, optimizer="sgd").peak_bytes < predict(report).peak_bytes  # no Adam slots
    measured = predict(report, batch_size=512, calibrate=True)  # a clone, built with this stack's Keras
    # the step replay where its self-check passed on this stack, else the probes' parts, saying why
    curve = report.whatif_basis.replay
    assert measured.basis == ("replay" if curve.passed else "measured") and (curve.passed or curve.why_not), curve
    # each probe process (calibration's, then the step replay's two, or four when they ran twice) says which Keras
    # built the clone: the model's own (probe_runs refuses another)
    clones = [line.split(" ", 1)[1] for line in probe_lines if line.startswith("TFMEM-CLONE ")]
    assert len(clones) in (3, 5) and set(clones) == {report.model.keras_package} == {EXPECTED_KERAS}, probe_lines
    # the 512-batch step holds its activations (2 MiB per 1024 units and 512 rows, a few times over) and the
    # model's weights, gradients and slots (~4 MiB); the probes' answer lies in between those bounds
    assert 4 * MiB < measured.peak_bytes < 64 * MiB, measured


def test_fix_cells_are_written_in_the_models_keras_and_run(shell):
    x, y = _data(512)
    shell.user_ns.update(model=_wide_model("fix_mlp"), x=x, y=y)
    shell.run_cell("%%tfmem --as rep\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    report = shell.user_ns["rep"]
    ctx = fixes.FixContext(
        source="model.fit(x, y, batch_size=64, epochs=1, verbose=0)", model_name="model", number=report.number
    )
    lighter = fixes.lighter_optimizer(report, ctx)
    assert f"import {EXPECTED_KERAS}\n" in lighter.code and lighter.predicted_peak_bytes < report.tf_peak_bytes
    assert shell.run_cell(lighter.code).success
    assert type(shell.user_ns["model"].optimizer).__name__ == "SGD"
    after = pipeline.last_report()
    assert after.model.optimizer == "SGD" and after.model.optimizer_slots == 1
    policy = fixes.mixed_precision(report, ctx)
    assert f'{EXPECTED_KERAS}.mixed_precision.set_global_policy("mixed_bfloat16")' in policy.code
    # run: the policy of the model's Keras changes, and only that one (the other Keras, when loaded, keeps its own)
    own = kerases.import_flavour(EXPECTED_KERAS).mixed_precision
    other_name = "keras" if LEGACY else "tf_keras"
    other = kerases.module(other_name).mixed_precision if kerases.module(other_name) is not None else None
    before, other_before = own.global_policy().name, other.global_policy().name if other is not None else None
    assert before == "float32"
    try:
        ran = shell.run_cell(policy.code)
        assert ran.success, ran.error_in_exec
        assert own.global_policy().name == "mixed_bfloat16"
        assert other is None or other.global_policy().name == other_before
    finally:
        own.set_global_policy(before)  # later tests build float32 models
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


def test_what_only_tensorflow_holds_is_what_free_gives_back(shell, capsys):
    """A fitted model that no name reaches: the report says how much only TensorFlow still holds (its gradient
    registry's traced training steps, docs/held-memory.md), and `%tfmem free` gives back that much. Which way the
    stack behaves (pinned, or freed at `del`) is printed, so CI's output records it per stack."""
    shell.run_cell(
        "import numpy as np, tensorflow as tf\n"
        "def stack_fitted():\n"
        "    m = tf.keras.Sequential([tf.keras.Input((512,)), tf.keras.layers.Dense(2048), tf.keras.layers.Dense(4)])\n"
        "    m.compile('adam', 'mse')\n"
        "    m.fit(np.zeros((64, 512), 'float32'), np.zeros((64, 4), 'float32'), batch_size=32, verbose=0)\n"
        "    return m\n"
        "stack_state = 3 * 4 * (512 * 2048 + 2048 + 2048 * 4 + 4)"
    )  # weights and Adam's two slots
    # models earlier tests dropped are held too: a first cell takes what is held now as its baseline
    assert shell.run_cell("%%tfmem --quick\nimport gc; gc.collect()").success
    assert shell.run_cell("%%tfmem --quick\nstack_fitted()\ngc.collect()").success
    held = pipeline.last_report().held
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    shell.run_line_magic("tfmem", "free")
    freed = before - tf.config.experimental.get_memory_info("CPU:0")["current"]
    expected = shell.user_ns["stack_state"]
    assert "given back" in capsys.readouterr().out
    with capsys.disabled():
        print(
            f"\n{_stack()}: a dropped fitted model's {expected / MiB:.2f} MiB is "
            + (
                f"held by TensorFlow ({held.runtime_new_bytes / MiB:.2f} MiB more; "
                f"{held.runtime_bytes / MiB:.2f} MiB in all); free gave back {freed / MiB:.2f} MiB"
                if held.runtime_bytes
                else "freed at del (not held)"
            )
        )
    if held.runtime_bytes:  # pinned: what the report said is what came back
        assert abs(held.runtime_new_bytes - expected) <= 0.02 * expected, (held, expected)
        assert freed >= 0.95 * held.runtime_bytes, (held, freed)
    else:  # nothing pinned: nothing left to give back
        assert freed < 0.05 * expected, freed


def _run_cells(shell, cells):
    """Each cell in the notebook's order, kept in its history (a line is named by the cell it is in): each must run."""
    for cell in cells:
        result = shell.run_cell(cell, store_history=True)
        assert result.success, result.error_in_exec or result.error_before_exec


def test_a_layers_memory_is_named_by_the_line_that_made_it(shell):
    """The by-line view (docs/lines.md) on this stack: a built-in layer's tensors at the peak are named by the line
    of the cell that made the layer, with that line's code."""
    x, y = _data(512)
    shell.user_ns.update(x=x, y=y, keras=keras)
    cells = (
        "model = keras.Sequential([\n"
        "    keras.layers.Input((256,)),\n"
        "    keras.layers.Dense(4096, name='big'),\n"
        "    keras.layers.Dense(10),\n"
        "])\n"
        "model.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))",
        "%%tfmem --no-panel --as rep\nmodel.fit(x, y, batch_size=256, epochs=1, verbose=0)",
    )
    _run_cells(shell, cells)
    trace = shell.user_ns["rep"].trace
    assert trace is not None
    big = [g for g in trace.by_line if g.kind == "line" and "Dense(4096" in (g.code or "")]
    assert big, [(g.kind, g.label, g.code, g.layer, g.bytes) for g in trace.by_line]
    # its activations [256, 4096], their gradient or its kernel's gradient [256, 4096]: 4 MiB each, whole
    assert big[0].label.endswith("line 3") and big[0].made_by == big[0].label, big[0]
    assert big[0].bytes >= 4 * MiB, big[0]


def test_a_custom_layers_call_and_eager_ops_are_named_by_their_lines(shell):
    """The by-line view on this stack beyond a built-in layer: a custom layer's `call` line names what it made in
    the fit's graph, and eager ops (a list comprehension, a concat) run in the profiled cell are named by their
    lines through the op callback (docs/lines.md, steps 2 and 7)."""
    x, y = _data(512)
    shell.user_ns.update(x=x, y=y, keras=keras, tf=tf)
    cells = (
        "class Wide(keras.layers.Layer):\n"
        "    def build(self, shape):\n"
        "        self.w = self.add_weight(shape=(shape[-1], 4096))\n"
        "    def call(self, x):\n"
        "        return tf.matmul(x, self.w)\n"
        "class Square(keras.layers.Layer):\n"
        "    def call(self, x):\n"
        "        return x * x",
        "model = keras.Sequential([keras.layers.Input((256,)), Wide(), Square(), keras.layers.Dense(10)])\n"
        "model.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))",
        "%%tfmem --no-panel --as rep\nmodel.fit(x, y, batch_size=256, epochs=1, verbose=0)",
        "%%tfmem --no-panel --as eager\n"
        "parts = [tf.random.normal([1024, 1024]) + 1.0 for _ in range(8)]\n"
        "whole = tf.concat(parts, 0)",
    )
    _run_cells(shell, cells)
    trace = shell.user_ns["rep"].trace
    assert trace is not None
    wide = [g for g in trace.by_line if g.kind == "line" and "tf.matmul(x, self.w)" in (g.code or "")]
    assert wide, [(g.kind, g.label, g.code, g.layer, g.bytes) for g in trace.by_line]
    assert wide[0].label.endswith("line 5") and wide[0].bytes >= 4 * MiB, wide[0]
    eager = shell.user_ns["eager"].trace
    assert eager is not None
    named = {g.code: g.bytes for g in eager.by_line if g.kind == "line"}
    assert any("tf.concat(parts, 0)" in code for code in named), eager.by_line
    assert sum(named.values()) >= 60 * MiB, (named, eager.by_line_note)


def test_each_layer_of_one_kind_keeps_its_own_bytes(shell):
    """Layers named by Keras' counter (`dense`, `dense_1`, `dense_2`): each one's tensors go to it, on tf_keras too,
    whose graph scopes are the layers' names as they are (analysis.bare_scope_layers)."""
    x, y = _data(1024)
    shell.user_ns.update(x=x[:, :64].copy(), y=y, keras=keras)
    cells = (
        "model = keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(2048), keras.layers.Dense(16), "
        "keras.layers.Dense(10)])\n"
        "model.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))",
        "%%tfmem --no-panel --as rep\nmodel.fit(x, y, batch_size=512, epochs=1, verbose=0)",
    )
    _run_cells(shell, cells)
    trace = shell.user_ns["rep"].trace
    names = [layer.name for layer in shell.user_ns["model"].layers]
    seen = {g.layer for g in trace.by_layer}
    # the second layer's backward holds a [512, 2048] gradient of its input at the peak, the first its output
    assert {names[0], names[1]} <= seen, (names, trace.by_layer)


def test_an_ooms_request_is_named_by_its_line(shell):
    """An allocation TensorFlow refuses names the line that asked for it (docs/lines.md, "The line of an OOM"), on
    this stack (a 4 TiB request: the CPU allocator refuses it at once)."""
    shell.user_ns.update(tf=tf)
    shell.run_cell("%%tfmem --no-panel --as oom\nhuge = tf.random.normal([2**40])", store_history=True)
    oom = shell.user_ns["oom"]
    assert oom.status == "oom" and oom.error is not None and oom.error.site is not None, oom.error
    assert "tf.random.normal([2**40])" in (oom.error.site.code or ""), oom.error.site


def test_a_custom_train_steps_line_is_named(shell):
    """A custom `train_step`'s own line names the scratch tensor it makes (docs/lines.md), on this stack's Keras:
    tf_keras' train function has it as a top-level node named `Tile`, looked for in the functions that ran where the
    trace lost its run."""
    x, y = _data(512)
    shell.user_ns.update(x=x[:, :64].copy(), y=y.astype("float32"), keras=keras, tf=tf)
    cells = (
        "class Scratchy(keras.Model):\n"
        "    def train_step(self, data):\n"
        "        x, y = data\n"
        # of the data: a scratch tensor of constants alone is folded to its sum from the function's second call on
        "        scratch = tf.tile(tf.ones([1024, 1024]) * tf.reduce_mean(x), [16, 1])\n"
        "        with tf.GradientTape() as tape:\n"
        "            pred = self(x, training=True)\n"
        # not 0.0 *: a graph optimizer may drop the scratch tensor then
        "            loss = tf.reduce_mean(tf.square(pred - y)) + 1e-12 * tf.reduce_sum(scratch)\n"
        "        grads = tape.gradient(loss, self.trainable_variables)\n"
        "        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))\n"
        "        return {'loss': loss}",
        "inputs = keras.Input((64,))\n"
        "model = Scratchy(inputs, keras.layers.Dense(1)(keras.layers.Dense(64)(inputs)))\n"
        "model.compile('sgd')",
        "_ = tf.zeros([24, 1024, 1024]).numpy().sum(); del _",  # regions grown first (test_by_line says why)
    )
    _run_cells(shell, cells)
    result = shell.run_cell(
        "%%tfmem --no-panel --as rep\nmodel.fit(x, y, batch_size=256, epochs=1, verbose=0)", store_history=True
    )
    assert result.success, result.error_in_exec
    trace = shell.user_ns["rep"].trace
    tile = [g for g in trace.by_line if g.kind == "line" and "tf.tile(" in (g.code or "")]
    assert tile and tile[0].label.endswith("line 4") and tile[0].bytes >= 64 * MiB, trace.by_line
