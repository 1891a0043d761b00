"""Calibration probes in a fresh Python process: a clone of the model (from its Keras config) trains at each probe
batch size on synthetic data under the profiler, fed as the cell fed it (a few steps of `fit` when the cell gave
`fit` its arrays, one `train_on_batch` step otherwise), and each probe's peak comes back (allocator and requested
bytes).

Why another process: Keras 3 on TensorFlow 2.21 keeps a trained model's variables alive after the model is gone
(measured: 288 MiB of a 25M-parameter model stay allocated after `del` and `gc.collect()`, and
`keras.backend.clear_session()` does not free them), so probes in the kernel would leak a clone per batch size.
A fresh process also starts with an empty allocator, like the run being predicted. Cost: TensorFlow's start-up
(~4 s) and its runtime's RSS (~0.5 GiB) for the few seconds the probes take.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import IO, Any

import psutil

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.types import KerasModel, NotebookValue
from tfmem_magic.measure import kerases
from tfmem_magic.measure.environment import tensorflow_initialized
from tfmem_magic.measure.fed_shapes import has_open_dims
from tfmem_magic.measure.feeding import structure_leaves
from tfmem_magic.measure.instrument import all_layers
from tfmem_magic.measure.tracer import remove_leftovers

_log = logging.getLogger(__name__)

TIMEOUT_S = 600
# steps of each probe's fit: fit's input pipeline holds prefetched batches once it is running, as in the cell
PIPELINE_STEPS = 4
# a probe process's own memory besides its step: TensorFlow's runtime and the profiler's recorder (0.5-0.7 GiB of RSS
# for a small model traced from the start: docs/what-if.md)
PROBE_PROCESS_BYTES = 768 << 20

# argv: the kernel's sys.path (JSON) and the Keras to import; then it waits for its spec on stdin, so that it can be
# started ahead of a pre-flight (`warm_up`) with its imports done by the time the spec comes
_PROBE = r"""
import base64, json, os, sys
sys.path[:0] = [p for p in json.loads(sys.argv[1]) if p not in sys.path]  # the kernel's: user modules import too
import tfmem_magic
tfmem_magic.prepare()
if sys.argv[2] == "tf_keras":  # the clone is built with the Keras that made the model (Keras 2 configs differ)
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tf_keras as keras
else:
    import keras
import numpy as np, tensorflow as tf
spec = json.loads(sys.stdin.read())
sys.path[:0] = [p for p in spec["path"] if p not in sys.path]  # added since the process started
print("TFMEM-PROGRESS 0", flush=True)
from tfmem_magic import Options, Profiler
keras.mixed_precision.set_global_policy(spec["policy"])
custom = {}
if spec["custom"]:  # classes defined in the notebook, sent by value (cloudpickle)
    import cloudpickle
    custom = cloudpickle.loads(base64.b64decode(spec["custom"]))
    import inspect

    def tolerant(cls):
        # keras.io's custom layers take only their own arguments (no **kwargs), yet Keras' automatic config also
        # holds name, trainable and dtype, and `cls(**config)` fails: build from what __init__ takes, then restore
        # trainable (frozen layers change the memory)
        try:
            params = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            return
        if any(p.kind == p.VAR_KEYWORD for p in params.values()) or "from_config" in vars(cls):
            return  # takes **kwargs, or has its own from_config
        def from_config(klass, config):
            obj = klass(**{k: v for k, v in config.items() if k in params and k != "self"})
            if "trainable" in config and hasattr(obj, "trainable"):
                obj.trainable = config["trainable"]
            return obj
        cls.from_config = classmethod(from_config)

    for value in set(v for v in custom.values() if isinstance(v, type)):
        tolerant(value)
scope = keras.saving.custom_object_scope(custom)
scope.__enter__()  # for the whole probe: compile_from_config may name custom losses and metrics too
if spec.get("replay"):  # a replay probe: everything the allocator does for the model, from its first allocation
    import time
    from tfmem_magic.measure import tracer as tracing, xplane
    recorder = tracing.Tracer(time.perf_counter(), max_seconds=0, budget_bytes=0)  # no cap, no budget, no pause
    recorder.start()
from tfmem_magic.measure.feeding import LEAF, complete, pack_batch
RNG = np.random.default_rng(0)

