"""What a Keras model holds: parameters, optimizer state and the activations each layer makes per sample."""

from __future__ import annotations

import math
from typing import Any

from .instrument import ModelUse
from .report import LayerInfo, ModelInfo

_CALL_RANK = {"fit": 0, "train_on_batch": 1, "evaluate": 2, "test_on_batch": 3, "predict": 4,
              "predict_on_batch": 5, "__call__": 6}


def _variable_bytes(variables: Any) -> int:
    total = 0
    for v in variables:
        try:
            total += int(math.prod(int(d) for d in v.shape)) * _dtype_size(v.dtype)
        except (TypeError, ValueError):
            continue
    return total


def _dtype_size(dtype: Any) -> int:
    name = str(getattr(dtype, "name", dtype))
    for key, size in (("float64", 8), ("int64", 8), ("complex128", 16), ("complex64", 8), ("float16", 2),
                      ("bfloat16", 2), ("int16", 2), ("uint16", 2), ("int8", 1), ("uint8", 1), ("bool", 1)):
        if key in name:
            return size
    return 4


def _shape_text(shape: Any) -> str | None:
    if shape is None:
        return None
    try:
        return "(" + ", ".join("None" if d is None else str(int(d)) for d in shape) + ")"
    except TypeError:
        return str(shape)


def _internal_bytes(layer: Any) -> int:
    """Per-sample bytes of tensors a layer makes inside itself that its output does not show. Attention: the
    projected query, key and value, and the heads x query x key scores with their softmax."""
    if type(layer).__name__ not in ("MultiHeadAttention", "GroupedQueryAttention"):
        return 0
    try:
        heads = int(getattr(layer, "num_heads", None) or layer.num_query_heads)
        key_dim = int(getattr(layer, "key_dim", None) or layer.head_dim)
        shapes = layer._build_shapes_dict  # Keras 3: the shapes the layer was built with
        query = [int(d) for d in shapes["query_shape"][1:-1]]
        key = [int(d) for d in (shapes.get("key_shape") or shapes["value_shape"])[1:-1]]
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0
    size = _dtype_size(getattr(layer, "compute_dtype", "float32"))
    t_q, t_k = math.prod(query), math.prod(key)
    return size * (heads * key_dim * (t_q + 2 * t_k) + 2 * heads * t_q * t_k)


def _layer_info(layer: Any) -> LayerInfo:
    try:
        shape = layer.output.shape
    except (AttributeError, ValueError):
        shape = None
    per_sample = 0
    if shape is not None:
        try:
            dims = [int(d) for d in shape[1:]]
            per_sample = math.prod(dims) * _dtype_size(getattr(layer, "compute_dtype", "float32"))
        except (TypeError, ValueError):
            per_sample = 0
    per_sample += _internal_bytes(layer)
    try:
        params = int(layer.count_params())
    except ValueError:  # not built
        params = 0
    return LayerInfo(name=layer.name, type=type(layer).__name__, params=params,
                     output_shape=_shape_text(shape), activation_bytes_per_sample=per_sample)


def describe(use: ModelUse, new_variables: Any = (), built_optimizers: Any = ()) -> ModelInfo | None:
    """ModelInfo for a model the cell used; None when it has been garbage-collected. `new_variables` and
    `built_optimizers` are what the cell created (their memory is the cell's)."""
    model = use.model_ref()
    if model is None:
        return None
    weights = list(getattr(model, "weights", []))
    trainable = list(getattr(model, "trainable_weights", []))
    optimizer = getattr(model, "optimizer", None)
    opt_vars = list(getattr(optimizer, "variables", []) or []) if optimizer is not None else []
    # slots per trainable variable: Adam keeps m and v (2), SGD with momentum 1, plain SGD 0
    big_opt_vars = [v for v in opt_vars if len(getattr(v, "shape", ())) > 0]
    slots = round(len(big_opt_vars) / len(trainable)) if trainable else 0
    policy = getattr(getattr(model, "dtype_policy", None), "name", None)
    layers = [_layer_info(layer) for layer in getattr(model, "layers", [])]
    return ModelInfo(
        name=model.name,
        params=sum(int(math.prod(int(d) for d in w.shape)) for w in weights),
        trainable_params=sum(int(math.prod(int(d) for d in w.shape)) for w in trainable),
        param_bytes=_variable_bytes(weights),
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        optimizer_slots=slots,
        optimizer_bytes=_variable_bytes(opt_vars),
        batch_size=use.batch_size,
        input_shape=_shape_text(use.input_shape),
        dtype_policy=str(policy) if policy else None,
        calls=list(use.calls),
        layers=layers,
        trainable_bytes=_variable_bytes(trainable),
        samples=use.samples,
        input_array_bytes=sum(nbytes for _, nbytes in use.input_arrays),
        new_weight_bytes=_variable_bytes(w for w in weights if w in new_variables),
        optimizer_built_in_cell=optimizer is not None and optimizer in built_optimizers,
    )


def main_use(uses: list[ModelUse]) -> ModelUse | None:
    """The model use the cell was about: the model that trained, else evaluated, predicted or was called."""
    alive = [u for u in uses if u.model_ref() is not None]
    if not alive:
        return None
    return min(alive, key=lambda u: min(_CALL_RANK.get(c, 9) for c in u.calls) if u.calls else 9)
