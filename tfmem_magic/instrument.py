"""Keras instrumentation for the duration of one profiled cell, removed afterwards.

What it does, and why:
- records every model that trains, evaluates, predicts or is called (names for attribution, model details);
- in trace mode, wraps `Layer.__call__`, `Layer.add_weight`, optimizer `build`/`apply` and `GradientTape.gradient`
  in profiler spans, because eager code records only op types (graph code carries full node paths anyway);
- injects a callback into `fit`/`evaluate`/`predict` that pauses the trace after the first steps of each call,
  so a long training cell stays cheap to trace.
Patches go on the classes and are undone in `uninstall()`, whatever the cell did.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .tracer import Tracer

_MISSING = object()
_seen_models: weakref.WeakSet = weakref.WeakSet()  # every Keras model a profiled cell has used, this session
_WATCHED_CALLS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


@dataclass
class ModelUse:
    model_ref: Any  # weakref to the keras.Model
    calls: list[str] = field(default_factory=list)
    batch_size: int | None = None
    input_shape: tuple | None = None
    input_arrays: list[tuple[int, int]] = field(default_factory=list)  # (id, nbytes) of numpy arrays passed in
    samples: int | None = None  # rows in the arrays handed to fit/evaluate/predict
    target: tuple[tuple, str] | None = None  # per-sample shape and dtype of the targets handed to fit (probes)


class IdentitySet:
    """Weakly held objects compared by identity (Keras variables overload == and hash by value)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, obj: Any) -> None:
        try:
            self._refs[id(obj)] = weakref.ref(obj)
        except TypeError:  # not weak-referenceable: then it counts as made before the cell
            pass

    def __contains__(self, obj: Any) -> bool:
        ref = self._refs.get(id(obj))
        return ref is not None and ref() is obj