def synthetic(dims, dtype, batch, known=None):
    # unknown dims (a variable-length dataset) take the model's input dims where it has them, else 1
    known = list(known or [])
    dims = [batch] + [int(d) if d is not None else
                      (int(known[i]) if i < len(known) and known[i] is not None else 1) for i, d in enumerate(dims)]
    dtype = str(dtype)
    if "int" in dtype or dtype == "bool":
        return np.zeros(dims, dtype)
    if dtype == "string" or dtype.startswith(("str", "bytes")):  # tf's, or NumPy's text ("str160")
        return np.full(dims, "tfmem", dtype=object)
    return RNG.random(dims, dtype="float32")  # float64 arrays become floatx in Keras; bf16/f16 cast in the model

def build(node, batch, known=None):
    if node is None:
        return None
    if isinstance(node, dict) and LEAF in node:
        return synthetic(node[LEAF][0], node[LEAF][1], batch, known)
    if isinstance(node, dict):
        return {k: build(v, batch) for k, v in node.items()}
    return [build(v, batch) for v in node]

def tupled(v):  # tf.data stacks a list into one tensor: several inputs (or outputs) must be a tuple (as the saved
    # step's signature was written too)
    return tuple(tupled(a) for a in v) if isinstance(v, list) else (
        {k: tupled(a) for k, a in v.items()} if isinstance(v, dict) else v)

def graph(clone):  # what the kernel judges the step's convolutions from (gpu_target.types_convolve)
    # every op type in the functions this process registered (its steps' graphs as traced, before Grappler fuses a
    # convolution into an op named after its activation), and the clone's layers, to be told from the kernel's
    import gc
    from tensorflow.python.eager import context
    gc.collect()  # a function collected between its listing and its reading is not the live step's
    ctx = context.context()
    types = set()
    try:
        for name in ctx.list_function_names():
            try:
                types.update(n.op for n in ctx.get_function_def(name).node_def)
            except tf.errors.NotFoundError:
                continue
    except Exception:  # not readable in this TensorFlow: the kernel cannot tell from them
        types = None
    from tfmem_magic.advise.gpu_target import layer_kinds
    layers = None if clone is None else layer_kinds(clone)
    return {"op_types": None if types is None else sorted(types), "layers": layers}

def answer(line):  # the last line, and out at once: TensorFlow's teardown at exit held up the kernel's wait for the
    # answer (docs/preflight.md, "Warm probes"), and nothing in it is the probe's (its files are written and closed)
    print(line, flush=True)
    sys.stderr.flush()
    os._exit(0)

def in_use():  # the traced allocator's bytes in use (its device: the GPU's when there is one, as the trace's)
    try:
        return tf.config.experimental.get_memory_info("GPU:0" if tf.config.list_logical_devices("GPU")
                                                      else "CPU:0")["current"]
    except ValueError:  # no allocator statistics: the probes' answer says so
        return 0

if spec.get("saved"):  # the cell's own train_step, saved with its variables (advise/step_export.py)
    FED = spec["structure"]
    loaded = tf.saved_model.load(spec["saved"])
    print("TFMEM-CLONE saved-step", flush=True)
    batch = spec["batches"][0]
    print("TFMEM-PROGRESS 1", flush=True)
    if "args" in FED:  # a loop's step function: a tuple of its arguments
        parts = tuple(tupled(build(node, spec["rows"])) for node in FED["args"])
    else:  # packed as Keras packs a batch for train_step, as the saved step's signature was
        x = tupled(build(FED["x"], spec["rows"], spec.get("known")))
        y = tupled(build(FED["y"], spec["rows"])) if complete(FED.get("y")) else None
        w = (tupled(build(FED["sample_weight"], spec["rows"]))
             if y is not None and complete(FED.get("sample_weight")) else None)
        parts = pack_batch(x, y, w)
    before = in_use()
    ds = tf.data.Dataset.from_tensor_slices(parts).batch(batch, drop_remainder=True).prefetch(2)
    fed = in_use() - before
    for data in ds.take(spec["steps"]):  # the first step runs the graph's first time; then steady ones
        loaded.step(data)
    trace = xplane.read_segments(recorder.finish())
    from tfmem_magic.analyze.step_replay import save_events
    save_events(trace.events, spec["replay"], fed_bytes=fed, graph=graph(None))
    answer("TFMEM-REPLAY " + json.dumps({"events": len(trace.events), "allocator": trace.events.allocator}))

model = keras.models.model_from_json(spec["model"])
from tfmem_magic.measure.kerases import flavour_of
print("TFMEM-CLONE " + flavour_of(model), flush=True)  # the Keras whose classes built the clone (its MRO's)

