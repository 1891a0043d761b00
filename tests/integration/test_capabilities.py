"""Private TensorFlow/Keras APIs behind capability checks: all present on the tested stack; one that a release
moves degrades its feature with a note in the report and in `%tfmem status`, never an exception."""

from __future__ import annotations

import sys
import types

import pytest
from fresh import run_python

import tfmem_magic
from tfmem_magic.measure import capabilities
from tfmem_magic.show.status import status_text

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
    judged = capabilities.judged()
    assert {c.needs for c in judged} >= {"tensorflow", "keras"}
    assert f"Capabilities all {len(judged)} available on TensorFlow " in status_text()


def test_every_capability_of_both_kerases_is_checked_once_at_load():
    """In a fresh process with TensorFlow, Keras 3 and tf_keras imported before `%load_ext`: loading judges all of
    them, and later reports and `%tfmem status` read the kept answers (no probe runs again)."""
    pytest.importorskip("tf_keras")
    out = run_python("""
        import json, tfmem_magic
        tfmem_magic.prepare()
        import keras, tensorflow as tf, tf_keras
        from IPython.core.interactiveshell import InteractiveShell
        from tfmem_magic.show.status import status_text
        from tfmem_magic.measure import capabilities

        probed = []
        for cap in capabilities.CAPABILITIES:  # count the probes that run from here on
            object.__setattr__(cap, "probe", (lambda p, n: lambda: probed.append(n) or p())(cap.probe, cap.name))
        sh = InteractiveShell.instance()
        sh.run_line_magic("load_ext", "tfmem_magic")
        at_load = list(probed)
        sh.run_cell("%%tfmem --quick\\nx = tf.ones((64, 64))")
        status = status_text()
        print(json.dumps({"at_load": at_load, "after": probed[len(at_load):], "status": status,
                          "missing": [c.name for c in capabilities.missing()],
                          "all": [c.name for c in capabilities.CAPABILITIES], "summary": capabilities.summary()}))
    """)
    assert sorted(out["at_load"]) == sorted(out["all"]) and out["after"] == [], out
    assert out["missing"] == []
    assert f"Capabilities all {len(out['all'])} available on TensorFlow " in out["status"], out["status"]
    assert "tf_keras model walk" in out["status"] and "not imported" not in out["status"]
    assert out["summary"] == f"capabilities {len(out['all'])}/{len(out['all'])}"


def test_capabilities_wait_for_what_they_need_and_are_kept():
    """Loaded before TensorFlow: nothing is probed (nothing is imported for it). Each group is probed once what it
    needs is imported: TensorFlow's at the first check after `import tensorflow`, Keras 3's after `import keras`."""
    out = run_python("""
        import json, sys, tfmem_magic
        tfmem_magic.prepare()
        from IPython.core.interactiveshell import InteractiveShell
        from tfmem_magic.show.status import status_text
        from tfmem_magic.measure import capabilities

        probed = []
        for cap in capabilities.CAPABILITIES:
            object.__setattr__(cap, "probe", (lambda p, n: lambda: probed.append(n) or p())(cap.probe, cap.name))
        sh = InteractiveShell.instance()
        sh.run_line_magic("load_ext", "tfmem_magic")
        steps = {"load": (list(probed), "tensorflow" in sys.modules, status_text())}
        import tensorflow as tf
        capabilities.check()
        steps["tensorflow"] = (list(probed), "keras" in sys.modules, status_text())
        import keras
        capabilities.check(); capabilities.check()
        steps["keras"] = (list(probed), "tf_keras" in sys.modules, status_text())
        print(json.dumps({"steps": steps, "needs": {c.name: c.needs for c in capabilities.CAPABILITIES}}))
    """)
    needs, steps = out["needs"], out["steps"]
    tensorflow_ones = sorted(n for n, what in needs.items() if what == "tensorflow")
    keras_ones = sorted(n for n, what in needs.items() if what == "keras")
    probed, imported, status = steps["load"]
    assert probed == [] and not imported and "Capabilities checked once TensorFlow is imported" in status
    probed, keras_imported, status = steps["tensorflow"]
    if not keras_imported:  # TensorFlow did not import Keras by itself
        assert sorted(probed) == tensorflow_ones, probed
        assert "Capabilities checked when keras or tf_keras is imported: " in status, status
    probed, tf_keras_imported, status = steps["keras"]
    assert sorted(probed) == sorted(tensorflow_ones + keras_ones), probed  # each once: the second check re-probes none
    if not tf_keras_imported:
        assert "Capabilities checked when tf_keras is imported: tf_keras model walk" in status, status