class Instrumentation:
    def __init__(self, tracer: Tracer | None, trace_steps: int = 10, spans: bool = True, guard: Any = None) -> None:
        self.tracer = tracer
        self.guard = guard
        self.trace_steps = trace_steps
        self.spans = spans and tracer is not None
        self.models: dict[int, ModelUse] = {}
        self.layer_names: set[str] = set()
        self.optimizer_names: set[str] = set()
        self._patches: list[tuple[Any, str, Any]] = []
        self.installed = False
        self.traces: dict[str, int] = {}  # tf.function name -> new graphs traced during the cell
        self.new_models = 0  # Keras models this session had not seen before the cell
        self.input_nbytes: set[int] = set()
        # variables and optimizers created during the cell: their memory is part of the cell's peak
        self.new_variables = IdentitySet()
        self.built_optimizers = IdentitySet()

    # ---- install / uninstall -------------------------------------------------------------------------------------
    def install(self) -> bool:
        """Patch Keras if it is imported; False when there is nothing to instrument."""
        self._count_traces()
        keras = sys.modules.get("keras")
        if keras is None or not hasattr(keras, "Model"):
            return False
        for name in _WATCHED_CALLS:
            if hasattr(keras.Model, name):
                self._patch(keras.Model, name, self._wrap_model_call(name, getattr(keras.Model, name)))
        self.installed = True
        layer = keras.layers.Layer
        self._patch(layer, "__call__", self._wrap_layer_call(layer.__call__, keras.Model))
        opt = keras.optimizers.Optimizer
        add_weight, build = layer.add_weight, opt.build
        if self.spans:
            add_weight = self._wrap_span(add_weight, lambda s, *a, **k: f"weights/{s.name}")
            build = self._wrap_span(build, lambda s, *a, **k: "weights/optimizer")
            self._patch(opt, "apply", self._wrap_span(opt.apply, lambda s, *a, **k: "phase/optimizer"))
        self._patch(layer, "add_weight", self._remember_new(add_weight, result=True))
        self._patch(opt, "build", self._remember_new(build, result=False))
        if self.spans:
            import tensorflow as tf

            tape = tf.GradientTape
            self._patch(tape, "gradient", self._wrap_span(tape.gradient, lambda s, *a, **k: "phase/backward"))
        return True

    def _count_traces(self) -> None:
        """Count new tf.function graphs: TF calls _create_concrete_function on every trace (cache miss)."""
        module = sys.modules.get("tensorflow.python.eager.polymorphic_function.tracing_compilation")
        original = getattr(module, "_create_concrete_function", None)
        if original is None:
            return
        traces = self.traces

        @functools.wraps(original)
        def counting(function_type, type_context, func_graph, tracing_options, *args, **kwargs):
            name = str(getattr(tracing_options, "name", "function"))
            traces[name] = traces.get(name, 0) + 1
            return original(function_type, type_context, func_graph, tracing_options, *args, **kwargs)

        self._patch(module, "_create_concrete_function", counting)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patches):
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)
        self._patches.clear()

    def _patch(self, owner: Any, name: str, replacement: Callable) -> None:
        self._patches.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, replacement)

    # ---- wrappers ---------------------------------------------------------------------------------------------
    def _wrap_layer_call(self, original: Callable, model_cls: type) -> Callable:
        """Records models called directly (custom loops) and, in trace mode, spans each layer call."""
        instrumentation = self
        trace_cls = _trace_class() if self.spans else None

        @functools.wraps(original)
        def wrapper(this, *args, **kwargs):
            if isinstance(this, model_cls):
                instrumentation._record(this, "__call__", args, kwargs)
            if trace_cls is None:
                return original(this, *args, **kwargs)
            with trace_cls("tfmem:layer/" + this.name):
                return original(this, *args, **kwargs)

        return wrapper

    def _remember_new(self, original: Callable, result: bool) -> Callable:
        """Record what the call creates: the variable add_weight returns, or the optimizer that builds."""
        into = self.new_variables if result else self.built_optimizers

        @functools.wraps(original)
        def wrapper(this, *args, **kwargs):
            out = original(this, *args, **kwargs)
            into.add(out if result else this)
            return out

        return wrapper

    def _wrap_span(self, original: Callable, name_of: Callable[..., str]) -> Callable:
        trace_cls = _trace_class()

        @functools.wraps(original)
        def wrapper(this, *args, **kwargs):
            with trace_cls("tfmem:" + name_of(this, *args, **kwargs)):
                return original(this, *args, **kwargs)

        return wrapper

    def _wrap_model_call(self, call: str, original: Callable) -> Callable:
        instrumentation = self

        @functools.wraps(original)
        def wrapper(model, *args, **kwargs):
            instrumentation._record(model, call, args, kwargs)
            if call in ("fit", "evaluate", "predict"):
                kwargs = instrumentation._with_callbacks(call, args, kwargs)
            return original(model, *args, **kwargs)

        return wrapper

    def _with_callbacks(self, call: str, args: tuple, kwargs: dict) -> dict:
        """Append our callbacks (after the user's): the trace window, and the guard's batch-end check."""
        if len(args) > 5 or (self.tracer is None and self.guard is None):
            return kwargs  # callbacks passed positionally (fit's 6th parameter): leave the call alone
        callbacks = list(kwargs.get("callbacks") or [])
        if self.tracer is not None:
            callbacks.append(_TraceWindow(self.tracer, self.trace_steps))
        if self.guard is not None:
            callbacks.append(_GuardCheck(self.guard, call))
        return {**kwargs, "callbacks": callbacks}

    def _record(self, model: Any, call: str, args: tuple, kwargs: dict) -> None:
        use = self.models.get(id(model))
        if use is None or use.model_ref() is not model:
            use = self.models[id(model)] = ModelUse(weakref.ref(model))
            self._learn_names(model)
            if model not in _seen_models:
                _seen_models.add(model)
                self.new_models += 1
        if call not in use.calls:
            use.calls.append(call)
        if call == "__call__" and len(use.calls) > 1:
            return  # fit/predict call the model symbolically: their own record is the one that counts
        x = args[0] if args else kwargs.get("x")
        batch = kwargs.get("batch_size", args[2] if len(args) > 2 and call in ("fit", "evaluate", "predict") else None)
        shape = getattr(x, "shape", None)
        if shape is not None:
            try:
                use.input_shape = tuple(int(d) if d is not None else None for d in shape)
            except TypeError:  # an unknown rank
                use.input_shape = None
            if use.input_shape and use.input_shape[0] is not None and call != "__call__":
                use.samples = use.input_shape[0]
            if call.endswith("_on_batch") or call == "__call__":
                batch = use.input_shape[0] if use.input_shape else None
        else:
            batch = batch or _dataset_batch_size(x)
        if batch is None and shape is not None and call in ("fit", "evaluate", "predict"):
            batch = 32  # Keras' default for arrays
        if batch is not None and use.samples is not None and call in ("fit", "evaluate", "predict"):
            batch = min(int(batch), use.samples)  # fewer rows than the batch size: one smaller batch
        if batch is not None:
            use.batch_size = int(batch)
        y = args[1] if len(args) > 1 else kwargs.get("y")
        if call in ("fit", "train_on_batch") and getattr(y, "shape", None) is not None and hasattr(y, "dtype"):
            try:
                use.target = (tuple(int(d) for d in y.shape[1:]), str(getattr(y.dtype, "name", y.dtype)))
            except (TypeError, ValueError):
                use.target = None
        for candidate in (x, y):
            nbytes = getattr(candidate, "nbytes", None)
            if nbytes and type(candidate).__module__ == "numpy" and call != "__call__":
                self.input_nbytes.add(int(nbytes))
                if (id(candidate), int(nbytes)) not in use.input_arrays:
                    use.input_arrays.append((id(candidate), int(nbytes)))

    def _learn_names(self, model: Any) -> None:
        try:
            for layer in model._flatten_layers(include_self=True, recursive=True):
                self.layer_names.add(layer.name)
        except Exception:  # a model mid-construction; names come from spans then
            self.layer_names.add(model.name)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "name", None):
            self.optimizer_names.add(str(optimizer.name).lower())


