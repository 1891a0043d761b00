"""The cell's own training step, sent to the step replay's probe processes when the model trains in a step of its own.

Calibration's probes rebuild a clone of the model from its Keras config and run Keras' `fit` on it. A model that
overrides `train_step` (keras-io's GAN with two optimizers) or `compute_loss` (keras-io's distiller, a teacher run
inside the step) is not trained as the cell trained it by such a clone: its class is rebuilt (when it can be), but
its `compile()` from Keras' compile config, which does not hold a `compile()` of its own's arguments (two
optimizers, loss functions, a temperature). So the step itself is sent instead: the
model's `train_step`, traced into a `tf.function` whose batch dimension is free, with every variable it reads or
writes (the models', both optimizers' slots, the metrics', a seed generator's state), saved as a SavedModel. A probe
process loads it and runs it at its batch on synthetic data shaped as the cell's batches were: TensorFlow runs the
same graph the cell ran, with nothing of the user's Python needed there.

Tracing the step again costs the kernel a graph (no tensors: tracing runs no op) and writing the variables' values
(the model's size, once, in a temporary folder).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.sizes import variable_bytes
from tfmem_magic.core.types import KerasModel, ParsedJSON, TFFunction, TFTensor
from tfmem_magic.measure import kerases
from tfmem_magic.measure.feeding import LEAF, complete, pack_batch

_log = logging.getLogger(__name__)

# the Model methods whose override makes a model's training step its own
_STEP_METHODS = ("train_step", "compute_loss")


@dataclass
class SavedStep:
    """A step saved for the probe processes: the SavedModel's folder, and the bytes of the variables it holds (the
    model's, its optimizers' slots, metrics': what the kernel holds too, once the step is traced)."""

    folder: str
    variable_bytes: int


def own_step(model: KerasModel) -> str | None:
    """'GAN.train_step' when the model's class overrides a method of Keras' training step (the first one found),
    None when the step is Keras' own (a clone of the model then trains as the cell did)."""
    for kind in type(model).__mro__:
        module = (getattr(kind, "__module__", "") or "").split(".")[0]
        if module in ("keras", "tf_keras", "tensorflow"):
            return None  # reached Keras' own classes: nothing above them overrode the step
        for name in _STEP_METHODS:
            if name in vars(kind):
                return f"{kind.__name__}.{name}"
    return None


def sent_step(model: KerasModel) -> str | None:
    """What calibration and the pre-flight send to the probes instead of a clone's fit, named ('GAN.train_step'):
    a step the model's class overrides, or Keras' own step of a model Keras cannot write a config for. None: a
    clone trains as the cell did."""
    return own_step(model) or uncloneable(model)


def not_rebuilt(model: KerasModel, method: str = "train_step") -> str:
    """The step sent where the model's config was written but its class could not be rebuilt from it in the probe
    (probe_runs.NotRebuildable): Keras' own, on this model (`method`: the call's step, e.g. predict_step)."""
    return f"{type(model).__name__}.{method}, Keras' own: its clone could not be rebuilt"


def uncloneable(model: KerasModel, method: str = "train_step") -> str | None:
    """ "TwoTowers.train_step, Keras' own: ..." when Keras cannot write the model's config (a subclassed model without
    get_config): calibration's clone cannot be built, and the step the cell ran (Keras' own, on this model; `method`:
    the call's step) is sent instead. None when the config is written."""
    to_json = getattr(model, "to_json", None)
    if to_json is None or not hasattr(model, "train_step"):  # not a Keras model: calibration says what it needs
        return None
    try:
        to_json()
    except (TypeError, ValueError, NotImplementedError, AttributeError):
        return f"{type(model).__name__}.{method}, Keras' own: the model has no config to clone it from"
    return None


