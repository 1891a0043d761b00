"""The private TensorFlow and Keras APIs tfmem relies on, checked once, so that a TensorFlow or Keras release that
moves one degrades the feature it serves with a note (in every report and in `%tfmem status`), never with an
exception and never with a silently wrong number.

Each check only imports modules and reads attributes (or the names a class's code uses): it runs no op
(TensorFlow's allocator must still be chosen by the user's first op), and it never imports TensorFlow or a Keras by
itself. A capability is judged once what it needs is imported (TensorFlow, Keras 3 or tf_keras): at
`%load_ext tfmem_magic` for what is imported by then, else at the first report or `%tfmem status` after. Each
answer is kept for the life of the process: later cells read it, they do not probe again.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.measure import kerases

_log = logging.getLogger(__name__)

TENSORFLOW = "tensorflow"


@dataclass(frozen=True)
class Capability:
    name: str  # what a user would call the feature
    api: str  # the private API it needs
    degraded: str  # what happens without it
    probe: Callable[[], bool]
    needs: str = TENSORFLOW  # judged once this is imported: TENSORFLOW, kerases.KERAS3 or kerases.TF_KERAS


def _has_path(obj: object, path: tuple[str, ...]) -> bool:
    for name in path:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def _attr(module: str, *path: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            return _has_path(importlib.import_module(module), path)
        except ImportError:
            return False

    return probe


def _keras_attr(flavour: str, *path: str) -> Callable[[], bool]:
    """`path` on that Keras (KERAS3 or TF_KERAS), judged once it is imported (see Capability.needs)."""

    def probe() -> bool:
        keras = kerases.module(flavour)
        return keras is not None and _has_path(keras, path)

    return probe


def _code_names(code: types.CodeType) -> Iterator[str]:
    """The names a code object and the functions defined inside it use (`self.x = ...` puts `x` there)."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _stores(function: Callable[..., object], attribute: str) -> bool:
    """The function's code uses `self.<attribute>` (read from its bytecode's names: nothing is called, no op
    runs); for attributes that exist only on instances."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and attribute in set(_code_names(code))


def _class_uses(cls: type, *attributes: str, root: str | None = None) -> bool:
    """Every attribute is used by the code of a function of `cls` or a class it derives from (only classes of the
    package `root`, when given: a TensorFlow base class's own `_trainable_variables` is not Keras')."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", ()):
        if root is not None and (getattr(klass, "__module__", "") or "").split(".")[0] != root:
            continue
        for value in vars(klass).values():
            for function in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
                try:
                    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
                except ValueError:  # a wrapper chain that loops: not code we can read
                    code = None
                if isinstance(code, types.CodeType):
                    names.update(_code_names(code))
    return all(a in names for a in attributes)


def _dataset_batch_size() -> bool:
    from tensorflow.python.data.ops import batch_op

    return _stores(batch_op._BatchDataset.__init__, "_batch_size") and _stores(
        batch_op._ParallelBatchDataset.__init__, "_batch_size"
    )


def _dataset_input() -> bool:
    from tensorflow.python.data.ops import dataset_ops

    return _stores(dataset_ops.UnaryDataset.__init__, "_input_dataset")


def _context_handle() -> bool:
    from tensorflow.python.eager import context

    return hasattr(context.context(), "_context_handle")  # the Python object only: no op runs


def _lines_of_code() -> bool:
    """The stacks TensorFlow keeps of a function's ops, and its nodes (analyze/lines.py)."""
    from tensorflow.python.eager import context

    return hasattr(context.Context, "get_graph_debug_info") and hasattr(context.Context, "get_function_def")


def _eager_op_lines() -> bool:
    """Op callbacks, and what the callback reads of an eager op's outputs (measure/eager_ops.py)."""
    from tensorflow.python.framework import op_callbacks, ops

    return all(hasattr(op_callbacks, n) for n in ("add_op_callback", "remove_op_callback")) and all(
        hasattr(ops.EagerTensor, n) for n in ("_shape_tuple", "_datatype_enum")
    )


def _keras_build_shapes() -> bool:
    keras = kerases.module(kerases.KERAS3)
    return keras is not None and _class_uses(keras.Layer, "_build_shapes_dict", root=kerases.KERAS3)


def _keras_optimizer_variables() -> bool:
    keras = kerases.module(kerases.KERAS3)
    return keras is not None and _class_uses(keras.optimizers.Optimizer, "_trainable_variables", root=kerases.KERAS3)


def _keras_compiled_metrics() -> bool:
    keras = kerases.module(kerases.KERAS3)
    if keras is None or not _class_uses(keras.Model, "_compile_metrics", root=kerases.KERAS3):
        return False
    from keras.src.trainers import compile_utils

    return _class_uses(compile_utils.CompileMetrics, "_user_metrics", root=kerases.KERAS3)


