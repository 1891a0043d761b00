"""Keras instrumentation for the duration of one profiled cell, removed afterwards.

What it does, and why:
- records every model that trains, evaluates, predicts or is called (names for attribution, model details);
- in trace mode, wraps `Layer.__call__`, `Layer.add_weight`, optimizer `build`/`apply` and `GradientTape.gradient`
  in profiler spans, because eager code records only op types (graph code carries full node paths anyway);
- injects a callback into `fit`/`evaluate`/`predict` that pauses the trace after the first steps of each call,
  so a long training cell stays cheap to trace;
- notes the line of the user's code that makes each layer (code_sites.py), for the report's by-line view.
Patches go on the classes and are undone in `uninstall()`, whatever the cell did.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, TypeAlias

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import CallRecord
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.types import KerasLayer, KerasModel, KerasOptimizer, NotebookValue, TFFunction, TFGraph
from tfmem_magic.measure import code_sites, feeding, kerases
from tfmem_magic.measure.feeding import InputArray
from tfmem_magic.measure.guard import Guard
from tfmem_magic.measure.interrupts import StopLatch
from tfmem_magic.measure.sampling import bytes_in_use, process_rss
from tfmem_magic.measure.tracer import Tracer

_log = logging.getLogger(__name__)

_MISSING = object()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tfmem_magic/
_BATCH_DIM = re.compile(r"shape=\((?:\d+|None)")  # a TensorSpec's first dimension in a signature's text
MAX_CALL_RECORDS = 200  # a loop of more calls than this is told by its first ones
_WATCHED_CALLS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


@dataclass
class ModelUse:
    model_ref: Any  # weakref to the keras.Model
    calls: list[str] = field(default_factory=list)
    batch_size: int | None = None
    batch_source: str | None = None
    input_shape: tuple[int | None, ...] | None = None
    input_arrays: list[InputArray] = field(default_factory=list)  # numpy arrays passed in (Keras copies them)
    samples: int | None = None  # rows in the arrays handed to fit/evaluate/predict (training rows only)
    structure: dict[str, Any] | None = None  # what one training batch holds (feeding.spec_of): calibration's batches
    feed: str = "none"  # what the call was fed: "arrays", "dataset", "generator", ...
    validation: str | None = None  # what fit validated on, in words
    dataset: Any = None  # the call's tf.data pipeline (only on a use made for one call: `_as_fed`)

    @property
    def training_arrays(self) -> list[InputArray]:
        return [a for a in self.input_arrays if not a.validation]


GENERATOR_BATCH = "the generator's first batch"
# the optimizers a cell saw apply gradients, each with the ids of the variables it updated (Instrumentation.applied)
AppliedOptimizers: TypeAlias = Sequence[tuple[weakref.ref[KerasOptimizer], set[int]]]


def _as_fed(use: ModelUse, call: str, feed: feeding.Feed) -> ModelUse:
    """The model's use as this one call was fed: what the pre-flight checks. The report keeps the cell's training
    call's description (its batch, rows and copies): checked against that, a `predict(x, batch_size=2048)` after a
    `fit` at batch 32 in one cell would be checked at batch 32 (docs/preflight.md)."""
    batch, source = feed.batch_size, feed.batch_source
    if batch is None and feed.kind == "generator" and use.batch_source == GENERATOR_BATCH:
        batch, source = use.batch_size, use.batch_source  # an earlier call's generator: this one batches alike
    return ModelUse(
        model_ref=use.model_ref,
        calls=[call],
        batch_size=batch,
        batch_source=source,
        input_shape=feed.input_shape or use.input_shape,
        input_arrays=list(feed.arrays),
        samples=feed.samples,
        structure=feed.structure or use.structure,
        feed=feed.kind,
        validation=feed.validation,
        dataset=feed.dataset,
    )


class IdentitySet:
    """Weakly held objects compared by identity (Keras variables overload == and hash by value)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[Any]] = {}

    def add(self, obj: object) -> None:
        try:
            self._refs[id(obj)] = weakref.ref(obj)
        except TypeError:  # not weak-referenceable: then it counts as made before the cell
            pass

    def __contains__(self, obj: object) -> bool:
        ref = self._refs.get(id(obj))
        return ref is not None and ref() is obj