def test_a_moved_private_api_degrades_its_feature_with_a_note(fresh_checks, monkeypatch):
    import keras
    import tensorflow as tf
    import tensorflow.python.profiler as profiler_package

    tf.constant(0)
    # as a release that moved them would look to us: the modules, as imported by name, lack the attribute. (Deleting
    # the attribute itself would break TensorFlow, whose own code calls it through the module's globals.)
    for name in (
        "tensorflow.python.eager.polymorphic_function.tracing_compilation",
        "tensorflow.python.profiler.profiler_v2",
    ):
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


def test_a_moved_profiler_v2_reads_as_no_session_of_yours_and_the_cell_is_traced(fresh_checks, monkeypatch):
    """`user_profiler_running` imported profiler_v2 unguarded: a TensorFlow without it made every cell's arming
    fail (each %%tfmem cell then ran unmeasured). Now it reads as "no session of yours" and the cell is traced."""
    import keras
    import tensorflow as tf
    import tensorflow.python.profiler as profiler_package

    from tfmem_magic.measure.tracer import user_profiler_running

    tf.constant(0)
    monkeypatch.setitem(sys.modules, "tensorflow.python.profiler.profiler_v2", None)  # `import` raises now
    monkeypatch.delattr(profiler_package, "profiler_v2", raising=False)  # nor left on its package
    assert user_profiler_running() is False
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name="no_v2")
    model.compile("sgd", "mse")
    with tfmem_magic.profile(label="no_v2") as p:
        model.fit(tf.ones((32, 8)), tf.ones((32, 4)), batch_size=8, verbose=0)
    report = p.report
    assert report.status == "ok" and report.mode == "trace" and report.trace.events > 0
    assert report.model is not None and report.model.name == "no_v2"
    assert "your own profiler session is unavailable" in " ".join(report.notes)
    assert [c.name for c in capabilities.missing()] == ["your own profiler session"]
    assert "Capability   your own profiler session: unavailable on TensorFlow" in status_text()


# ---- each private API removed, in a fresh process -------------------------------------------------------------------
# How a release that moved the API would look to tfmem, without breaking TensorFlow or Keras themselves (both keep
# working; only the name tfmem reads is gone). Each process removes one, so the process is never left half-patched:
# - rename(prefix, old): every module of the package `prefix` is compiled with `old` renamed (a pure-Python name:
#   Keras' `_flatten_layers`, tf.data's `_input_dataset`), as a release that renamed it would be;
# - without(module, attribute): the module, as imported by name, lacks the attribute (a C++ binding, or a module
#   TensorFlow's own code holds in its globals);
# - hidden(obj, attribute): an attribute TensorFlow's C++ reads by name (`_context_handle`) is hidden from tfmem's
#   code only.
_TOOLS = r"""
import importlib, importlib.machinery, json, os, re, sys, types
import tfmem_magic
tfmem_magic.prepare()
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"


def rename(prefix, old):
    name = re.compile(rb"(?<![A-Za-z0-9_])" + old.encode() + rb"(?![A-Za-z0-9_])")  # that identifier only

    class Renamed(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):  # not cached: the package's own .pyc files stay as they were
            source = self.get_data(self.path)
            if not name.search(source):
                return super().get_code(fullname)
            return compile(name.sub(old.encode() + b"_moved_by_a_release", source), self.path, "exec",
                           dont_inherit=True)

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != prefix and not name.startswith(prefix + "."):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
                spec.loader = Renamed(spec.loader.name, spec.loader.path)
            return spec

    assert prefix not in sys.modules, "rename before the package is imported"
    sys.meta_path.insert(0, Finder)


def without(module, attribute):
    real = importlib.import_module(module)
    stub = types.ModuleType(module)
    stub.__dict__.update({k: v for k, v in vars(real).items() if k != attribute})
    sys.modules[module] = stub
    parent, _, leaf = module.rpartition(".")
    setattr(sys.modules[parent], leaf, stub)


def hidden(obj, attribute):
    kept = "_kept" + attribute

    class Hidden:
        def __get__(self, instance, owner=None):
            if instance is None or sys._getframe(1).f_globals.get("__name__", "").startswith("tfmem_magic"):
                raise AttributeError(attribute)
            return instance.__dict__[kept]

        def __set__(self, instance, value):
            instance.__dict__[kept] = value

    obj.__dict__[kept] = obj.__dict__.pop(attribute)
    setattr(type(obj), attribute, Hidden())
"""

