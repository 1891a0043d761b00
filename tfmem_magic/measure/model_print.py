"""A Keras model's structural fingerprint: what its training step's memory depends on, without the names Keras numbers
per instance (`dense_3` against `dense_7`). Two models with the same fingerprint run the same step on the same inputs,
so a step replay made for one judges the other (advise/preflight.py, KeptReplay): a cell that builds its model again
and calls `fit` at the batch a refusal named is judged from the refusal's replay, without new probes.

Safe side first: every part read is something the step's memory can depend on (each layer's class and the code of
classes outside Keras, its plain settings, its weights' shapes and dtypes, the optimizer's class, settings and
whether its slots exist, the dtype policy, the compile flags); where any part cannot be read (an unbuilt model, no
layer list), there is no fingerprint and the replay stays keyed on the model object alone (docs/preflight.md, "The
next call at the named batch")."""

from __future__ import annotations

import hashlib
import json
import logging
import types
from collections.abc import Iterable
from typing import Any, cast

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.types import JSONValue, KerasLayer, KerasModel
from tfmem_magic.measure import kerases

_log = logging.getLogger(__name__)

_PLAIN = (int, float, str, bool, type(None))
# attributes that differ per instance and not per step: Keras' numbered names and paths
_PER_INSTANCE = {"name", "path", "built", "trainable", "supports_masking"}
_OWN_PACKAGES = ("keras", "tf_keras", "tensorflow")


def _plain(value: object) -> JSONValue:
    """`value` if it is a plain setting (a number, a string, a tuple or list of them), else None (not read)."""
    if isinstance(value, _PLAIN):
        return cast(JSONValue, value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return [cast(JSONValue, v) for v in value]
    return None


def _settings(obj: object) -> dict[str, Any]:
    """The object's public plain attributes: a layer's units, rate, heads, strides, activation name..."""
    out: dict[str, Any] = {}
    for key, value in sorted(vars(obj).items()):
        if key.startswith("_") or key in _PER_INSTANCE or key.endswith("_names"):  # input_names: ['input_11']
            continue
        plain = _plain(value)
        if plain is not None:
            out[key] = plain
        elif callable(value) and hasattr(value, "__name__"):  # an activation function
            out[key] = f"{getattr(value, '__module__', '')}.{value.__name__}"
    return out


def _code_digest(code: types.CodeType, into: hashlib._Hash) -> None:
    into.update(code.co_code)
    into.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, into)
        else:
            into.update(repr(const).encode())


def _class_print(cls: type) -> str:
    """A class's name; for a class outside Keras and TensorFlow (the user's layer or model), also a digest of its
    methods' code: a class written again with other code is another class to the replay."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.split(".")[0] in _OWN_PACKAGES:
        return name
    digest = hashlib.sha1()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in _OWN_PACKAGES or klass is object:
            continue
        for key, value in sorted(vars(klass).items()):
            function = getattr(value, "__func__", value)
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                digest.update(key.encode())
                _code_digest(code, digest)
    return f"{name}#{digest.hexdigest()[:16]}"


def _layers(model: KerasModel) -> Iterable[Any] | None:
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return None
    return list(flatten(include_self=True, recursive=True))


def _weights(obj: KerasLayer) -> list[list[JSONValue]]:
    return [
        [list(getattr(w, "shape", ()) or ()), str(getattr(w, "dtype", "")), bool(getattr(w, "trainable", True))]
        for w in kerases.variables_of(obj)
    ]


def _loss_print(loss: object) -> JSONValue:
    """A loss by name ("mse"), class and settings (a Loss object), or code (a function); a dict or list of them."""
    if isinstance(loss, dict):
        return {str(k): _loss_print(v) for k, v in sorted(loss.items(), key=lambda kv: str(kv[0]))}
    if isinstance(loss, (list, tuple)):
        return [_loss_print(v) for v in loss]
    if loss is None or isinstance(loss, str):
        return loss
    if isinstance(loss, types.FunctionType):
        digest = hashlib.sha1()
        _code_digest(loss.__code__, digest)
        return f"{loss.__module__}.{loss.__qualname__}#{digest.hexdigest()[:16]}"
    return [_class_print(type(loss)), _settings(loss) if hasattr(loss, "__dict__") else None]


def fingerprint(model: KerasModel) -> str | None:
    """The model's fingerprint (module docstring), or None where it cannot be read whole."""
    try:
        layers = _layers(model)
        weights = _weights(model)
        if not layers or not weights:  # unbuilt: a subclassed model's sizes are not known until it is called
            return None
        optimizer = getattr(model, "optimizer", None)
        parts = {
            "layers": [
                [_class_print(type(layer)), _settings(layer), [w[:2] for w in _weights(layer)]] for layer in layers
            ],
            "weights": weights,
            "policy": str(getattr(getattr(model, "dtype_policy", None), "name", "")),
            "optimizer": None
            if optimizer is None
            else [
                _class_print(type(optimizer)),
                _settings(optimizer),
                len(getattr(optimizer, "variables", None) or ()),
            ],
            "compile": [
                _plain(getattr(model, "jit_compile", None)),
                _plain(getattr(model, "steps_per_execution", None)),
                _plain(getattr(model, "run_eagerly", None)),
                _loss_print(getattr(model, "loss", None)),
            ],
        }
        return hashlib.sha1(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()
    except Exception as exc:  # noqa: BLE001 - a model we cannot read keeps its replay on the object alone
        fallback(_log, "a model's fingerprint could not be read: its replay is kept for the model object", exc)
        return None
