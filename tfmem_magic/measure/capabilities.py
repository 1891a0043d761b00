"""The private TensorFlow and Keras APIs tfmem relies on, checked once, so that a TensorFlow or Keras release that
moves one degrades the feature it serves with a note (in every report and in `%tfmem status`), never with an
exception and never with a silently wrong number.

Each check only imports modules and reads attributes: it runs no op (TensorFlow's allocator must still be chosen
by the user's first op). The results are cached per process once TensorFlow is imported.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

from tfmem_magic.measure import kerases


@dataclass(frozen=True)
class Capability:
    name: str  # what a user would call the feature
    api: str  # the private API it needs
    degraded: str  # what happens without it
    probe: Callable[[], bool]


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


def _keras_attr(*path: str) -> Callable[[], bool]:
    def probe() -> bool:
        keras = sys.modules.get("keras")
        return True if keras is None else _has_path(keras, path)  # judged once Keras is imported

    return probe


def _stores(function: Any, attribute: str) -> bool:
    """The function's code assigns `self.<attribute>` (read from its bytecode's names: nothing is called, no op
    runs); for attributes that exist only on instances."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and attribute in code.co_names


def _dataset_batch_size() -> bool:
    from tensorflow.python.data.ops import batch_op

    return _stores(batch_op._BatchDataset.__init__, "_batch_size") and \
        _stores(batch_op._ParallelBatchDataset.__init__, "_batch_size")


def _build_shapes() -> bool:
    keras = sys.modules.get("keras")
    if keras is None:
        return True  # judged once Keras is imported
    from keras.src.layers import layer

    return any(_stores(f, "_build_shapes_dict") for f in vars(layer).values() if inspect.isfunction(f)) or \
        any(_stores(f, "_build_shapes_dict") for f in vars(layer.Layer).values() if inspect.isfunction(f))


def _context_handle() -> bool:
    from tensorflow.python.eager import context

    return hasattr(context.context(), "_context_handle")  # the Python object only: no op runs


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


CAPABILITIES = (
    _tf("per-op trace", "tensorflow.python.profiler.internal._pywrap_profiler.ProfilerSession",
        "cells are measured in quick mode: allocator statistics and RSS, no breakdown or timeline"),
    _tf("your own profiler session", "tensorflow.python.profiler.profiler_v2._profiler",
        "a tf.profiler session you started is not detected before ours starts (TensorFlow refuses the second one, "
        "and the cell falls back to quick mode with a note)"),
    _tf("layer and phase spans", "tensorflow.python.profiler.trace.Trace",
        "the public tf.profiler.experimental.Trace is used instead (the same TraceMe annotations)"),
    _tf("retracing count", "tensorflow.python.eager.polymorphic_function.tracing_compilation._create_concrete_function",
        "tf.function retraces are not counted: the retracing finding is off"),
    _tf("trace reader fallback", "tensorflow.tsl.profiler.protobuf.xplane_pb2.XPlane",
        "traces our own decoder cannot read are skipped (the decoder reads TF 2.21's format without it)"),
    Capability("TensorFlow started?", "tensorflow.python.eager.context.context()._context_handle",
               "whether TensorFlow has run its first op is read as 'not yet': allocator figures may be missing",
               _context_handle),
    Capability("Keras model walk", "keras.Layer._flatten_layers",
               "nested layers are not listed: model info counts top-level layers only, and calibration clones "
               "only what it can rebuild",
               _keras_attr("Layer", "_flatten_layers")),
    Capability("batch of a tf.data pipeline", "tensorflow.python.data.ops.batch_op._BatchDataset._batch_size",
               "a pipeline whose element_spec leaves the batch open (a final partial batch kept) gives no batch "
               "size: the what-if and the batch fixes need one from elsewhere (fit's batch_size, a generator's "
               "first batch)",
               _dataset_batch_size),
    Capability("attention's internal shapes", "keras.Layer._build_shapes_dict",
               "the scores and projections inside MultiHeadAttention are not counted in the model's per-sample "
               "activations: the analytic what-if of a Transformer reads low (the trace still measures them)",
               _build_shapes),
)

_results: dict[str, bool] | None = None


def check() -> dict[str, bool]:
    """{capability name: available}, probed once TensorFlow is imported (before that, all count as available)."""
    global _results
    if _results is not None:
        return _results
    if "tensorflow" not in sys.modules:
        return {c.name: True for c in CAPABILITIES}
    results = {}
    for cap in CAPABILITIES:
        try:
            results[cap.name] = bool(cap.probe())
        except Exception:  # a probe that breaks is a capability we cannot rely on
            results[cap.name] = False
    if "keras" in sys.modules:  # Keras' answers are final only once it is imported
        _results = results
    return results


def forget() -> None:
    """Probe again at the next check (tests; a Keras imported after the first check is picked up by itself)."""
    global _results
    _results = None


def missing() -> list[Capability]:
    found = check()
    return [c for c in CAPABILITIES if not found.get(c.name, True)]


def versions_text() -> str:
    tf = sys.modules.get("tensorflow")
    package = kerases.in_use()
    version = kerases.version(package)
    return (f"TensorFlow {getattr(tf, '__version__', '?')}" +
            (f", {'tf_keras' if package == kerases.TF_KERAS else 'Keras'} {version}" if version else ""))


def notes() -> list[str]:
    """One sentence per missing capability, for the report."""
    return [f"On {versions_text()}, {c.name} is unavailable ({c.api} is missing): {c.degraded}." for c in missing()]
