"""What a Keras model holds: parameters, optimizer state and the activations each layer makes per sample."""

from __future__ import annotations

import logging
import math
from collections.abc import Container, Iterable
from typing import Any

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import LayerInfo, ModelInfo
from tfmem_magic.core.sizes import dtype_size as _dtype_size
from tfmem_magic.core.sizes import variable_bytes
from tfmem_magic.core.types import KerasLayer, KerasModel, KerasOptimizer, TFTensor
from tfmem_magic.measure import feeding, kerases
from tfmem_magic.measure.holders import optimizer_variables
from tfmem_magic.measure.instrument import AppliedOptimizers, ModelUse

_log = logging.getLogger(__name__)

_CALL_RANK = {
    "fit": 0,
    "train_on_batch": 1,
    "optimizer.apply": 1,
    "evaluate": 2,
    "test_on_batch": 3,
    "predict": 4,
    "predict_on_batch": 5,
    "__call__": 6,
}
MAX_LAYERS = 400  # layers listed per model (nested models are listed by their own layers)


def _shape_text(shape: TFTensor) -> str | None:
    if shape is None:
        return None
    try:
        return "(" + ", ".join("None" if d is None else str(int(d)) for d in shape) + ")"
    except TypeError:
        return str(shape)


# Bytes a recurrent layer keeps per time step and unit (per direction) for its backward pass, in units of its
# compute dtype, measured on TF 2.21 / Keras 3.15 CPU: the slope of TF's training peak over the batch, for
# return_sequences off (units 32 and 64, 50 and 100 steps, one and two directions; the spread was 7-8.7 for LSTM,
# 6.9-7.8 for GRU, 1.6-2.1 for SimpleRNN). Its output (a step or the whole sequence) is counted as any layer's.
RECURRENT_KEPT_PER_STEP_UNIT = {"LSTM": 8.4, "GRU": 7.5, "SimpleRNN": 1.2}
_RECURRENT_CELLS = {"LSTMCell": "LSTM", "GRUCell": "GRU", "SimpleRNNCell": "SimpleRNN"}


def _first(tensors: TFTensor) -> TFTensor:
    """A layer's main input or output where it has several: an LSTM given initial states takes [sequence, h, c],
    one returning its states gives [output, h, c]. Read as a whole, the sequence-to-sequence encoder-decoder of
    keras-io had no shapes, so no cost per sample: its pre-flight's probes were not capped (docs/preflight.md)."""
    return tensors[0] if isinstance(tensors, list | tuple) and tensors else tensors


def _recurrent_kept_bytes(layer: KerasLayer, input_shape: TFTensor = None) -> int:
    """Per-sample bytes a recurrent layer keeps for its backward pass: every time step's gates and states.
    `input_shape`: the layer's input as the cell fed it, when the model leaves the sequence length open."""
    outer, directions = layer, 1
    if type(layer).__name__ == "Bidirectional":  # its inner layers are never called symbolically: no .input
        layer, directions = getattr(layer, "forward_layer", None), 2
    kind = type(layer).__name__
    if kind not in RECURRENT_KEPT_PER_STEP_UNIT:
        kind = _RECURRENT_CELLS.get(type(getattr(layer, "cell", None)).__name__, "")
    if kind not in RECURRENT_KEPT_PER_STEP_UNIT:
        return 0
    try:
        steps = int((input_shape if input_shape is not None else _first(outer.input).shape)[1])
        units = int(getattr(layer, "units", None) or layer.cell.units)
    except (AttributeError, TypeError, ValueError, IndexError):  # variable-length sequences: the trace tells
        return 0
    size = _dtype_size(getattr(layer, "compute_dtype", "float32"))
    return int(RECURRENT_KEPT_PER_STEP_UNIT[kind] * steps * units * size * directions)


def _internal_bytes(layer: KerasLayer) -> int:
    """Per-sample bytes of tensors a layer makes inside itself that its output does not show. Attention: the
    projected query, key and value, and the heads x query x key scores with their softmax."""
    dims = _attention_dims(layer)
    if dims is None:
        return 0
    heads, key_dim, t_q, t_k = dims
    size = _dtype_size(getattr(layer, "compute_dtype", "float32"))
    return size * (heads * key_dim * (t_q + 2 * t_k) + 2 * heads * t_q * t_k)