class Instrumentation:
    def __init__(
        self,
        tracer: Tracer | None,
        trace_steps: int = 10,
        spans: bool = True,
        guard: Guard | None = None,
        stops: StopLatch | None = None,
        preflight: Callable[[KerasModel, str, ModelUse], None] | None = None,
        t0: float | None = None,
    ) -> None:
        self.tracer = tracer
        self.guard = guard
        self.stops = stops  # the cell's stop presses: a swallowed one is raised again at a batch end or a return
        # before each fit/evaluate/predict runs a step: may refuse the call (advise/preflight.py, given by the pipeline)
        self.preflight = preflight
        self.trace_steps = trace_steps
        self.spans = spans and tracer is not None
        self.models: dict[int, ModelUse] = {}
        self.layer_names: set[str] = set()
        self.optimizer_names: set[str] = set()
        self._patches: list[tuple[Any, str, Any, object]] = []  # (owner, name, original, replacement)
        self.installed = False
        # new graphs traced during the cell, per tf.function (its cache's identity): Keras' train and test steps
        # share one name, and tf.data makes a new function per pipeline, so names alone would count false retraces
        self.traces: dict[tuple[str, int], list[str]] = {}  # -> the input signature of each graph traced
        # the concrete functions traced during the cell, weakly: where the trace lost a function's run, the by-line
        # view looks for its ops in them, and reads an op's stack from its graph (analyze/lines.py)
        self.traced_functions: list[weakref.ref[TFFunction]] = []
        self._trace_owners: dict[int, Any] = {}  # the caches counted, held so their ids stay theirs (see install)
        self.new_models = 0  # Keras models this session had not seen before the cell
        self.copy_roles: dict[int, str] = {}  # requested bytes of a tensor copy of an input array -> its role
        self._calls = threading.local()  # the watched call running on this thread (Keras nests its own calls)
        self.notes: list[str] = []  # what the instrumentation could not do, for the report
        # optimizers applied in custom loops, their variables
        self.applied: list[tuple[weakref.ref[KerasOptimizer], set[int]]] = []
        # the optimizer update a custom loop called ("Adam.apply()"; once per trace in a tf.function), whose steps no
        # pre-flight checks; "" when none was seen
        self.custom_loop = ""
        # variables and optimizers created during the cell: their memory is part of the cell's peak
        self.new_variables = IdentitySet()
        self.built_optimizers = IdentitySet()
        self.t0 = time.perf_counter() if t0 is None else t0  # the cell's clock
        self.calls: list[CallRecord] = []  # the user's fit/evaluate/predict calls, with what each left behind

    # ---- install / uninstall -------------------------------------------------------------------------------------
    def install(self) -> bool:
        """Patch every Keras that is imported (Keras 3 and tf_keras); False when there is nothing to instrument."""
        self._count_traces()
        code_sites.hold(self)  # the line that makes each layer in the cell (a Keras imported in it included)
        flavours = kerases.loaded()
        if not flavours:
            return False
        self.installed = self.active = True
        for flavour, keras in flavours:
            self._install_keras(flavour, keras)
        if self.spans:
            import tensorflow as tf

            tape = tf.GradientTape
            self._patch(tape, "gradient", self._wrap_span(tape.gradient, lambda s, *a, **k: "phase/backward"))
        return True

    def _install_keras(self, flavour: str, keras: ModuleType) -> None:
        self._hide_from_keras_tracebacks(flavour)
        for name in _WATCHED_CALLS:
            if hasattr(keras.Model, name):
                self._patch(
                    keras.Model,
                    name,
                    self._wrap_model_call(name, getattr(keras.Model, name), _keras_own(keras.Model, name)),
                )
        layer = keras.layers.Layer
        self._patch(layer, "__call__", self._wrap_layer_call(layer.__call__, keras.Model))
        opt = keras.optimizers.Optimizer
        # Keras 3 updates with apply(grads, variables); tf_keras with apply_gradients(pairs of grad and variable)
        apply_name = "apply" if flavour == kerases.KERAS3 else "apply_gradients"
        add_weight, build = layer.add_weight, opt.build
        apply = self._remember_apply(getattr(opt, apply_name), pairs=apply_name == "apply_gradients")
        if self.spans:
            add_weight = self._wrap_span(add_weight, lambda s, *a, **k: f"weights/{s.name}")
            build = self._wrap_span(build, lambda s, *a, **k: "weights/optimizer")
            apply = self._wrap_span(apply, lambda s, *a, **k: "phase/optimizer")
        self._patch(opt, apply_name, apply)
        self._patch(layer, "add_weight", self._remember_new(add_weight, result=True))
        self._patch(opt, "build", self._remember_new(build, result=False))

    def _count_traces(self) -> None:
        """Count new tf.function graphs: TF calls _create_concrete_function on every trace (cache miss)."""
        module = sys.modules.get("tensorflow.python.eager.polymorphic_function.tracing_compilation")
        original = getattr(module, "_create_concrete_function", None)
        if original is None:
            return
        traces, owners, traced = self.traces, self._trace_owners, self.traced_functions

        @functools.wraps(original)
        def counting(
            function_type: TFFunction,
            type_context: TFFunction,
            func_graph: TFGraph,
            tracing_options: TFFunction,
            *args: object,
            **kwargs: object,
        ) -> TFFunction:
            __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
            name = str(getattr(tracing_options, "name", "function"))
            # a function is its cache (an empty cache is falsy: test for None). The cache is held until the cell
            # ends, so that its id() cannot pass to the next one (each tf.data `map` in a loop of `adapt()` calls
            # makes a new function whose cache often landed at the freed address: 3 "retraces" of one lambda).
            # Functions without a cache trace once by construction: never a retrace.
            owner = getattr(tracing_options, "function_cache", None)
            key = (name, id(owner) if owner is not None else -len(traces) - 1)
            if owner is not None:
                owners[id(owner)] = owner
            traces.setdefault(key, []).append(str(function_type))
            concrete = original(function_type, type_context, func_graph, tracing_options, *args, **kwargs)
            if len(traced) < 1000:
                try:
                    traced.append(weakref.ref(concrete))
                except TypeError:  # not weak-referenceable: the by-line view finds it by its run alone
                    pass
            return concrete

        self._patch(module, "_create_concrete_function", counting)

    def uninstall(self) -> None:
        """Put back what we replaced. A patch someone else made on top of ours during the cell (MLflow autolog,
        Weights & Biases) stays: it wraps ours, which then passes calls straight through (see `active`)."""
        for owner, name, original, replacement in reversed(self._patches):
            if owner.__dict__.get(name, _MISSING) is not replacement:
                continue  # replaced again during the cell: theirs now, leave it
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)
        self._patches.clear()
        self._trace_owners.clear()  # the counts stay; the functions' caches are theirs again
        code_sites.release(self)
        self.active = False

    def _hide_from_keras_tracebacks(self, flavour: str) -> None:
        """Keras cuts its own frames out of a traceback (`traceback_utils._EXCLUDED_PATHS`, private): ours are cut
        with them while the cell runs, or the innermost frame of an error inside a layer would be tfmem's wrapper
        (IPython always shows the last frame, even one marked `__tracebackhide__`)."""
        utils = sys.modules.get(f"{flavour}.src.utils.traceback_utils")
        paths = getattr(utils, "_EXCLUDED_PATHS", None)
        if isinstance(paths, tuple) and _PACKAGE_DIR not in paths:
            self._patch(utils, "_EXCLUDED_PATHS", (*paths, _PACKAGE_DIR))

    def _patch(self, owner: object, name: str, replacement: object) -> None:
        self._patches.append((owner, name, owner.__dict__.get(name, _MISSING), replacement))
        setattr(owner, name, replacement)

    def function_traces(self) -> dict[str, int]:
        """Per tf.function name, the most graphs one function of that name traced in the cell."""
        out: dict[str, int] = {}
        for (name, _), signatures in self.traces.items():
            out[name] = max(out.get(name, 0), len(signatures))
        return out

    def growing_signatures(self) -> dict[str, int]:
        """Per tf.function name, the input signatures that grow with the calls (the most of one function of that
        name): a graph traced twice for one signature (the first call of a function that creates variables traces
        it again once they exist) counts once, and signatures that differ only in their tensors' first dimension
        count as one while there are at most two of them (full batches, and a partial last batch)."""
        out: dict[str, int] = {}
        for (name, _), signatures in self.traces.items():
            families: dict[str, set[str]] = {}
            for signature in set(signatures):
                families.setdefault(_BATCH_DIM.sub("shape=(B", signature), set()).add(signature)
            count = sum(1 + max(0, len(members) - 2) for members in families.values())
            out[name] = max(out.get(name, 0), count)
        return out

    # ---- wrappers ---------------------------------------------------------------------------------------------
    def _outer_call(self) -> tuple[KerasModel, str] | None:
        """The watched call (model, name) running on this thread, if any."""
        return getattr(self._calls, "current", None)

    def _wrap_layer_call(self, original: Callable[..., Any], model_cls: type) -> Callable[..., Any]:
        """Records models called directly (custom loops) and, in trace mode, spans each layer call."""
        instrumentation = self
        trace_cls = _trace_class() if self.spans else None

        @functools.wraps(original)
        def wrapper(this: KerasLayer, *args: NotebookValue, **kwargs: NotebookValue) -> NotebookValue:
            __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
            if not instrumentation.active:
                return original(this, *args, **kwargs)
            if isinstance(this, model_cls) and instrumentation._outer_call() is None:
                instrumentation._record_direct_call(this, args, kwargs)
            if trace_cls is None:
                return original(this, *args, **kwargs)
            with trace_cls("tfmem:layer/" + this.name):
                return original(this, *args, **kwargs)

        return wrapper

    def _remember_new(self, original: Callable[..., Any], result: bool) -> Callable[..., Any]:
        """Record what the call creates: the variable add_weight returns, or the optimizer that builds."""
        into = self.new_variables if result else self.built_optimizers

        @functools.wraps(original)
        def wrapper(this: KerasLayer | KerasOptimizer, *args: NotebookValue, **kwargs: NotebookValue) -> NotebookValue:
            __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
            out = original(this, *args, **kwargs)
            into.add(out if result else this)
            return out

        return wrapper

    def _remember_apply(self, original: Callable[..., Any], pairs: bool = False) -> Callable[..., Any]:
        """Record which variables an optimizer updates: in a custom loop, and in a custom `train_step` of fit's (a
        GAN's two optimizers; traced once, so recorded once). The model they belong to trains with them.
        `pairs`: tf_keras' apply_gradients, which takes (gradient, variable) pairs (often a one-shot `zip`)."""
        instrumentation = self

        @functools.wraps(original)
        def wrapper(this: KerasOptimizer, *args: NotebookValue, **kwargs: NotebookValue) -> NotebookValue:
            __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
            if not instrumentation.active:
                return original(this, *args, **kwargs)
            custom_loop = instrumentation._outer_call() is None  # else a train_step of fit's (traced once)
            update = f"{type(this).__name__}.{original.__name__}()"
            if custom_loop:
                instrumentation.custom_loop = update
            if custom_loop and instrumentation.tracer is not None:
                instrumentation.tracer.step_boundary()  # a custom loop's step ends with its update
            if pairs:
                args, kwargs, variables = _pairs_variables(args, kwargs)
            else:
                given = args[1] if len(args) > 1 else kwargs.get("trainable_variables")
                # Keras 3 updates the variables it was built with (private: see capabilities.py)
                variables = given if given is not None else getattr(this, "_trainable_variables", None) or []
            try:
                ids = {id(v) for v in variables}
                if not any(ref() is this and ids <= seen for ref, seen in instrumentation.applied):
                    instrumentation.applied.append((weakref.ref(this), ids))
            except TypeError:
                pass
            result = original(this, *args, **kwargs)
            if custom_loop and instrumentation.stops is not None:  # a custom loop's step ends here
                instrumentation.stops.check(f"after {update} of a custom training step")
            return result

        return wrapper

    def _wrap_span(self, original: Callable[..., Any], name_of: Callable[..., str]) -> Callable[..., Any]:
        trace_cls = _trace_class()
        instrumentation = self

        @functools.wraps(original)
        def wrapper(this: NotebookValue, *args: NotebookValue, **kwargs: NotebookValue) -> NotebookValue:
            __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
            if not instrumentation.active:
                return original(this, *args, **kwargs)
            with trace_cls("tfmem:" + name_of(this, *args, **kwargs)):
                return original(this, *args, **kwargs)

        return wrapper

    def _wrap_model_call(
        self, call: str, original: Callable[..., Any], reference: Callable[..., Any] | None = None
    ) -> Callable[..., Any]:
        """The user's fit/evaluate/predict: recorded, and given our callbacks. Calls Keras makes inside one (fit's
        validation `evaluate`, a callback's `predict`, a nested fit) pass through untouched: they belong to the
        outer call, and Keras hands them its own CallbackList."""
        instrumentation = self
        # arguments are read by Keras' own parameter names, even when another library's (*args, **kwargs) wrapper
        # sits between us and Keras
        signature_of = reference or original

        @functools.wraps(original)
        def wrapper(model: KerasModel, *args: NotebookValue, **kwargs: NotebookValue) -> NotebookValue:
            __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
            if not instrumentation.active or instrumentation._outer_call() is not None:
                return original(model, *args, **kwargs)  # uninstalled, or nested in a watched call
            instrumentation._calls.current = (model, call)
            stops = instrumentation.stops
            token = stops.enter_call() if stops is not None else 0
            try:
                args, kwargs, feed = instrumentation._record_call(model, call, signature_of, args, kwargs)
                if instrumentation.preflight is not None:  # may refuse the call before its first step
                    instrumentation.preflight(model, call, _as_fed(instrumentation._use(model), call, feed))
                if call in ("fit", "evaluate", "predict"):
                    args, kwargs = instrumentation._with_callbacks(
                        call, signature_of, args, kwargs, kerases.flavour_of(model)
                    )
                record = instrumentation._call_started(model, call)
                result = original(model, *args, **kwargs)
                instrumentation._call_ended(record, result)
                if stops is not None:  # a press that Keras swallowed in its last batch or after the loop
                    stops.check(f"when {call}() returned")
                return result
            except KeyboardInterrupt as exc:
                if stops is not None:
                    stops.seen(exc)
                raise
            finally:
                instrumentation._calls.current = None
                if stops is not None:
                    stops.exit_call(token)

        return wrapper

    def _call_started(self, model: KerasModel, call: str) -> CallRecord | None:
        """A record of the call with what TensorFlow and the process held at its start (fit/evaluate/predict only:
        the per-call growth a loop of them leaves is what the leak rules read)."""
        if call not in ("fit", "evaluate", "predict") or len(self.calls) >= MAX_CALL_RECORDS:
            return None
        try:  # a failure here costs tfmem the record, never the user's call
            record = CallRecord(
                call,
                str(getattr(model, "name", "") or "") or None,
                round(time.perf_counter() - self.t0, 6),
                tf_before_bytes=bytes_in_use(),
                rss_before_bytes=process_rss(),
            )
        except Exception as exc:  # noqa: BLE001 - a failure here costs tfmem the record, never the user's call
            fallback(_log, "a Keras call could not be recorded", exc)
            return None
        self.calls.append(record)
        return record

    def _call_ended(self, record: CallRecord | None, result: NotebookValue) -> None:
        if record is None:
            return
        try:
            record.end_s = round(time.perf_counter() - self.t0, 6)
            record.tf_after_bytes, record.rss_after_bytes = bytes_in_use(), process_rss()
            outputs = (
                result
                if isinstance(result, (list, tuple))
                else list(result.values())
                if isinstance(result, dict)
                else [result]
            )
            record.output_bytes = sum(int(getattr(o, "nbytes", 0) or 0) for o in outputs[:64])
        except Exception as exc:  # noqa: BLE001 - the record is ours; the user's call has returned already
            fallback(_log, "a Keras call's end could not be recorded", exc)
            pass

    def _with_callbacks(
        self, call: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], flavour: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Append our callbacks (after the user's): the trace window, and the guard's batch-end check. Keras takes a
        list, a tuple, a single callback or None; a CallbackList the user built is left alone (its params are
        theirs), and so are callbacks given positionally."""
        if self.tracer is None and self.guard is None and self.stops is None:
            return args, kwargs
        checks = [c.check for c in (self.guard, self.stops) if c is not None]
        ours = (
            [_callback_class("trace", flavour)(self.tracer, self.trace_steps)] if self.tracer is not None else []
        ) + ([_callback_class("check", flavour)(checks, call)] if checks else [])
        position = _parameter_index(original, "callbacks")
        if position is not None and len(args) > position:
            return args, kwargs
        given = kwargs.get("callbacks")
        if given is None:
            callbacks = ours
        elif isinstance(given, (list, tuple)):
            callbacks = [*given, *ours]
        elif type(given).__name__ == "CallbackList":
            self.notes.append(
                f"{call}() was given a CallbackList: its trace window and batch-end check were not "
                "added (the trace and the watchdog still ran)."
            )
            return args, kwargs
        else:  # one callback object
            callbacks = [given, *ours]
        return args, {**kwargs, "callbacks": callbacks}

    def _use(self, model: KerasModel) -> ModelUse:
        use = self.models.get(id(model))
        if use is None or use.model_ref() is not model:
            use = self.models[id(model)] = ModelUse(weakref.ref(model))
            self._learn_names(model)
            if model not in SESSION.seen_models:
                SESSION.seen_models.add(model)
                self.new_models += 1
        return use

    def _record_call(
        self,
        model: KerasModel,
        call: str,
        original: Callable[..., Any],
        args: tuple[NotebookValue, ...],
        kwargs: dict[str, NotebookValue],
    ) -> tuple[tuple[NotebookValue, ...], dict[str, NotebookValue], feeding.Feed]:
        """Record what the user's call was fed; returns the arguments to call with (the same objects, except a
        Python generator, which is passed through a generator that notes its first batch), and the call's feed."""
        use = self._use(model)
        if call not in use.calls:
            use.calls.append(call)
        named = feeding.bind(original, args, kwargs)
        feed = feeding.describe_feed(call, named)
        if any(c in ("fit", "train_on_batch") for c in use.calls) and call not in ("fit", "train_on_batch"):
            # the model trained in this cell: keep the training call's description (batch, samples, copies)
            self._note_arrays(use, feed.arrays)
            return args, kwargs, feed
        use.feed, use.validation = feed.kind, feed.validation or use.validation
        if feed.batch_size is not None or use.batch_size is None:
            use.batch_size, use.batch_source = feed.batch_size, feed.batch_source
        use.input_shape = feed.input_shape or use.input_shape
        use.samples = feed.samples if feed.samples is not None else use.samples
        if call in ("fit", "train_on_batch") or use.structure is None:
            use.structure = feed.structure
        self._note_arrays(use, feed.arrays)
        if feed.kind == "generator":

            def first_batch(item: NotebookValue) -> None:
                batch, structure, shape = feeding.batch_of(item)
                if batch is not None:
                    use.batch_size, use.batch_source = batch, GENERATOR_BATCH
                use.input_shape = shape or use.input_shape
                if call == "fit" or use.structure is None:
                    use.structure = structure

            return (
                *_replace_argument(original, args, kwargs, "x", feeding.spy_generator(named["x"], first_batch)),
                feed,
            )
        return args, kwargs, feed

    def _note_arrays(self, use: ModelUse, arrays: list[InputArray]) -> None:
        for array in arrays:
            if all((a.id, a.role) != (array.id, array.role) for a in use.input_arrays):
                use.input_arrays.append(array)
            self.copy_roles.setdefault(array.copy_bytes, "validation" if array.validation else "training")

    def _record_direct_call(
        self, model: KerasModel, args: tuple[NotebookValue, ...], kwargs: dict[str, NotebookValue]
    ) -> None:
        """A model called like a function (custom training loops, inference): the batch is the largest seen (the
        last batch of an epoch is often a partial one)."""
        use = self._use(model)
        if "__call__" not in use.calls:
            use.calls.append("__call__")
        if any(c != "__call__" for c in use.calls):
            return  # a fit/predict of this model already described the cell's batch
        x = args[0] if args else kwargs.get("inputs")
        first = next(feeding.leaves(x), None)
        dims = feeding._dims(getattr(first, "shape", None))
        if dims and dims[0] is not None and (use.batch_size is None or dims[0] > use.batch_size):
            use.batch_size, use.input_shape = dims[0], dims
            use.batch_source = feeding.DIRECT_CALL_BATCH

    def _learn_names(self, model: KerasModel) -> None:
        try:
            for layer in _all_layers(model):
                self.layer_names.add(layer.name)
        except Exception as exc:  # noqa: BLE001 - a model mid-construction; names come from spans then
            fallback(_log, "a model's layer names could not be read: spans name them", exc)
            self.layer_names.add(model.name)
        # the model's optimizer, and those it keeps as attributes (a GAN's d_optimizer and g_optimizer): their scopes
        # name the optimizer phase in the trace
        classes = kerases.optimizer_classes()
        for value in [getattr(model, "optimizer", None), *list(vars(model).values())]:
            name = getattr(value, "name", None) if isinstance(value, classes) else None
            if isinstance(name, str) and name:
                self.optimizer_names.add(name.lower())