if spec["train"]:
    model.compile_from_config(spec["compile"])
STEPS = spec["steps"]
FED = spec["structure"] or {}

def data(batch):  # x, y, sample_weight of one synthetic batch, shaped and typed as the cell's batches were
    if complete(FED.get("x")):
        inputs = getattr(model, "inputs", None) or []  # a subclassed model has none before it is called
        known = list(inputs[0].shape)[1:] if len(inputs) == 1 else None
        x = build(FED["x"], batch, known)
    else:
        inputs = [synthetic(list(t.shape)[1:], t.dtype.name if hasattr(t.dtype, "name") else t.dtype, batch)
                  for t in model.inputs]
        x = inputs[0] if len(inputs) == 1 else inputs
    if not spec["train"]:
        return x, None, None
    weights = build(FED["sample_weight"], batch) if complete(FED.get("sample_weight")) else None
    if complete(FED.get("y")):
        return x, build(FED["y"], batch), weights
    # no targets seen (a generator of x only, a loss added in the model): shaped like the outputs, read from one row
    # (a call on all the rows would be a forward pass as large as the step, inside a replay probe's trace)
    out = model(tf.nest.map_structure(lambda a: a[:1], x))
    y = tf.nest.map_structure(lambda o: np.zeros((batch, *tuple(o.shape)[1:]), "float32"), out)
    return x, y, weights

peaks = {}
for i, batch in enumerate(spec["batches"]):
    print(f"TFMEM-PROGRESS {i + 1}", flush=True)
    if spec["pipeline"]:  # the cell gave fit/predict its arrays: Keras' own input pipeline, as there
        # as tensors made before the probe: fit copies numpy arrays, and a copy of the probe's arrays would grow
        # with the probe's batch (the cell's copy is a part of its own, from the arrays' size)
        # a replay probe's arrays have the same rows at every probe batch (spec["rows"]): the cell's arrays do not
        # grow with its batch either, so the step replay must not see them grow (the steps' own tensors do)
        rows = spec.get("rows") or batch * STEPS
        arrays = data(rows)
        before = in_use()
        x, y, w = [None if v is None else tf.nest.map_structure(tf.constant, v) for v in arrays]
        fed = in_use() - before  # the pre-flight's fixed part (TF wraps an aligned array: no allocation, 0)
        if spec["train"]:
            step = lambda: model.fit(x, y, sample_weight=w, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                                     steps_per_epoch=STEPS)
        else:
            step = lambda: model.predict(x, batch_size=batch, verbose=0, steps=STEPS)
    elif spec.get("replay") and spec.get("feed") in ("dataset", "generator", "pydataset"):
        # a replay probe of a cell fed by a pipeline: a tf.data pipeline too (its prefetched batches are memory, and
        # its ops are part of the sequence the replay follows)
        parts = tuple(tupled(v) for v in data(spec["rows"]) if v is not None)
        before = in_use()
        ds = tf.data.Dataset.from_tensor_slices(parts).batch(batch, drop_remainder=True).prefetch(2)
        fed = in_use() - before  # where the traced allocator holds the rows (a GPU's pipeline keeps them on the host)
        step = ((lambda: model.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0)) if spec["train"] else
                (lambda: model.predict(ds, steps=STEPS, verbose=0)))
    else:
        x, y, w = data(batch)
        fed = 0  # made at every step: the step's own tensors
        step = ((lambda: model.train_on_batch(x, y, sample_weight=w)) if spec["train"] else
                (lambda: model.predict_on_batch(x)))
    step()  # the first run builds the optimizer's slots and traces the graph
    if spec.get("replay"):  # then one steady step, and the whole sequence goes to the kernel (step_replay.py)
        step()
        trace = xplane.read_segments(recorder.finish())
        from tfmem_magic.analyze.step_replay import save_events
        save_events(trace.events, spec["replay"], fed_bytes=fed, graph=graph(model))
        answer("TFMEM-REPLAY " + json.dumps({"events": len(trace.events), "allocator": trace.events.allocator}))
    probe = Profiler(Options(mode="trace", publish=False, label="tfmem calibration probe"))
    with probe:
        step()
    trace = probe.report.trace
    peaks[batch] = [probe.report.tf_peak_bytes, trace.peak_requested_bytes if trace is not None else None]