def _trace_class() -> type:
    from tensorflow.python.profiler.trace import Trace

    return Trace


def _dataset_batch_size(x: Any) -> int | None:
    """The batch size of a batched tf.data.Dataset, when it is a constant."""
    size = getattr(x, "_batch_size", None)
    if size is None:
        return None
    try:
        return int(size.numpy()) if hasattr(size, "numpy") else int(size)
    except (TypeError, ValueError):
        return None


def _make_trace_window_class() -> type:
    import keras

    class TraceWindow(keras.callbacks.Callback):
        """Keeps the trace on for the first `steps` batches of each fit/evaluate/predict call, then pauses it."""

        def __init__(self, tracer: Tracer, steps: int) -> None:
            super().__init__()
            self.tracer, self.steps, self.seen, self.in_fit = tracer, steps, 0, False

        def on_train_begin(self, logs=None) -> None:
            self.in_fit, self.seen = True, 0
            self.tracer.release("steps")

        def on_test_begin(self, logs=None) -> None:
            if not self.in_fit:  # validation inside fit belongs to fit's window
                self.seen = 0
                self.tracer.release("steps")

        on_predict_begin = on_test_begin

        def _batch_end(self, batch, logs=None) -> None:
            self.seen += 1
            if self.seen == self.steps:
                self.tracer.hold("steps", f"traced the first {self.steps} steps of each fit/evaluate/predict call")

        on_train_batch_end = on_test_batch_end = on_predict_batch_end = _batch_end

        def on_train_end(self, logs=None) -> None:
            self.in_fit = False
            self.tracer.release("steps")  # code after the call (in the same cell) is traced again

        def on_test_end(self, logs=None) -> None:
            if not self.in_fit:
                self.tracer.release("steps")

        on_predict_end = on_test_end

    return TraceWindow


_trace_window_class: type | None = None
_guard_check_class: type | None = None


def _GuardCheck(guard: Any, call: str) -> Any:
    """A callback that checks the process memory against the guard's limit after every batch."""
    global _guard_check_class
    if _guard_check_class is None:
        import keras

        class GuardCheck(keras.callbacks.Callback):
            def __init__(self, guard: Any, call: str) -> None:
                super().__init__()
                self.guard, self.call = guard, call

            def _check(self, batch, logs=None) -> None:
                self.guard.check(f"after batch {batch + 1} of {self.call}()")

            on_train_batch_end = on_test_batch_end = on_predict_batch_end = _check

        _guard_check_class = GuardCheck
    return _guard_check_class(guard, call)


def _TraceWindow(tracer: Tracer, steps: int) -> Any:
    global _trace_window_class
    if _trace_window_class is None:
        _trace_window_class = _make_trace_window_class()
    return _trace_window_class(tracer, steps)