def _attention_dims(layer: KerasLayer) -> tuple[int, int, int, int] | None:
    """An attention layer's heads, key size, query positions and key positions; None for any other layer."""
    if type(layer).__name__ not in ("MultiHeadAttention", "GroupedQueryAttention"):
        return None
    try:
        # Keras 3's properties, else the layer's config (public in both Kerases: tf_keras has no such properties)
        config = {} if getattr(layer, "num_heads", None) and getattr(layer, "key_dim", None) else layer.get_config()
        heads = int(getattr(layer, "num_heads", None) or config.get("num_heads") or layer.num_query_heads)
        key_dim = int(getattr(layer, "key_dim", None) or config.get("key_dim") or layer.head_dim)
        shapes = _attention_shapes(layer)
        query = [int(d) for d in shapes["query_shape"][1:-1]]
        key = [int(d) for d in (shapes.get("key_shape") or shapes["value_shape"])[1:-1]]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return heads, key_dim, math.prod(query), math.prod(key)


def _attention_shapes(layer: KerasLayer) -> dict[str, TFTensor]:
    """The shapes an attention layer was built with: Keras 3 keeps its build() arguments (`_build_shapes_dict`),
    tf_keras its own `_query_shape`, `_key_shape` and `_value_shape`."""
    shapes: dict[str, TFTensor] | None = getattr(layer, "_build_shapes_dict", None)
    if shapes:
        return shapes
    return {"query_shape": layer._query_shape, "key_shape": layer._key_shape, "value_shape": layer._value_shape}


def _layer_info(layer: KerasLayer, fed: tuple[TFTensor, TFTensor] | None = None) -> LayerInfo:
    """`fed`: the layer's input and output shapes as the cell's batches made them (see _fed_shapes), when the model
    left a dimension open."""
    try:
        shape = fed[1] if fed is not None else _first(layer.output).shape
    except (AttributeError, ValueError):
        shape = None
    try:
        input_shape = fed[0] if fed is not None else _first(layer.input).shape
    except (AttributeError, ValueError, RuntimeError):  # never called symbolically, or called on several inputs
        input_shape = None
    size = _dtype_size(getattr(layer, "compute_dtype", "float32"))
    per_sample = _per_sample(shape, size) + _internal_bytes(layer)
    try:
        params = int(layer.count_params())
    except ValueError:  # not built
        params = 0
    return LayerInfo(
        name=layer.name,
        type=type(layer).__name__,
        params=params,
        output_shape=_shape_text(shape),
        activation_bytes_per_sample=per_sample,
        kept_bytes_per_sample=_recurrent_kept_bytes(layer, fed[0] if fed is not None else None),
        input_bytes_per_sample=_per_sample(input_shape, size),
    )


def _per_sample(shape: TFTensor, size: int) -> int:
    """Bytes per sample of a tensor of this shape (its first dimension the batch); 0 where a dimension is open."""
    if shape is None:
        return 0
    try:
        return math.prod(int(d) for d in shape[1:]) * size
    except (TypeError, ValueError):
        return 0


def _open(shape: TFTensor) -> bool:
    try:
        return any(d is None for d in list(shape)[1:])
    except TypeError:
        return False


def _fed_shapes(model: KerasModel, structure: dict[str, Any] | None) -> dict[int, tuple[TFTensor, TFTensor]]:
    """Layer id -> (input shape, output shape) as the cell's batches made them, for a model that leaves dimensions
    open (`Input((None,))`: a text model takes any sequence length). Keras' symbolic pass of the model's graph with
    the fed per-sample shapes (batch 1) fills them in: an Embedding's (None, None, 64) becomes (1, 80, 64) when the
    cell fed 80 tokens. {} when nothing is open, the fed shapes are unknown, or the graph cannot be replayed
    (a subclassed model has no graph; a shared layer has no single output)."""
    layers = (getattr(model, "layers", []) or [])[:MAX_LAYERS]
    fed = feeding.structure_leaves((structure or {}).get("x"))
    try:
        inputs = list(model.inputs)
        if not fed or len(fed) != len(inputs) or not any(_open(_first(layer.output).shape) for layer in layers):
            return {}
        x = (structure or {}).get("x")
        if isinstance(x, dict) and feeding.LEAF not in x:  # dict inputs go to the Input of the same name
            by_name = dict(zip(x, fed, strict=False))
            fed = [by_name[t.name] for t in inputs]
    except (AttributeError, ValueError, KeyError, TypeError):
        return {}
    import keras

    kept, ends = [], []
    for layer in layers:
        try:
            pair = [_first(layer.input), _first(layer.output)]
        except (AttributeError, ValueError):  # a shared layer, a layer never called
            continue
        if not all(hasattr(t, "shape") for t in pair):  # an InputLayer's input is [] in Keras 3.3 (3.15 raises)
            continue
        ends += pair
        kept.append(layer)
    try:
        tensors = [keras.KerasTensor((1, *dims), dtype=dtype) for dims, dtype in fed]
        graph = keras.Model(inputs, ends)
        specs = graph.compute_output_spec(tensors[0] if len(tensors) == 1 else tensors)
    except Exception as exc:  # noqa: BLE001 - a layer whose compute_output_spec needs what a symbolic tensor does not have
        fallback(_log, "a layer's output spec could not be computed: its activations are unknown", exc)
        return {}

    def shape(spec: TFTensor) -> tuple[TFTensor, ...] | None:
        return tuple(spec.shape) if hasattr(spec, "shape") else None  # no shape: unknown, as an open one

    return {id(layer): (shape(specs[2 * i]), shape(specs[2 * i + 1])) for i, layer in enumerate(kept)}