def _pairs_variables(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[Any]]:
    """The variables of apply_gradients' (gradient, variable) pairs, and the arguments to call it with: the pairs
    as a list, since reading a `zip` would leave nothing for the optimizer."""
    if args:
        given, rest = list(args[0]), args[1:]
        return (given, *rest), kwargs, [v for _, v in given]
    given = list(kwargs.get("grads_and_vars") or [])
    return args, {**kwargs, "grads_and_vars": given}, [v for _, v in given]


def _keras_own(cls: type, name: str) -> Callable[..., Any] | None:
    """Keras' own definition of method `name` along the class's MRO (skipping other libraries' patches)."""
    for klass in cls.__mro__:
        function: Callable[..., Any] | None = inspect.unwrap(klass.__dict__[name]) if name in klass.__dict__ else None
        if function is not None and (getattr(function, "__module__", "") or "").startswith(("keras", "tf_keras")):
            return function
    return None


def _parameter_index(function: Callable[..., Any], name: str) -> int | None:
    """Position of parameter `name` in the call's positional arguments (self excluded)."""
    try:
        names = list(inspect.signature(function).parameters)[1:]
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None


def _replace_argument(
    function: Callable[..., Any],
    args: tuple[NotebookValue, ...],
    kwargs: dict[str, NotebookValue],
    name: str,
    value: NotebookValue,
) -> tuple[tuple[NotebookValue, ...], dict[str, NotebookValue]]:
    position = _parameter_index(function, name)
    if position is not None and len(args) > position:
        return args[:position] + (value,) + args[position + 1 :], kwargs
    return args, {**kwargs, name: value}