def _tf_keras_attention_shapes() -> bool:
    keras = kerases.module(kerases.TF_KERAS)
    return keras is not None and _class_uses(
        keras.layers.MultiHeadAttention, "_query_shape", "_key_shape", "_value_shape", root=kerases.TF_KERAS
    )


def _tf_keras_compiled_metrics() -> bool:
    keras = kerases.module(kerases.TF_KERAS)
    if keras is None or not _class_uses(keras.Model, "compiled_metrics", root=kerases.TF_KERAS):
        return False
    from tf_keras.src.engine import compile_utils

    return _class_uses(compile_utils.MetricsContainer, "_user_metrics", root=kerases.TF_KERAS)


def _tf(name: str, api: str, degraded: str) -> Capability:
    """A capability whose API is `module.attribute[.attribute]` (the module is the longest importable prefix)."""
    module, path = _split(api)
    return Capability(name, api, degraded, _attr(module, *path))


def _split(api: str) -> tuple[str, tuple[str, ...]]:
    """'a.b.c.Attr.sub' -> ('a.b.c', ('Attr', 'sub')): the module is the prefix up to the first private or
    capitalised name (our APIs are a module's private function, class, or attribute)."""
    parts = api.split(".")
    for i, part in enumerate(parts):
        if part[:1].isupper() or (part.startswith("_") and i == len(parts) - 1):
            return ".".join(parts[:i]), tuple(parts[i:])
    return ".".join(parts[:-1]), (parts[-1],)


_WALK = (
    "nested layers are found through the public `.layers` of nested models only: a layer that a custom layer "
    "keeps inside itself is not known by name (the trace books its memory to the enclosing layer), and "
    "calibration does not send its class to the probe process"
)
_ATTENTION = (
    "the scores and projections inside MultiHeadAttention are not counted in the model's per-sample "
    "activations: the analytic what-if of a Transformer reads low (the trace still measures them)"
)
_METRICS = (
    "a metric class defined in the notebook is not sent to calibration's probe process: calibrating a "
    "model compiled with one fails with a note (the analytic what-if is unaffected)"
)

CAPABILITIES = (
    _tf(
        "per-op trace",
        "tensorflow.python.profiler.internal._pywrap_profiler.ProfilerSession",
        "cells are measured in quick mode: allocator statistics and RSS, no breakdown or timeline",
    ),
    _tf(
        "your own profiler session",
        "tensorflow.python.profiler.profiler_v2._profiler",
        "a tf.profiler session you started is not detected before ours starts (TensorFlow refuses the second one, "
        "and the cell falls back to quick mode with a note)",
    ),
    _tf(
        "layer and phase spans",
        "tensorflow.python.profiler.trace.Trace",
        "the public tf.profiler.experimental.Trace is used instead (the same TraceMe annotations)",
    ),
    _tf(
        "retracing count",
        "tensorflow.python.eager.polymorphic_function.tracing_compilation._create_concrete_function",
        "tf.function retraces are not counted: the retracing finding is off",
    ),
    Capability(
        "lines of code",
        "tensorflow.python.eager.context.Context.get_graph_debug_info/get_function_def",
        "the report's 'by line' view is left empty: what was live at the peak is grouped by layer, op and phase only",
        _lines_of_code,
    ),
    Capability(
        "lines of eager ops",
        "tensorflow.python.framework.op_callbacks.add_op_callback, EagerTensor._shape_tuple/_datatype_enum",
        "eager ops at the peak are grouped as eager ops, not named by the line that ran them",
        _eager_op_lines,
    ),
    _tf(
        "trace reader fallback",
        "tensorflow.tsl.profiler.protobuf.xplane_pb2.XPlane",
        "traces our own decoder cannot read are skipped (the decoder reads TF 2.21's format without it)",
    ),
    Capability(
        "gradient registry",
        "tensorflow.python.framework.ops._gradient_registry._registry",
        "%tfmem free and tfmem_magic.free() cannot drop the traced gradients that pin a fitted model's "
        "weights and slots: that memory stays held until the kernel restarts",
        _attr("tensorflow.python.framework.ops", "_gradient_registry", "_registry"),
    ),
    Capability(
        "TensorFlow started?",
        "tensorflow.python.eager.context.context()._context_handle",
        "whether TensorFlow has run its first op is read as 'not yet': allocator figures may be missing",
        _context_handle,
    ),
    Capability(
        "batch of a tf.data pipeline",
        "tensorflow.python.data.ops.batch_op._BatchDataset._batch_size",
        "a pipeline whose element_spec leaves the batch open (a final partial batch kept) gives no batch "
        "size: the what-if and the batch fixes need one from elsewhere (fit's batch_size, a generator's "
        "first batch)",
        _dataset_batch_size,
    ),
    Capability(
        "steps of a tf.data pipeline",
        "tensorflow.python.data.ops.dataset_ops.UnaryDataset._input_dataset",
        "a .batch() followed by other steps (map, prefetch, ...) is not found when the element_spec leaves "
        "the batch open: such a pipeline gives no batch size, as above",
        _dataset_input,
    ),
    Capability(
        "Keras model walk",
        "keras.Layer._flatten_layers",
        _WALK,
        _keras_attr(kerases.KERAS3, "Layer", "_flatten_layers"),
        kerases.KERAS3,
    ),
    Capability(
        "attention's internal shapes", "keras.Layer._build_shapes_dict", _ATTENTION, _keras_build_shapes, kerases.KERAS3
    ),
    Capability(
        "custom loop's optimizer",
        "keras.optimizers.Optimizer._trainable_variables",
        "an `optimizer.apply(grads)` that leaves out the variables (Keras then updates those it was built "
        "with) is not tied to its model: the model is described without that optimizer and its slots "
        "(`apply(grads, variables)` and `apply_gradients` are unaffected)",
        _keras_optimizer_variables,
        kerases.KERAS3,
    ),
    Capability(
        "custom metrics in calibration",
        "keras.Model._compile_metrics._user_metrics",
        _METRICS,
        _keras_compiled_metrics,
        kerases.KERAS3,
    ),
    Capability(
        "tf_keras model walk",
        "tf_keras.layers.Layer._flatten_layers",
        _WALK,
        _keras_attr(kerases.TF_KERAS, "layers", "Layer", "_flatten_layers"),
        kerases.TF_KERAS,
    ),
    Capability(
        "tf_keras attention's internal shapes",
        "tf_keras.layers.MultiHeadAttention._query_shape/_key_shape/_value_shape",
        _ATTENTION,
        _tf_keras_attention_shapes,
        kerases.TF_KERAS,
    ),
    Capability(
        "tf_keras custom metrics in calibration",
        "tf_keras.Model.compiled_metrics._user_metrics",
        _METRICS,
        _tf_keras_compiled_metrics,
        kerases.TF_KERAS,
    ),
)