def _layers(model: KerasModel, structure: dict[str, Any] | None = None) -> list[LayerInfo]:
    """The model's layers. A model used as a layer (an encoder in a VAE, the base of transfer learning, an
    augmentation Sequential) counts the outputs of all its own layers: its output alone is only the last of them.
    `structure`: what the cell's batches held (feeding.spec_of), for the dimensions the model leaves open."""
    out = []
    fed = _fed_shapes(model, structure)
    for layer in (getattr(model, "layers", []) or [])[:MAX_LAYERS]:
        info = _layer_info(layer, fed.get(id(layer)))
        inner = _nested_layers(layer)
        if inner:
            info.activation_bytes_per_sample = sum(i.activation_bytes_per_sample for i in inner)
            info.kept_bytes_per_sample = sum(i.kept_bytes_per_sample for i in inner)
            info.type = f"{info.type} ({len(inner)} layers)"
        out.append(info)
    return out


def _nested_layers(layer: KerasLayer) -> list[LayerInfo]:
    return [_layer_info(leaf) for leaf in _leaf_layers(layer)]


def weight_shapes(use: ModelUse | None) -> set[str]:
    """The shapes of the model's variables as the trace writes shapes ("[5408,10]"): gradients and slots have
    them, and must not be taken for tensors that carry the batch."""
    model = use.model_ref() if use is not None else None
    out = set()
    for w in kerases.variables_of(model) if model is not None else []:
        try:
            out.add("[" + ",".join(str(int(d)) for d in w.shape) + "]")
        except (TypeError, ValueError):
            continue
    return out


def training_optimizers(
    model: KerasModel, use: ModelUse, applied: AppliedOptimizers = ()
) -> list[tuple[str, KerasOptimizer]]:
    """(label, optimizer) of each optimizer that really updates the model's weights. Those the cell saw apply
    gradients to them come first and alone: a custom loop's (a plain SGD, slots or not), a custom `train_step`'s (a
    GAN's `d_optimizer` and `g_optimizer`, recorded when fit traces the step). Else the optimizers the model keeps
    as attributes that hold slots (a step traced in an earlier cell), else the model's own `optimizer` (Keras gives
    a model whose compile() named none an RMSprop that never trains anything). Labels are the attribute names."""
    try:
        mine = {id(v) for v in kerases.variables_of(model, "trainable_weights")}
    except TypeError:
        mine = set()
    own = getattr(model, "optimizer", None)
    classes = kerases.optimizer_classes()
    kept: list[tuple[str, KerasOptimizer]] = [("optimizer", own)] if own is not None else []
    for name, value in list(vars(model).items()) if classes else []:
        if isinstance(value, classes) and all(o is not value for _, o in kept):
            kept.append((name.lstrip("_"), value))

    def label(optimizer: KerasOptimizer) -> str:
        return next((name for name, o in kept if o is optimizer), "optimizer.apply")

    here: list[tuple[str, KerasOptimizer]] = []
    for ref, ids in applied:
        optimizer = ref()
        if optimizer is not None and mine and ids & mine and all(o is not optimizer for _, o in here):
            here.append((label(optimizer), optimizer))
    if here:
        return here
    with_slots = [(name, o) for name, o in kept if _slot_variables(o)]
    return with_slots or kept[:1]


def _slot_variables(optimizer: KerasOptimizer) -> list[TFTensor]:
    """The optimizer's variables that are not scalars (its slots; its step counter and learning rate are)."""
    return [v for v in optimizer_variables(optimizer) if len(getattr(v, "shape", ())) > 0]