def data_signature(structure: dict[str, Any] | None) -> TFTensor:
    """The `tf.TensorSpec`s of one batch as Keras hands it to `train_step` (x; (x,) for a list of inputs; (x, y);
    (x, y, sample_weight)), its batch dimension free. Lists become tuples, as tf.data yields them."""
    structure = structure or {}
    if "args" in structure:  # a loop's step function (loop_step): its own arguments, in order
        return tuple(_specs(node) for node in structure["args"])
    if not complete(structure.get("x")):
        raise TfmemUsageError(
            "the cell's batches have no shape tfmem could read (a Python list of labels, a "
            "generator it did not see): the probes cannot make synthetic ones"
        )
    y = _specs(structure["y"]) if complete(structure.get("y")) else None
    weights = _specs(structure["sample_weight"]) if y is not None and complete(structure.get("sample_weight")) else None
    return pack_batch(_specs(structure["x"]), y, weights)


def _specs(node: ParsedJSON) -> TFTensor:
    """A structure's node (feeding.spec_of) as TensorSpecs with a free batch dimension."""
    import tensorflow as tf

    if isinstance(node, dict) and LEAF in node:
        dims, dtype = node[LEAF]
        dtype = str(dtype)
        # as the probe's synthetic batches are: floats float32, NumPy's text ("str160", "bytes8") strings
        dtype = "float32" if "float" in dtype else "string" if dtype.startswith(("str", "bytes")) else dtype
        return tf.TensorSpec([None, *dims], tf.as_dtype(dtype))
    if isinstance(node, dict):
        return {k: _specs(v) for k, v in node.items()}
    return tuple(_specs(v) for v in node)


def loop_step(model: KerasModel) -> tuple[TFFunction, str, dict[str, Any]] | None:
    """The `tf.function` a GradientTape loop trained `model` in (TensorFlow's "quickstart for experts": a
    `@tf.function def train_step(images, labels)` of the notebook's): among the live tf.functions not of Keras' or
    TensorFlow's own, one traced with every trainable variable of the model and more (an optimizer's) that takes
    gradients. Returns that tf.function, its name and its arguments as a structure ({"args": [...]}, their batch
    dimension free), or
    None when there is no such function, or its arguments are not all batched tensors (the probes could not make
    them)."""
    import gc

    import tensorflow as tf

    kind = getattr(tf.types.experimental, "PolymorphicFunction", None) or tf.types.experimental.GenericFunction
    wanted = {id(getattr(v, "_value", v)) for v in kerases.variables_of(model, "trainable_variables")}
    if not wanted:
        return None
    found = None
    for obj in gc.get_objects():
        if not isinstance(obj, kind):
            continue
        python = getattr(obj, "python_function", None)
        if (getattr(python, "__module__", "") or "").split(".")[0] in ("keras", "tf_keras", "tensorflow"):
            continue  # Keras' own train function (an earlier fit) holds the same variables
        try:
            traced = obj._list_all_concrete_functions()  # private, no public listing (TF 2.12-2.21)
        except Exception as exc:  # noqa: BLE001 - a private listing that may raise on any traced function
            fallback(_log, "a tf.function's concrete functions could not be listed: skipped", exc)
            continue
        for concrete in traced:
            held = {id(v) for v in concrete.variables}
            # the model's and more, and gradients taken (a test step that updates metrics holds more variables too);
            # of several, the one that holds the most: an optimizer's slots are one or two more per weight
            if (
                wanted <= held
                and len(held) > len(wanted)
                and _takes_gradients(concrete)
                and (found is None or len(held) > found[0])
            ):
                found = (
                    len(held),
                    obj,
                    getattr(obj, "__name__", "the step function"),
                    concrete.structured_input_signature,
                )
    if found is None:
        return None
    _, function, name, (args, kwargs) = found
    leaves = []
    for spec in args:
        if kwargs or not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None or spec.shape.rank < 1:
            return None
        leaves.append({LEAF: [list(spec.shape)[1:], spec.dtype.name]})
    return function, name, {"args": leaves}