_results: dict[str, bool] = {}  # name -> available, for every capability judged so far (kept: see the docstring)


def _ready(needs: str) -> bool:
    """What the capability needs is imported (never imported here)."""
    if needs == TENSORFLOW:
        return sys.modules.get(TENSORFLOW) is not None
    return kerases.module(needs) is not None


def check() -> dict[str, bool]:
    """{capability name: available} for every capability judged so far. Those whose TensorFlow or Keras has been
    imported since the last call are probed now, once; the rest wait (see `pending`)."""
    for cap in CAPABILITIES:
        if cap.name in _results or not _ready(cap.needs):
            continue
        try:
            _results[cap.name] = bool(cap.probe())
        except Exception as exc:  # noqa: BLE001 - a probe that breaks is a capability we cannot rely on
            fallback(_log, "a capability's probe failed: the capability is off", exc)
            _results[cap.name] = False
    return dict(_results)


def forget() -> None:
    """Probe again at the next check (tests)."""
    _results.clear()


def missing() -> list[Capability]:
    found = check()
    return [c for c in CAPABILITIES if found.get(c.name) is False]


def judged() -> list[Capability]:
    found = check()
    return [c for c in CAPABILITIES if c.name in found]


def pending() -> list[Capability]:
    """Capabilities not judged yet: what they need (TensorFlow, Keras 3, tf_keras) is not imported."""
    found = check()
    return [c for c in CAPABILITIES if c.name not in found]


def summary() -> str:
    """One line for a test run's header: 'capabilities 15/15', the missing ones by name, and what was not
    checked."""
    absent, done, waiting = missing(), judged(), pending()
    text = f"capabilities {len(done) - len(absent)}/{len(done)}"
    if absent:
        text += " (missing: " + ", ".join(c.name for c in absent) + ")"
    if waiting:
        needs = sorted({c.needs for c in waiting})
        text += f"; {len(waiting)} not checked ({', '.join(needs)} not imported)"
    return text


def versions_text(needs: str | None = None) -> str:
    """'TensorFlow 2.21.0, Keras 3.15.1': TensorFlow and the Keras a capability needs (by default the Keras that
    `tf.keras` code gets)."""
    tf = sys.modules.get(TENSORFLOW)
    package = needs if needs in (kerases.KERAS3, kerases.TF_KERAS) else kerases.in_use()
    version = kerases.version(package)
    return f"TensorFlow {getattr(tf, '__version__', '?')}" + (
        f", {'tf_keras' if package == kerases.TF_KERAS else 'Keras'} {version}" if version else ""
    )


def unavailable_text(cap: Capability) -> str:
    """'unavailable on TensorFlow 2.16.2, Keras 3.3.3 (the.api is missing)'."""
    return f"unavailable on {versions_text(cap.needs)} ({cap.api} is missing)"


def notes() -> list[str]:
    """One sentence per missing capability, for the report."""
    return [
        f"On {versions_text(c.needs)}, {c.name} is unavailable ({c.api} is missing): {c.degraded}." for c in missing()
    ]