answer("TFMEM-PROBE " + json.dumps(peaks))
"""


def probe_peaks(
    model: KerasModel,
    batches: list[int],
    train: bool,
    structure: dict[str, Any] | None,
    pipeline: bool = False,
    progress: Callable[[str, float], None] | None = None,
) -> dict[int, tuple[int, int]]:
    """Per batch size, one step of a clone of `model` (with `pipeline`, a few steps of fit/predict on arrays, as the
    cell ran them) on synthetic batches shaped like `structure` (feeding.spec_of: features, targets, weights): the
    allocator's peak and the peak of the bytes the step requested, both over the step's start.
    The requested bytes grow in a straight line with the batch; the allocator's chunks add BFC's fragmentation on
    top, which varies from run to run (docs/design.md, 'Allocator statistics and BFC'). `progress(text, fraction)`
    hears of each stage as it starts."""
    spec = _spec(model, batches, train, structure, pipeline)
    stages = ["building the clone", *(f"probe at batch {b}" for b in batches)]
    tell = progress or (lambda text, done: None)
    tell("starting TensorFlow", 0.02)
    returncode, lines, last_error = _run_probe(spec, lambda k: tell(stages[k], (k + 1) / (len(stages) + 1)))
    line = _answer(model, spec, "TFMEM-PROBE ", returncode, lines, last_error)
    peaks = {int(k): tuple(v) for k, v in json.loads(line).items()}
    if any(None in v for v in peaks.values()):
        raise TfmemUsageError(
            "calibration needs TensorFlow's allocator statistics, which the probe process did not have"
        )
    return peaks


def replay_traces(
    model: KerasModel,
    batches: list[int],
    train: bool,
    structure: dict[str, Any] | None,
    folder: str,
    pipeline: bool = False,
    progress: Callable[[str, float], None] | None = None,
    parallel: bool = False,
    feed: str = "",
    rows: int | None = None,
    saved: str | None = None,
) -> dict[int, str]:
    """The step replay's probes (analyze/step_replay.py): per batch, a fresh process builds the clone and runs its
    step twice (as probe_peaks runs it) while the profiler records everything its allocator does, from its first
    allocation for the model, with no pause and no budget: a trace from a fresh allocator replays to the byte.
    Each process writes its allocator's events to an .npz file in `folder`; returns batch -> that file. With
    `parallel`, the processes run at once (the caller checked that the machine has the memory for both).
    The probes are fed as the cell was (`feed`: fit's arrays, or a tf.data pipeline for a dataset, generator or
    PyDataset), from `rows` synthetic rows (the cell's own count where the caller can afford it: the allocator's
    regions then grow as the cell's did), the same at every probe batch. With `saved` (a folder that
    step_export.export_step wrote), the probes run that step, the cell's own, instead of a clone's fit."""
    tell = progress or (lambda text, done: None)
    # the same arrays for every probe (see the probe script), with more batches than the steps at every probe
    # batch: fit's iterator prefetches two more than it runs, as in the cell, and a probe whose arrays ended with its
    # last step made fewer tensors than the other; a multiple of no probe batch (it would read as batch-shaped)
    rows = max(rows or 0, (PIPELINE_STEPS + 3) * max(batches) + 1)
    while any(rows % b == 0 for b in batches):
        rows += 1
    # the model's config and classes (or the saved step), made once for both
    spec = _saved_spec(model, structure, saved) if saved else _spec(model, [], train, structure, pipeline)
    specs = {
        b: {**spec, "batches": [b], "replay": os.path.join(folder, f"replay-{b}.npz"), "rows": rows, "feed": feed}
        for b in batches
    }
    names = " and ".join(str(b) for b in batches)
    tell(f"replay probes at batch {names}" if parallel else f"replay probe at batch {batches[0]}", 0.05)

    def one(batch: int) -> None:
        returncode, lines, last_error = _run_probe(specs[batch], lambda _: None)
        _answer(model, specs[batch], "TFMEM-REPLAY ", returncode, lines, last_error)
        if not parallel and batch != batches[-1]:
            tell(f"replay probe at batch {batches[batches.index(batch) + 1]}", 0.5)

    with ThreadPoolExecutor(max_workers=len(batches) if parallel else 1) as pool:
        for done in [pool.submit(one, b) for b in batches]:
            done.result()  # the first failure raises here (its TfmemUsageError says why)
    return {b: str(spec["replay"]) for b, spec in specs.items()}


def lengths_known(model: KerasModel, structure: dict[str, Any] | None) -> None:
    """Raise TfmemUsageError where the batches to make have a dimension besides the batch whose size is not known
    and the model's one input does not fix it (a padded or ragged pipeline's lengths): the probes would have to
    invent it, and a length of 1 predicted a Transformer's step 48 times too small (docs/preflight.md, 'Open
    dimensions'). The pre-flight reads such lengths from the pipeline first (measure/fed_shapes.py)."""
    if not has_open_dims(structure):
        return
    assert structure is not None
    try:
        inputs = list(getattr(model, "inputs", None) or [])
    except (AttributeError, ValueError):  # a subclassed model that was never called symbolically
        inputs = []
    pinned = [None if d is None else int(d) for d in list(inputs[0].shape)[1:]] if len(inputs) == 1 else None
    x = structure_leaves(structure.get("x"))
    x_fixed = (
        len(x) == 1
        and pinned is not None
        and all(d is not None or (i < len(pinned) and pinned[i] is not None) for i, d in enumerate(x[0][0]))
    )
    if x_fixed and not any(has_open_dims(structure.get(k)) for k in ("y", "sample_weight")):
        return
    raise TfmemUsageError(
        "the batches fed have a dimension besides the batch whose size varies (padded or ragged batches) and the "
        "model does not fix it: the probes cannot make batches of the lengths the call feeds"
    )