def _takes_gradients(concrete: TFFunction) -> bool:
    """Whether a traced function computes gradients (a GradientTape's ops are named `gradient_tape/...`) or
    applies them (tf_keras' fused `ResourceApply*` ops)."""
    try:
        operations = concrete.graph.get_operations()
    except Exception as exc:  # noqa: BLE001 - a traced function's graph may not be readable
        fallback(_log, "a traced function's graph could not be read: taken as not training", exc)
        return False
    return any(op.name.startswith("gradient_tape") or op.type.startswith("ResourceApply") for op in operations)


def export_loop_step(function: TFFunction, structure: dict[str, Any], folder: str) -> SavedStep:
    """Save a loop's step (loop_step: the user's tf.function itself, called inside the saved one, so that its own
    AutoGraph and `jit_compile` settings hold) as export_step saves a Keras step: one argument, the tuple of the
    function's own."""
    return _save(lambda data: function(*data), structure, folder, autograph=False)


def export_step(
    model: KerasModel, structure: dict[str, Any] | None, folder: str, method: str = "train_step"
) -> SavedStep:
    """Save the model's `train_step` (or the call's `method`: `test_step` for evaluate, `predict_step` for predict)
    with every variable it touches as a SavedModel in `folder` (its `step` function takes one batch, shaped as
    `data_signature` says). Before the model's first step (the pre-flight) the
    trace builds what that step would: its optimizers' slots, a subclassed model's layers. A step that cannot be
    traced again or saved (a captured resource that is not a variable, Python state the graph cannot hold) raises a
    TfmemUsageError that says why."""
    from tfmem_magic.measure.kerases import flavour_of

    if _distributed(model):  # traced outside its strategy's run, the step would build slots outside its scope
        raise TfmemUsageError(
            "the model's variables belong to a tf.distribute strategy, and its own step cannot be "
            "traced again outside that strategy's run() for the probe processes"
        )
    legacy = flavour_of(model) == "tf_keras"
    # Keras 3 traces the step without AutoGraph (its trainers wrap it in `do_not_convert`), tf_keras with it; and
    # with XLA where the model compiles with it (Keras 3's "auto": on a GPU), as the cell's fit ran it
    jit = getattr(model, "jit_compile", None)
    return _save(getattr(model, method), structure, folder, autograph=legacy, jit_compile=bool(jit) or None)


@contextmanager
def saved_for_probes(export: Callable[[str], SavedStep], prefix: str) -> Iterator[SavedStep]:
    """`export(folder)` into a temporary folder that is removed when the probes are done with it."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield export(os.path.join(folder, "step"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _distributed(model: KerasModel) -> bool:
    """Whether the model's variables were made under a tf.distribute strategy (mirrored, one per replica)."""
    import tensorflow as tf

    for variable in kerases.variables_of(model, "trainable_variables")[:1]:
        return isinstance(getattr(variable, "_value", variable), tf.distribute.DistributedValues)
    return False


def _save(
    function: Callable[..., TFTensor],
    structure: dict[str, Any] | None,
    folder: str,
    autograph: bool,
    jit_compile: bool | None = None,
) -> SavedStep:
    """`function` traced with one argument shaped as `structure` says (data_signature) and saved, with every
    variable it touches."""
    import tensorflow as tf

    try:
        signature = data_signature(structure)
        step = tf.function(function, input_signature=[signature], autograph=autograph, jit_compile=jit_compile)
        traced = step.get_concrete_function()
        holder = tf.Module()
        holder.step = step
        holder.variables_read = list(traced.variables)  # the SavedModel saves what its object graph holds
        os.makedirs(folder, exist_ok=True)
        logger = tf.get_logger()  # "INFO:tensorflow:Assets written to: /tmp/..." is not the user's business
        level = logger.level
        logger.setLevel("ERROR")
        try:
            tf.saved_model.save(holder, folder)
        finally:
            logger.setLevel(level)
    except TfmemUsageError:
        raise
    except Exception as exc:
        why = " ".join(str(exc).split())[:240]
        raise TfmemUsageError(
            f"the model's own step could not be traced again and saved for the probe "
            f"processes ({type(exc).__name__}: {why})"
        ) from exc
    return SavedStep(folder, variable_bytes(holder.variables_read))