def _trace_class() -> type:
    trace: type  # TensorFlow is untyped (Any to mypy)
    try:
        from tensorflow.python.profiler.trace import Trace
    except ImportError:  # moved: the public name of the same TraceMe annotation (capabilities.py)
        import tensorflow as tf

        trace = tf.profiler.experimental.Trace
        return trace
    trace = Trace
    return trace


def _make_trace_window_class(base: type) -> type:
    # base: Keras' Callback class (Keras 3 or tf_keras, chosen at run time), untyped: Any to mypy
    class TraceWindow(base):  # type: ignore[misc]
        """Keeps the trace on for the first `steps` batches of each fit/evaluate/predict call, then pauses it."""

        def __init__(self, tracer: Tracer, steps: int) -> None:
            super().__init__()
            self.tracer, self.steps, self.seen, self.in_fit = tracer, steps, 0, False

        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            self.in_fit, self.seen = True, 0
            self.tracer.steps_begin()
            self.tracer.release("steps")

        def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
            if not self.in_fit:  # validation inside fit belongs to fit's window
                self.seen = 0
                self.tracer.steps_begin()
                self.tracer.release("steps")

        on_predict_begin = on_test_begin

        def _batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            self.tracer.step_boundary()
            self.seen += 1
            if self.seen == self.steps:
                self.tracer.hold("steps", f"traced the first {self.steps} steps of each fit/evaluate/predict call")

        on_train_batch_end = on_test_batch_end = on_predict_batch_end = _batch_end

        def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
            self.in_fit = False
            self.tracer.release("steps")  # code after the call (in the same cell) is traced again

        def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
            if not self.in_fit:
                self.tracer.release("steps")

        on_predict_end = on_test_end

    return TraceWindow