def _spec(
    model: KerasModel, batches: list[int], train: bool, structure: dict[str, Any] | None, pipeline: bool
) -> dict[str, Any]:
    """What the probe script needs: the model's config, how to compile and feed it, the notebook's classes."""
    lengths_known(model, structure)
    flavour = kerases.flavour_of(model)
    keras = kerases.import_flavour(flavour)
    try:
        config = model.to_json()
    except (TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        raise NotRebuildable(_not_rebuildable(model, exc)) from exc
    try:
        spec = {
            "model": config,
            "keras": flavour,
            "batches": batches,
            "train": train,
            "pipeline": pipeline,
            "steps": PIPELINE_STEPS,
            "structure": structure,
            "compile": model.get_compile_config() if train else None,
            "policy": keras.mixed_precision.global_policy().name,
            "custom": _custom_objects(model, keras),
            "path": [p for p in sys.path if isinstance(p, str)],
        }
        json.dumps(spec)
    except (TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        raise TfmemUsageError(
            f"calibration could not send the model to the probe process ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the analytic basis stays in use"
        ) from exc
    return spec


def _saved_spec(model: KerasModel, structure: dict[str, Any] | None, saved: str) -> dict[str, Any]:
    """What the probe script needs to run a saved step (step_export.py): the folder, how to feed it."""
    lengths_known(model, structure)
    flavour = kerases.flavour_of(model)
    keras = kerases.import_flavour(flavour)
    try:  # the model's input dims, for what the cell's batches left open (a variable length), as a clone's probe
        inputs = list(getattr(model, "inputs", None) or [])
    except (AttributeError, ValueError):  # a subclassed model that was never called symbolically
        inputs = []
    known = [None if d is None else int(d) for d in list(inputs[0].shape)[1:]] if len(inputs) == 1 else None
    return {
        "saved": saved,
        "keras": flavour,
        "batches": [],
        "train": True,
        "pipeline": False,
        "steps": PIPELINE_STEPS,
        "structure": structure,
        "policy": keras.mixed_precision.global_policy().name,
        "custom": None,
        "path": [p for p in sys.path if isinstance(p, str)],
        "known": known,
    }


def _answer(
    model: KerasModel, spec: dict[str, Any], prefix: str, returncode: int | None, lines: list[str], last_error: str
) -> str:
    """The probe's answer line (after `prefix`), or a TfmemUsageError that says why there is none."""
    if returncode is None:
        raise TfmemUsageError(f"calibration probes took more than {TIMEOUT_S} s; the analytic basis stays in use")
    line = next((x for x in lines if x.startswith(prefix)), None)
    if returncode != 0 or line is None:
        if "OOM" in last_error and "GPU" in last_error or "CUDA_ERROR_OUT_OF_MEMORY" in last_error:
            raise TfmemUsageError(f"calibration: {GPU_BUSY} ({last_error[:200]})")
        missing = _MISSING_ARGUMENT.search(last_error)
        if missing:  # older Keras (3.3) writes a config for a class without get_config(); only rebuilding it fails
            raise NotRebuildable(_not_rebuildable(model, TypeError(missing.group(0)), missing.group(1)))
        raise TfmemUsageError(f"calibration probes failed ({last_error[:300]}); the analytic basis stays in use")
    clone = next((x.split(" ", 1)[1] for x in lines if x.startswith("TFMEM-CLONE ")), None)
    # another Keras' clone measures another implementation: no number, not a wrong one
    if clone != ("saved-step" if spec.get("saved") else spec["keras"]):
        raise TfmemUsageError(
            f"calibration: the probe process built the clone with {clone or 'no Keras'}, not with "
            f"the model's {spec['keras']}; the analytic basis stays in use"
        )
    return line.split(" ", 1)[1]


def _own_classes(model: KerasModel) -> list[Any]:
    """Classes of the model, its layers (nested too), loss, metrics and optimizer that are not Keras' or TF's own:
    the probe process must be given them (the notebook's `__main__` does not exist there)."""
    objects: list[NotebookValue] = [model, getattr(model, "optimizer", None), getattr(model, "loss", None)]
    objects += all_layers(model, include_self=False)
    # the metrics compile() was given: Keras 3's _compile_metrics, tf_keras' compiled_metrics, each keeps them in
    # _user_metrics (private: see measure/capabilities.py; without them a notebook's metric class is not sent)
    compiled = getattr(model, "_compile_metrics", None) or getattr(model, "compiled_metrics", None)
    objects += list(getattr(compiled, "_user_metrics", None) or []) if compiled is not None else []
    seen: dict[str, Any] = {}
    for obj in objects:
        if obj is None or isinstance(obj, str):
            continue
        kind = obj if type(obj).__name__ == "function" else type(obj)  # a custom loss function, else the class
        module = getattr(kind, "__module__", "") or ""
        if module.split(".")[0] not in _LIBRARIES:
            seen.setdefault(f"{module}.{getattr(kind, '__qualname__', kind)}", kind)
    return list(seen.values())


_LIBRARIES = {"keras", "tensorflow", "tf_keras", "builtins", "numpy"}


def _custom_objects(model: KerasModel, keras: ModuleType) -> str | None:
    """The model's own classes (and custom loss functions), pickled by value, base64: a custom_object_scope in the
    probe process. Registered names (`register_keras_serializable`) are sent too: Keras looks those up first."""
    classes = _own_classes(model)
    if not classes:
        return None
    import base64

    import cloudpickle

    custom: dict[str, Any] = {}
    for kind in classes:
        custom[getattr(kind, "__name__", str(kind))] = kind
        try:
            custom[keras.saving.get_registered_name(kind)] = kind
        except Exception:  # noqa: BLE001 - not registered (any Keras): its plain name is what the config names
            pass
    try:
        return base64.b64encode(cloudpickle.dumps(custom)).decode("ascii")
    except Exception as exc:  # noqa: BLE001 - a class that holds a lock, a file, an open session...
        names = ", ".join(sorted(k for k in custom if "." not in k and ">" not in k))
        raise TypeError(f"the notebook's classes ({names}) could not be sent to the probe process: {exc}") from exc


_MISSING_ARGUMENT = re.compile(
    r"(?:[\w.]+\.)?(\w+)\.__init__\(\) missing \d+ required (?:positional |keyword-only )?"
    r"arguments?: [^;)]*"
)


class NotRebuildable(TfmemUsageError):
    """The clone could not be built from the model's config (calibration can send the cell's step instead)."""


def _not_rebuildable(model: KerasModel, exc: BaseException, culprit: str | None = None) -> str:
    """What to do when Keras cannot write the model's config (a subclassed Model or Layer without get_config), or
    (`culprit`: the class that could not be rebuilt) wrote one that its class cannot be rebuilt from."""
    for layer in [] if culprit else getattr(model, "layers", []) or []:
        try:
            layer.get_config()
        except NotImplementedError:
            culprit = type(layer).__name__
            break
        except Exception:  # noqa: BLE001 - any layer's failing get_config is the culprit's sign: the next one
            continue
    culprit = culprit or type(model).__name__
    why = " ".join(str(exc).split())[:160]  # Keras' own message spans lines: one line here
    return (
        f"calibration rebuilds a clone of the model from its Keras config, and {culprit} has none "
        f"({type(exc).__name__}: {why}). Give {culprit} a get_config() that returns its constructor's "
        "arguments (and a from_config() that rebuilds nested models), or build the model with the functional "
        "API; the analytic basis (from this cell's trace) stays in use."
    )


def probe_environment() -> dict[str, str]:
    """The probe process's environment: the kernel's, quieter, and on a GPU with memory growth, so that the probe
    takes from the GPU only what its steps use instead of reserving all of what is left (the kernel keeps its own
    reservation; a user's own TF_FORCE_GPU_ALLOW_GROWTH is kept). Inside `on_cpu` (a pre-flight's probes) every GPU
    is hidden from it."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.setdefault(GPU_GROWTH_ENV, "true")
    if _cpu_only:
        env[HIDE_GPUS_ENV] = "-1"
    return env


HIDE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"
_cpu_only = False  # set by on_cpu (the pre-flight runs on the kernel's main thread; its probes' threads read it)


def probes_use_gpu() -> bool:
    """Whether probes started now may take GPU memory: the kernel has a GPU and they are not inside `on_cpu`."""
    return not _cpu_only and kernel_has_gpu()


@contextlib.contextmanager
def on_cpu(active: bool = True) -> Iterator[None]:
    """Probes started inside run on the CPU, every GPU hidden from them: a pre-flight's, which must never need the GPU
    the kernel holds (TensorFlow reserves nearly all of it unless memory growth is on; a probe's CUDA context alone
    could fail there). Their step is modelled for the GPU (docs/gpu.md, "A pre-flight while the kernel holds the
    GPU")."""
    global _cpu_only
    before = _cpu_only
    _cpu_only = before or active
    try:
        yield
    finally:
        _cpu_only = before


def kernel_has_gpu() -> bool:
    """Whether this process's TensorFlow has a GPU; False before its runtime started (listing devices would start it,
    and a cell's own memory-growth setting would then raise)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not tensorflow_initialized():
        return False
    try:
        return bool(tf.config.list_logical_devices("GPU"))
    except Exception as exc:  # noqa: BLE001 - TensorFlow not started, or no device list: taken as no GPU
        fallback(_log, "TensorFlow's GPUs could not be listed: taken as none", exc)
        return False


GPU_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"


def probes_grow_gpu() -> bool:
    """Whether the probe processes' GPU allocator grows (`probe_environment`): the step replay's self-check replays
    their traces with that setting."""
    return probe_environment().get(GPU_GROWTH_ENV, "").lower() == "true"


def weight_dims(model: KerasModel) -> set[int]:
    """Every dimension of the model's weights: the step replay's probe batches avoid them (a probe batch equal to a
    layer's width makes its tensors ambiguous, step_replay.odd_probes)."""
    return {int(d) for w in kerases.variables_of(model) for d in getattr(w, "shape", ()) if d is not None}


GPU_BUSY = (
    "the probe process found no room on the GPU: the kernel's TensorFlow reserves nearly all of a GPU's "
    "memory unless memory growth is on. Turn it on at the top of the notebook (the memory-growth fix, then "
    "restart) to calibrate on the GPU; the analytic basis stays in use"
)


def _spawn(flavour: str) -> _Probe:
    """A probe process for the Keras `flavour`: it imports TensorFlow and waits for its spec on stdin. stderr goes
    to a file: a pipe nobody reads could fill up with TensorFlow's warnings and stall it."""
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process: closed by _run_probe or _end
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBE, json.dumps(sys.path), flavour],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=probe_environment(),
    )
    return _Probe(_warm_key(flavour), proc, err, time.monotonic())


def _run_probe(spec: dict[str, Any], stage: Callable[[int], None]) -> tuple[int | None, list[str], str]:
    """Run the probe script on `spec`, calling `stage(k)` as it announces stage k on stdout: in a warm probe process
    where one waits for its Keras (`warm_up`), else in a new one. Returns the exit code (None if it ran past TIMEOUT_S
    and was killed), its stdout lines and the last line of its stderr."""
    flavour = spec.get("keras", "keras")
    probe = _take_warm(flavour) or _spawn(flavour)
    proc = probe.proc
    timed_out = threading.Event()
    lines: list[str] = []
    with probe.err as err, proc:

        def stop() -> None:
            timed_out.set()
            proc.kill()

        deadline = threading.Timer(TIMEOUT_S, stop)
        deadline.start()
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(spec))
            proc.stdin.close()
            for raw in proc.stdout:
                lines.append(raw.rstrip("\n"))
                if raw.startswith("TFMEM-PROGRESS "):
                    stage(int(raw.split()[1]))
        finally:
            deadline.cancel()
            deadline.join()
            if proc.poll() is None:  # a progress callback raised: the probe must not outlive the call
                proc.kill()
            proc.wait()
            if proc.returncode != 0:  # a probe killed mid-trace leaves its trace folder behind
                remove_leftovers()
        err.seek(0)
        last = (err.read().strip().splitlines() or ["no output"])[-1]
    return (None if timed_out.is_set() else proc.returncode), lines, last


# ---- warm probe processes ----------------------------------------------------------------------------------------

# A probe spends seconds importing TensorFlow before its step (most of a refusal's time on a busy 2-core machine):
# where a pre-flight may run, two are started ahead and wait with their imports done (docs/preflight.md, "Warm
# probes"). Each holds ~0.2 GiB of its own (its libraries' pages are shared), so only where the machine has room for
# them and for the probes' work, and not for long.
WARM_PROBES = 2
WARM_IDLE_S = 600.0  # a warm probe no pre-flight took by then is ended
WARM_OWN_BYTES = 256 << 20  # what one idle warm probe holds of its own


@dataclass
class _Probe:
    key: tuple[str, ...]  # what it was started for (`_warm_key`): a probe is used only for the same
    proc: subprocess.Popen[str]
    err: IO[str]
    started: float


_warm: list[_Probe] = []
_warm_lock = threading.Lock()
_warm_used = 0  # probes a pre-flight took warm (for `%tfmem status` and the tests)


def _warm_key(flavour: str) -> tuple[str, ...]:
    """A warm probe serves a spec of the same Keras, interpreter, sys.path and environment as it was started with."""
    env = json.dumps(sorted(probe_environment().items()))
    return (sys.executable, flavour, json.dumps(sys.path), env)


def _end(probe: _Probe) -> None:
    if probe.proc.poll() is None:
        probe.proc.kill()
    probe.proc.wait()
    for stream in (probe.proc.stdin, probe.proc.stdout, probe.err):
        if stream is not None:
            stream.close()


def _drop_stale() -> None:
    """End the warm probes that died or waited past WARM_IDLE_S (under _warm_lock)."""
    now = time.monotonic()
    for probe in [p for p in _warm if p.proc.poll() is not None or now - p.started > WARM_IDLE_S]:
        _warm.remove(probe)
        _end(probe)


def _take_warm(flavour: str) -> _Probe | None:
    global _warm_used
    key = _warm_key(flavour)
    with _warm_lock:
        _drop_stale()
        for probe in _warm:
            if probe.key == key:
                _warm.remove(probe)
                _warm_used += 1
                return probe
    return None


def warm_up(flavour: str) -> int:
    """Start probe processes for the Keras `flavour` ahead of a pre-flight, up to WARM_PROBES waiting, where the
    machine has room for them, their probes' work and a margin (on the CPU where the kernel has a GPU, as the
    pre-flight's probes run: `on_cpu`). Returns how many wait now. Cheap to call again."""
    with on_cpu(kernel_has_gpu()):
        return _warm_up(flavour)


def _warm_up(flavour: str) -> int:
    key = _warm_key(flavour)
    with _warm_lock:
        _drop_stale()
        for other in [p for p in _warm if p.key != key]:  # started for another Keras or environment: not of use now
            _warm.remove(other)
            _end(other)
        waiting = len(_warm)
        room = psutil.virtual_memory().available
        need = WARM_PROBES * (PROBE_PROCESS_BYTES + WARM_OWN_BYTES) + (1 << 30)
        while waiting < WARM_PROBES and room >= need:
            _warm.append(_spawn(flavour))
            waiting += 1
            room -= WARM_OWN_BYTES
        if _warm:
            _ender.start()
    return waiting


def end_warm() -> None:
    """End every warm probe (at exit; `%tfmem limit off`)."""
    with _warm_lock:
        while _warm:
            _end(_warm.pop())


def warm_waiting() -> int:
    with _warm_lock:
        return sum(1 for p in _warm if p.proc.poll() is None)


class _Ender:
    """One daemon thread that ends warm probes left idle past WARM_IDLE_S, started with the first one."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tfmem-warm-probes", daemon=True)
            self._thread.start()
            atexit.register(end_warm)

    def _run(self) -> None:
        while True:
            time.sleep(30)
            with _warm_lock:
                _drop_stale()


_ender = _Ender()