def applied_optimizer(use: ModelUse, applied: AppliedOptimizers) -> KerasOptimizer | None:
    """The optimizer a custom loop applied to this model's trainable weights, if any."""
    try:
        mine = {id(v) for v in kerases.variables_of(use.model_ref(), "trainable_weights")}
    except TypeError:
        return None
    for ref, ids in applied:
        if mine and ids & mine and ref() is not None:
            return ref()
    return None


def describe_model(
    use: ModelUse,
    new_variables: Container[object] = (),
    built_optimizers: Container[object] = (),
    applied: AppliedOptimizers = (),
    others: list[ModelUse] | None = None,
) -> ModelInfo | None:
    """ModelInfo for a model the cell used; None when it has been garbage-collected. `new_variables` and
    `built_optimizers` are what the cell created (their memory is the cell's); `applied` the optimizers a custom
    loop applied, with the ids of their variables; `others` the other models the cell used."""
    model = use.model_ref()
    if model is None:
        return None
    weights = kerases.variables_of(model)
    trainable = kerases.variables_of(model, "trainable_weights")
    calls = list(use.calls)
    looped = applied_optimizer(use, applied)
    trained_by_keras = any(c in ("fit", "train_on_batch") for c in calls)  # its optimizer runs inside those
    if looped is not None and "optimizer.apply" not in calls and not trained_by_keras:
        calls.append("optimizer.apply")
    trainers = training_optimizers(model, use, applied)
    opt_vars = list({id(v): v for _, o in trainers for v in optimizer_variables(o)}.values())
    # slots per trainable variable: Adam keeps m and v (2), SGD with momentum 1, plain SGD 0
    big_opt_vars = [v for v in opt_vars if len(getattr(v, "shape", ())) > 0]
    slots = round(len(big_opt_vars) / len(trainable)) if trainable else 0
    policy = getattr(getattr(model, "dtype_policy", None), "name", None)
    layers = _layers(model, use.structure)
    training = use.training_arrays
    replicas = _replicas_of(model)
    batch_size, batch_source = use.batch_size, use.batch_source
    if replicas > 1 and batch_size and batch_source == feeding.DIRECT_CALL_BATCH:
        # a custom loop under a strategy calls the model inside strategy.run, on one replica's share: the batch
        # the model line and the what-if speak of is the global one (fit reads the global one from its data)
        batch_size, batch_source = batch_size * replicas, f"{batch_source}, times {replicas} replicas"
    return ModelInfo(
        name=model.name,
        params=_param_count(weights),
        trainable_params=_param_count(trainable),
        param_bytes=variable_bytes(weights),
        optimizer=_optimizers_name([o for _, o in trainers]),
        optimizer_slots=slots,
        optimizer_bytes=variable_bytes(opt_vars),
        batch_size=batch_size,
        input_shape=_shape_text(use.input_shape),
        dtype_policy=str(policy) if policy else None,
        calls=calls,
        layers=layers,
        trainable_bytes=variable_bytes(trainable),
        samples=use.samples,
        input_array_bytes=sum(a.nbytes for a in training),
        new_weight_bytes=variable_bytes(w for w in weights if w in new_variables),
        optimizer_built_in_cell=any(o in built_optimizers for _, o in trainers),
        batch_source=batch_source,
        feed=use.feed,
        validation=use.validation,
        input_copy_bytes=sum(a.copy_bytes for a in training),
        validation_copy_bytes=sum(a.copy_bytes for a in use.input_arrays if a.validation),
        other_models=[_in_words(o) for o in (others or []) if o is not use and o.model_ref() is not None],
        keras_package=kerases.flavour_of(model),
        # Keras 3 resolves jit_compile="auto" at compile (True with a GPU); tf_keras keeps a bool or None
        jit_compile=getattr(model, "jit_compile", False) is True,
        replicas=replicas,
        optimizers=[f"{label}: {_optimizer_name(o)}" for label, o in trainers] if len(trainers) > 1 else [],
    )


def _replicas_of(model: KerasModel) -> int:
    """How many replicas the model's tf.distribute strategy runs in sync (1 without one): MultiWorkerMirrored
    counts every worker's, so one worker's tensors carry the global batch / this."""
    try:
        n = int(getattr(getattr(model, "distribute_strategy", None), "num_replicas_in_sync", 1) or 1)
    except Exception as exc:  # noqa: BLE001 - a strategy not yet built, or a model without one
        fallback(_log, "the model's strategy could not be read: one replica assumed", exc)
        return 1
    return max(1, n)