# One model that exercises every Keras-side capability: a MultiHeadAttention (its internal shapes), a custom layer
# that keeps a custom layer inside itself (the model walk), a metric class of the notebook's own (calibration's
# custom classes), fed by a tf.data pipeline whose batch is open in its element_spec (.batch().map().prefetch()),
# then a custom loop whose optimizer.apply() leaves the variables out (Keras 3).
_CELL = r"""
import tensorflow as tf
tf.profiler.experimental.Trace  # TensorFlow's public API, as its import made it
if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as K
else:
    import keras as K
if AFTER_IMPORT:
    exec(AFTER_IMPORT)
from tfmem_magic.show.status import status_text
from tfmem_magic.advise import probe_runs
from tfmem_magic.measure import capabilities, environment, feeding, instrument, xplane


class Core(K.layers.Dense):
    pass


class Block(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.core = Core(16, name="core")

    def call(self, x):
        return self.core(x)


class Hits(K.metrics.Metric):
    def __init__(self, name="hits", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_weight(name="total", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(tf.cast(y_pred, "float32")))

    def result(self):
        return self.total


inputs = K.Input((6, 16))
x = K.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="attn")(inputs, inputs)
x = Block(name="block")(x)
x = K.layers.GlobalAveragePooling1D(name="pool")(x)
model = K.Model(inputs, K.layers.Dense(4, name="head")(x), name="caps")
model.compile(K.optimizers.Adam(), "mse", metrics=[Hits()])
ds = tf.data.Dataset.from_tensor_slices((tf.ones((40, 6, 16)), tf.ones((40, 4)))).batch(8)
ds = ds.map(lambda a, b: (a, b)).prefetch(1)
with tfmem_magic.profile(label="caps", keep_xspaces=True) as p:
    model.fit(ds, epochs=1, verbose=0)
rep = p.report
trace = rep.trace
out = {"status": rep.status, "mode": rep.mode, "events": trace.events if trace else 0, "notes": " ".join(rep.notes),
       "model": rep.model.name if rep.model else None, "layers": [g.layer for g in trace.by_layer] if trace else [],
       "attn_bytes": next(la.activation_bytes_per_sample for la in rep.model.layers if la.name == "attn"),
       "tf_figures": rep.main_device is not None, "running": environment.tensorflow_initialized(),
       "walk": sorted(la.name for la in instrument.all_layers(model)),
       "own": sorted(c.__name__ for c in probe_runs._own_classes(model)),
       "dataset_batch": feeding.dataset_batch(ds)[0], "model_batch": rep.model.batch_size,
       "span_class": instrument._trace_class() is tf.profiler.experimental.Trace,
       "unreadable": sum(xplane.read_xspace(data, 0, reference=True)[0].unreadable for data, _ in p.xspaces),
       "xspaces": len(p.xspaces)}
if K.__name__ == "keras":
    opt = K.optimizers.SGD()
    opt.build(model.trainable_variables)
    xb = tf.ones((8, 6, 16))
    with tfmem_magic.profile(label="loop", mode="quick") as q:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(xb, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables))
    out["loop_optimizer"] = q.report.model.optimizer if q.report.model else None
out.update(missing=[c.name for c in capabilities.missing()], status_text=status_text())
print(json.dumps(out))
"""

# capability -> (code before TensorFlow is imported, code after, tf_keras)
_REMOVED = {
    "per-op trace": ("", "without('tensorflow.python.profiler.internal._pywrap_profiler', 'ProfilerSession')", False),
    "layer and phase spans": ("", "without('tensorflow.python.profiler.trace', 'Trace')", False),
    "trace reader fallback": ("", "without('tensorflow.tsl.profiler.protobuf.xplane_pb2', 'XPlane')", False),
    "TensorFlow started?": (
        "",
        "from tensorflow.python.eager import context\nhidden(context.context(), '_context_handle')",
        False,
    ),
    "steps of a tf.data pipeline": ("rename('tensorflow.python.data', '_input_dataset')", "", False),
    "Keras model walk": ("rename('keras', '_flatten_layers')", "", False),
    "attention's internal shapes": ("rename('keras', '_build_shapes_dict')", "", False),
    "custom loop's optimizer": ("rename('keras', '_trainable_variables')", "", False),
    "custom metrics in calibration": ("rename('keras', '_user_metrics')", "", False),
    "tf_keras model walk": ("rename('tf_keras', '_flatten_layers')", "", True),
    "tf_keras attention's internal shapes": ("rename('tf_keras', '_query_shape')", "", True),
    "tf_keras custom metrics in calibration": ("rename('tf_keras', '_user_metrics')", "", True),
}


