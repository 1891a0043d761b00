"""A Keras model's structural fingerprint: what its training step's memory depends on, without the names Keras numbers
per instance (`dense_3` against `dense_7`). Two models with the same fingerprint run the same step on the same inputs,
so a step replay made for one judges the other (advise/preflight.py, KeptReplay): a cell that builds its model again
and calls `fit` at the batch a refusal named is judged from the refusal's replay, without new probes.

Safe side first: every part read is something the step's memory can depend on (each layer's class and the code of
classes outside Keras, its plain settings and Keras config, its weights' shapes and dtypes, the optimizer's class,
settings and whether its slots exist, the dtype policy, the compile flags). A subclassed model not built yet has no
weights: its layers' classes, settings and configs stand for them (the key it is kept under holds the inputs'
shapes, which decide the weights' sizes with those settings). Where any part cannot be read (no layer list), there
is no fingerprint and the replay stays keyed on the model object alone (docs/preflight.md, "The next call at the
named batch")."""

from __future__ import annotations

import hashlib
import json
import logging
import types
from collections.abc import Iterable, Iterator
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
    """`value` if it is a plain setting (a number, a string; a tuple, list or string-keyed dict of plain settings),
    else None (not read)."""
    if isinstance(value, _PLAIN):
        return cast(JSONValue, value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value, strict=True)) else None
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        entries = {k: _plain(v) for k, v in value.items()}
        return entries if all(entries[k] is not None or v is None for k, v in value.items()) else None
    return None


def _settings(obj: object) -> dict[str, Any]:
    """The object's public plain attributes: a layer's units, rate, heads, strides, activation name... and for a
    class outside Keras, also the private ones its own code names (`self._scale = 4`): Keras' own private attributes
    (numbered names among them) are left out, the user's are not."""
    out: dict[str, Any] = {}
    own = _own_names(type(obj))
    for key, value in sorted(vars(obj).items()):
        if key in _PER_INSTANCE or key.endswith("_names"):  # input_names: ['input_11']
            continue
        if key.startswith("_") and key not in own:
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


def _user_classes(cls: type) -> list[type]:
    """The classes of `cls`'s MRO written outside Keras and TensorFlow (the user's)."""
    return [k for k in cls.__mro__ if k is not object and k.__module__.split(".")[0] not in _OWN_PACKAGES]


def _code_names(code: types.CodeType, into: set[str]) -> None:
    into.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, into)


def _methods(cls: type) -> Iterator[tuple[str, types.CodeType]]:
    """(name, code) of each method of `cls`'s user classes, by name within each class."""
    for klass in _user_classes(cls):
        for key, value in sorted(vars(klass).items()):
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            if isinstance(code, types.CodeType):
                yield key, code


def _own_names(cls: type) -> frozenset[str]:
    """The names the methods of `cls`'s user classes use (the attributes they set and read among them)."""
    names: set[str] = set()
    for _, code in _methods(cls):
        _code_names(code, names)
    return frozenset(names)


def _class_print(cls: type) -> str:
    """A class's name; for a class outside Keras and TensorFlow (the user's layer or model), also a digest of its
    methods' code: a class written again with other code is another class to the replay."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.split(".")[0] in _OWN_PACKAGES:
        return name
    digest = hashlib.sha1()
    for key, code in _methods(cls):
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


def _loose(value: object, names: frozenset[str]) -> JSONValue:
    """`value` as JSON, with the layers' per-instance `names` ("dense_3") left out and anything not plain (an
    object in a config) by its class's name."""
    if isinstance(value, str):
        return "<a layer's name>" if value in names else value
    if isinstance(value, _PLAIN):
        return cast(JSONValue, value)
    if isinstance(value, (tuple, list)):
        return [_loose(v, names) for v in value]
    if isinstance(value, dict):
        return {str(k): _loose(v, names) for k, v in value.items()}
    return f"<{type(value).__qualname__}>"


def _config(layer: KerasLayer, names: frozenset[str]) -> JSONValue:
    """A layer's Keras config (`get_config`: Keras' own layers keep settings such as MultiHeadAttention's heads in
    private attributes, which an unbuilt layer's weights do not show yet), or None for a model (its layers are
    read one by one) and for a layer whose config cannot be read."""
    if kerases.is_model(layer):
        return None
    try:
        return _loose(layer.get_config(), names)
    except Exception:  # noqa: BLE001 - a user's layer without a config: its settings and code stand for it
        return None


def fingerprint(model: KerasModel) -> str | None:
    """The model's fingerprint (module docstring), or None where it cannot be read whole."""
    try:
        layers = _layers(model)
        if not layers:
            return None
        weights = _weights(model)  # none for an unbuilt model: its layers' settings and the inputs' shapes decide
        names = frozenset(str(getattr(layer, "name", "")) for layer in layers)
        optimizer = getattr(model, "optimizer", None)
        parts = {
            "built": bool(weights),
            "layers": [
                [
                    _class_print(type(layer)),
                    _settings(layer),
                    _config(layer, names),
                    [w[:2] for w in _weights(layer)],
                ]
                for layer in layers
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