def _optimizers_name(optimizers: list[KerasOptimizer]) -> str | None:
    """The class of the optimizer(s) that train the model: "Adam", or "Adam + SGD" when they differ."""
    names = list(dict.fromkeys(n for n in map(_optimizer_name, optimizers) if n))
    return " + ".join(names) or None


def _optimizer_name(optimizer: KerasOptimizer) -> str | None:
    """The class name of the optimizer that keeps the slots: mixed_float16's LossScaleOptimizer (Keras 3) or
    LossScaleOptimizerV3 (tf_keras) wraps the one the user chose and adds only a scale and a counter."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "inner_optimizer", None)
    return type(inner if inner is not None else optimizer).__name__


def _param_count(variables: Iterable[TFTensor]) -> int:
    return sum(int(math.prod(int(d) for d in w.shape)) for w in variables)


def _in_words(use: ModelUse) -> str:
    model = use.model_ref()
    try:
        params = _param_count(kerases.variables_of(model))
    except (TypeError, ValueError):
        params = 0
    calls = ", ".join(c for c in use.calls) or "used"
    return f"{getattr(model, 'name', '?')} ({params:,} parameters; {calls})"


def main_use(uses: list[ModelUse], applied: AppliedOptimizers = ()) -> ModelUse | None:
    """The model use the cell was about: the model that trained (fit, or a custom loop's optimizer), else evaluated,
    predicted or was called; among equals, the one with the most parameters (a GAN's larger network)."""
    alive = [u for u in uses if u.model_ref() is not None]
    if not alive:
        return None

    def rank(use: ModelUse) -> tuple[int, int]:
        calls = list(use.calls) + (["optimizer.apply"] if applied_optimizer(use, applied) is not None else [])
        best = min((_CALL_RANK.get(c, 9) for c in calls), default=9)
        try:
            params = int(use.model_ref().count_params())
        except Exception as exc:  # noqa: BLE001 - not built
            fallback(_log, "a model's parameters could not be counted: taken as 0", exc)
            params = 0
        return best, -params

    return min(alive, key=rank)


# layers whose weights are looked up or scaled per element, not multiplied with the input: their cost is their output
_LOOKUPS = ("Embedding", "BatchNormalization", "LayerNormalization", "GroupNormalization", "Normalization")


def forward_macs_per_sample(model: KerasModel, structure: dict[str, Any] | None = None) -> int | None:
    """About how many multiply-adds one sample's forward pass costs: each layer's weights times the positions it
    applies them at (a Dense's outputs along a sequence, a convolution's output pixels, a recurrent layer's time
    steps), attention's scores, and one per output element. What a probe's step costs grows with it
    (advise/preflight.py caps the replay's probe batches by it). None where a layer's shapes are not known (a
    subclassed model never called on symbolic inputs): nothing is capped then."""
    fed = _fed_shapes(model, structure)
    total = 0
    for layer in _leaf_layers(model):
        macs = _layer_macs(layer, fed.get(id(layer)))
        if macs is None:
            return None
        total += macs
    return total


def _leaf_layers(layer: KerasLayer, depth: int = 0) -> list[KerasLayer]:
    """A model's layers, a model used as a layer by its own."""
    inner = getattr(layer, "layers", None) if kerases.is_model(layer) and depth < 4 else None
    if not inner:
        return [] if depth == 0 else [layer]
    return [leaf for sub in inner[:MAX_LAYERS] for leaf in _leaf_layers(sub, depth + 1)]


def _layer_macs(layer: KerasLayer, fed: tuple[TFTensor, TFTensor] | None) -> int | None:
    if type(layer).__name__ == "InputLayer":
        return 0
    try:
        output = fed[1] if fed is not None else _first(layer.output).shape
        dims = [int(d) for d in output[1:]]
        params = int(layer.count_params())
    except (AttributeError, TypeError, ValueError, IndexError):  # never called symbolically, not built, open dims
        return None
    elements = math.prod(dims)
    kind = type(layer).__name__
    if kind in _LOOKUPS or not params:
        return elements
    attention = _attention_dims(layer)
    if attention is not None:  # the projections at every position, the scores and their weighted sum
        heads, key_dim, t_q, t_k = attention
        return params * max(t_q, t_k) + 2 * heads * key_dim * t_q * t_k + elements
    recurrent = kind == "Bidirectional" or hasattr(layer, "cell")
    if recurrent:
        try:
            steps = int((fed[0] if fed is not None else _first(layer.input).shape)[1])
        except (AttributeError, TypeError, ValueError, IndexError):
            return None
        return params * steps + elements
    return params * math.prod(dims[:-1]) + elements