def _run_without(name: str | None, tf_keras: bool = False) -> dict:
    before, after, tf_keras = _REMOVED[name] if name else ("", "", tf_keras)
    code = _TOOLS + before + f"\nAFTER_IMPORT = {after!r}\n" + _CELL
    return run_python(code, env={"TF_USE_LEGACY_KERAS": "1" if tf_keras else "0"})


@pytest.fixture(scope="module")
def intact():
    """The same cell with every API in place (Keras 3 and tf_keras): what each removal is compared with."""
    return {False: _run_without(None), True: _run_without(None, tf_keras=True) if _has_tf_keras() else None}


def _has_tf_keras() -> bool:
    import importlib.util

    return importlib.util.find_spec("tf_keras") is not None


def test_the_cell_uses_every_api_when_all_are_there(intact):
    for tf_keras, out in intact.items():
        if out is None:
            continue
        assert out["missing"] == [] and out["status"] == "ok" and out["mode"] == "trace", out
        assert "unavailable" not in out["notes"] and out["tf_figures"] and out["running"]
        assert "core" in out["walk"] and {"Block", "Core", "Hits"} <= set(out["own"]), out
        assert out["attn_bytes"] > 6 * 16 * 4  # its output and, inside it, the scores and projections
        # (the private Trace is the class TensorFlow's public API exports: the fallback makes the same annotations)
        assert out["dataset_batch"] == 8 and out["unreadable"] == 0 and out["span_class"] and "attn" in out["layers"]
        if not tf_keras:
            assert out["loop_optimizer"] == "SGD"


@pytest.mark.parametrize("name", list(_REMOVED))
def test_a_removed_private_api_degrades_its_feature_and_says_so(name, intact):
    """No exception, a report, the feature degraded as the capability says, and the capability named in the
    report's notes and in `%tfmem status`."""
    assert name in {c.name for c in capabilities.CAPABILITIES}
    tf_keras = _REMOVED[name][2]
    if tf_keras and intact[True] is None:
        pytest.skip("tf_keras is not installed")
    out, whole = _run_without(name), intact[tf_keras]
    assert out["missing"] == [name], out["missing"]  # that one only: the simulation broke nothing else
    assert out["status"] == "ok" and out["model"] == "caps", out
    assert f"{name} is unavailable" in out["notes"], out["notes"]
    assert f"Capability   {name}: unavailable on TensorFlow" in out["status_text"], out["status_text"]
    degraded = {
        "per-op trace": lambda: out["mode"] == "quick" and out["events"] == 0 and out["xspaces"] == 0,
        # the public Trace makes the same annotations: the layer breakdown is still there
        "layer and phase spans": lambda: out["span_class"] and out["mode"] == "trace" and "attn" in out["layers"],
        # our own decoder still reads the trace; what only TensorFlow's reader could read would be skipped
        "trace reader fallback": lambda: out["events"] > 0 and out["unreadable"] > 0,
        "TensorFlow started?": lambda: not out["running"] and not out["tf_figures"] and out["events"] > 0,
        "steps of a tf.data pipeline": lambda: out["dataset_batch"] is None,
        "Keras model walk": lambda: "core" not in out["walk"] and "Core" not in out["own"],
        "attention's internal shapes": lambda: out["attn_bytes"] == 6 * 16 * 4,  # the output only
        "custom loop's optimizer": lambda: out["loop_optimizer"] == "Adam",  # the compiled one, not the loop's SGD
        "custom metrics in calibration": lambda: "Hits" not in out["own"] and "Core" in out["own"],
        "tf_keras model walk": lambda: "core" not in out["walk"] and "Core" not in out["own"],
        "tf_keras attention's internal shapes": lambda: out["attn_bytes"] == 6 * 16 * 4,
        "tf_keras custom metrics in calibration": lambda: "Hits" not in out["own"] and "Core" in out["own"],
    }[name]
    assert degraded(), {k: (out[k], whole.get(k)) for k in out if k not in ("notes", "status_text")}
    # what the removal does not touch stays as it was
    if name not in ("per-op trace", "TensorFlow started?"):
        assert out["mode"] == "trace" and out["events"] > 0