def _make_batch_end_check_class(base: type) -> type:
    # base: Keras' Callback class (Keras 3 or tf_keras, chosen at run time), untyped: Any to mypy
    class BatchEndCheck(base):  # type: ignore[misc]
        """After every batch: the guard's memory check against its limit, and the stop latch's check for a press
        that Keras swallowed inside the step. Each may raise, between two steps."""

        def __init__(self, checks: list[Callable[[str], None]], call: str) -> None:
            super().__init__()
            self.checks, self.call = checks, call

        def _check(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            for check in self.checks:
                check(f"after batch {batch + 1} of {self.call}()")

        on_train_batch_end = on_test_batch_end = on_predict_batch_end = _check

    return BatchEndCheck


_CALLBACK_MAKERS = {"trace": _make_trace_window_class, "check": _make_batch_end_check_class}
_callback_classes: dict[tuple[str, str], type] = {}


def _callback_class(kind: Literal["trace", "check"], flavour: str) -> type:
    """Our callback class ("trace": the first steps' window, "check": the batch-end checks) for the Keras the model
    was made with (tf_keras' CallbackList calls methods a Keras 3 Callback lacks). Made on first use and kept."""
    key = (kind, flavour)
    if key not in _callback_classes:
        base = kerases.import_flavour(flavour).callbacks.Callback
        _callback_classes[key] = _CALLBACK_MAKERS[kind](base)
    return _callback_classes[key]


def _all_layers(model: KerasModel) -> list[KerasLayer]:
    return all_layers(model, include_self=True)


def all_layers(model: KerasLayer, include_self: bool = True) -> list[KerasLayer]:
    """The model (with `include_self`) and every layer inside it, nested ones too: Keras' own walk
    (`_flatten_layers`, private: see capabilities.py), else the public `.layers` of the model and of the models
    nested in it (a layer that a custom layer keeps inside itself is then missed)."""
    walk = getattr(model, "_flatten_layers", None)
    if walk is not None:
        return list(walk(include_self=include_self, recursive=True))
    found, seen, todo = [], {id(model)}, list(getattr(model, "layers", None) or [])
    while todo:
        layer = todo.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        found.append(layer)
        todo.extend(getattr(layer, "layers", None) or [])  # a nested model's own layers
    return [model, *found] if include_self else found
