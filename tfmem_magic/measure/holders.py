"""Who holds TensorFlow memory after a cell: the names in the user's namespace that reach variables, tensors and
Keras models, and what only TensorFlow's runtime keeps (its gradient registry, docs/held-memory.md).

The walk goes *down* from the names a user typed, never up from the tensors through `gc.get_referrers`: a path from
a name is what a person can act on (`models.clear()`, `del results`), and going down is bounded by the namespace.
It stops at a depth, a number of items per container and a time budget, and says when it stopped early.

What it walks into: lists, tuples, dicts, sets, IPython's output cache (`Out[7]`), Keras callbacks (a `History`
holds its model), objects and functions the notebook itself defined (their attributes, closures and default
arguments). What it counts: Keras models and layers (their weights, and a model's optimizer variables), optimizers,
`tf.Variable`s and Keras variables, eager tensors. Each buffer is counted once per name. No IPython in here.
"""

from __future__ import annotations

import logging
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import Holder
from tfmem_magic.core.sizes import variable_bytes
from tfmem_magic.core.types import KerasLayer, KerasOptimizer, NotebookValue, TFTensor
from tfmem_magic.measure import kerases

_log = logging.getLogger(__name__)

MAX_DEPTH = 4  # `results[4096].model` is depth 2; a History in a dict in a list in an object is 4
MAX_ITEMS = 2000  # items looked at per container (a list of a million floats is not a holder)
BUDGET_S = 0.25  # the whole walk, per cell
MAX_PATHS = 6  # paths kept per holder, to a leaf each (`results[4096].model`)
# names IPython keeps for itself (their outputs are reached through `Out`, which names them as people do)
_SKIP = {
    "In",
    "_ih",
    "_oh",
    "_dh",
    "_i",
    "_ii",
    "_iii",
    "exit",
    "quit",
    "get_ipython",
    "__builtins__",
    "__builtin__",
    "__name__",
    "__doc__",
    "__spec__",
    "__loader__",
    "__package__",
    "_sh",
}
_LAST_OUTPUTS = ("_", "__", "___")  # aliases of the newest outputs: looked at after every other name
_ATOMS = {int, float, bool, str, bytes, complex, type(None)}  # they hold no TensorFlow memory: skipped at once


@dataclass
class Leaf:
    """One thing that owns TensorFlow memory, found under a name."""

    kind: str  # "Keras model", "Keras layer", "optimizer", "variable", "tensor"
    label: str  # the model's name, or the tensor's shape
    variables: list[TFTensor] = field(default_factory=list)  # what it owns (a tensor is its own)
    optimizer: KerasOptimizer = None  # a model's optimizer, or the optimizer itself: its variables are new when it is


@dataclass
class Walk:
    """The walk's result: one Holder per name that reaches TensorFlow memory, largest first."""

    holders: list[Holder] = field(default_factory=list)
    handles: set[int] = field(default_factory=set)  # ids of the resource handles of every variable reached
    complete: bool = True  # False: the time budget ran out before every name was walked


class _Kinds:
    """The classes that mark a leaf, from the TensorFlow and Keras already imported (nothing is imported here)."""

    def __init__(self) -> None:
        kerases_loaded = [mod for _, mod in kerases.loaded()]
        self.models = tuple(m.Model for m in kerases_loaded)
        self.layers = tuple(getattr(m.layers, "Layer", type(None)) for m in kerases_loaded)
        self.optimizers = kerases.optimizer_classes()
        self.callbacks = tuple(
            c for m in kerases_loaded if isinstance(c := getattr(getattr(m, "callbacks", None), "Callback", None), type)
        )
        tf = sys.modules.get("tensorflow")
        keras3 = kerases.module(kerases.KERAS3)
        self.variables = tuple(
            c for c in (getattr(tf, "Variable", None), getattr(keras3, "Variable", None)) if isinstance(c, type)
        )
        self.tensors = tuple(c for c in (getattr(tf, "Tensor", None),) if isinstance(c, type))

    def leaf(self, obj: NotebookValue) -> Leaf | None:
        if self.models and isinstance(obj, self.models):
            optimizer = getattr(obj, "optimizer", None)
            return Leaf(
                "Keras model",
                str(getattr(obj, "name", "model")),
                _weights(obj) + (optimizer_variables(optimizer) if optimizer is not None else []),
                optimizer,
            )
        if self.layers and isinstance(obj, self.layers):
            return Leaf("Keras layer", str(getattr(obj, "name", "layer")), _weights(obj))
        if self.optimizers and isinstance(obj, self.optimizers):
            return Leaf("optimizer", type(obj).__name__, optimizer_variables(obj), obj)
        if self.variables and isinstance(obj, self.variables):
            return Leaf("variable", str(getattr(obj, "name", "variable")), [obj])
        if self.tensors and isinstance(obj, self.tensors) and hasattr(obj, "numpy"):  # eager, not symbolic
            tensor: TFTensor = obj
            dtype = str(getattr(tensor.dtype, "name", tensor.dtype))
            if dtype in ("resource", "variant", "string"):
                return None
            return Leaf("tensor", f"{dtype}{list(tensor.shape)}", [tensor])
        return None


def _weights(layer: KerasLayer) -> list[TFTensor]:
    try:
        return list(layer.weights)
    except Exception as exc:  # noqa: BLE001 - a layer that is not built, or whose weights raise
        fallback(_log, "a layer's weights could not be read: skipped", exc)
        return []


def optimizer_variables(optimizer: KerasOptimizer) -> list[TFTensor]:
    """All of an optimizer's variables (tf_keras' legacy optimizers give them by a method); [] when unreadable."""
    try:
        found = optimizer.variables
        return list(found() if callable(found) else found)  # tf_keras' legacy optimizers: a method
    except Exception as exc:  # noqa: BLE001 - optimizers of any Keras may raise here
        fallback(_log, "an optimizer's variables could not be read: none counted", exc)
        return []


def handle_id(variable: TFTensor) -> int | None:
    """id() of the eager resource handle behind a tf.Variable or Keras 3 variable (what a traced graph captures)."""
    inner = getattr(variable, "_value", variable)  # Keras 3 wraps a tf.Variable
    try:
        handle = getattr(inner, "handle", None)
    except Exception as exc:  # noqa: BLE001 - a variable of a graph (no eager handle)
        fallback(_log, "a variable's handle could not be read: not matched", exc)
        return None
    return None if handle is None else id(handle)


def walk(
    namespace: dict[str, NotebookValue] | None,
    is_new: Callable[[NotebookValue], bool] = lambda _: False,
    changed: set[str] | frozenset[str] = frozenset(),
    budget_s: float = BUDGET_S,
) -> Walk:
    """Every name in `namespace` that reaches TensorFlow memory. What the cell made counts as the holder's
    `new_bytes`: a variable for which `is_new(variable)` holds, the variables of an optimizer for which it holds,
    and a tensor under a name in `changed` (the names the cell bound or rebound)."""
    out = Walk()
    if not namespace:
        return out
    kinds = _Kinds()
    if not (kinds.variables or kinds.tensors or kinds.models):
        return out  # neither TensorFlow nor Keras is imported: nothing can hold their memory
    deadline = time.perf_counter() + budget_s
    names = [
        n
        for n in list(namespace)
        if isinstance(n, str) and n not in _SKIP and n not in _LAST_OUTPUTS and not _numbered(n)
    ]
    names.sort(key=lambda n: (n == "Out", n.startswith("_"), n))
    owners: dict[int, list[str]] = {}  # id(variable or tensor) -> the names that reach it
    found: list[tuple[str, str, list[tuple[str, Leaf]]]] = []
    # `_`, `__` and `___` are aliases of the newest outputs, which `Out` already names as people do
    outputs = namespace.get("Out")
    seen_objects = {id(v) for v in outputs.values()} if isinstance(outputs, dict) else set()
    for name in [*names, *(n for n in _LAST_OUTPUTS if n in namespace)]:
        if time.perf_counter() > deadline:
            out.complete = False
            break
        value = namespace.get(name)
        if name in _LAST_OUTPUTS and id(value) in seen_objects:
            continue
        reached = list(_leaves(value, name, kinds, deadline))
        if not reached:
            continue
        found.append((name, _kind_of(value, kinds), reached))
        for _, leaf in reached:
            for v in leaf.variables:
                owners.setdefault(id(v), [])
                if name not in owners[id(v)]:
                    owners[id(v)].append(name)
                handle = handle_id(v)
                if handle is not None:
                    out.handles.add(handle)
    for name, kind, reached in found:
        out.holders.append(_holder(name, kind, reached, owners, is_new, name in changed))
    out.holders.sort(key=lambda h: -h.bytes)
    out.holders = [h for h in out.holders if h.bytes > 0]
    return out


def _numbered(name: str) -> bool:
    """IPython's `_7`, `_i7`: aliases of `Out[7]` and `In[7]`."""
    return name.startswith("_") and name.lstrip("_i").isdigit() and name not in _LAST_OUTPUTS


def _holder(
    name: str,
    kind: str,
    reached: list[tuple[str, Leaf]],
    owners: dict[int, list[str]],
    is_new: Callable[[NotebookValue], bool],
    rebound: bool,
) -> Holder:
    """One Holder for `name`: each variable and tensor counted once, whatever path reached it. A tensor is the
    cell's when the cell bound or rebound the name (`rebound`), a variable when `is_new` says so."""
    unique: dict[int, NotebookValue] = {}
    fresh: dict[int, NotebookValue] = {}
    for _, leaf in reached:
        built_here = leaf.optimizer is not None and _safe_new(is_new, leaf.optimizer)
        slots = {id(v) for v in optimizer_variables(leaf.optimizer)} if built_here else set()
        for v in leaf.variables:
            unique.setdefault(id(v), v)
            if (rebound and leaf.kind == "tensor") or id(v) in slots or _safe_new(is_new, v):
                fresh.setdefault(id(v), v)
    values = list(unique.values())
    others = sorted({n for v in values for n in owners.get(id(v), []) if n != name})
    leaves = [leaf for _, leaf in reached]
    return Holder(
        name=name,
        kind=kind,
        bytes=variable_bytes(values),
        new_bytes=variable_bytes(fresh.values()),
        models=[leaf.label for leaf in leaves if leaf.kind == "Keras model"],
        model_bytes=[variable_bytes(leaf.variables) for leaf in leaves if leaf.kind == "Keras model"],
        tensors=sum(1 for leaf in leaves if leaf.kind == "tensor"),
        variables=sum(len(leaf.variables) for leaf in leaves if leaf.kind in ("variable", "Keras layer", "optimizer")),
        paths=[path for path, _ in reached[:MAX_PATHS]],
        shared_with=others[:5],
    )


def _safe_new(is_new: Callable[[NotebookValue], bool], value: NotebookValue) -> bool:
    try:
        return bool(is_new(value))
    except Exception as exc:  # noqa: BLE001 - a notebook object may raise on any attribute
        fallback(_log, "whether a value is new could not be told: taken as old", exc)
        return False


def _kind_of(value: NotebookValue, kinds: _Kinds) -> str:
    """What the name is, in the words a person uses."""
    leaf = kinds.leaf(value)
    if leaf is not None:
        return leaf.kind
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return type(value).__name__
    if isinstance(value, types.FunctionType):
        return "function"
    if kinds.callbacks and isinstance(value, kinds.callbacks):
        return type(value).__name__  # "History", a callback
    return type(value).__name__


def _leaves(root: NotebookValue, name: str, kinds: _Kinds, deadline: float) -> Iterator[tuple[str, Leaf]]:
    """(path, leaf) under `root`, breadth first (the shortest path to each), each object visited once."""
    level: list[tuple[str, NotebookValue]] = [(name, root)]
    visited: set[int] = set()
    for _depth in range(MAX_DEPTH + 1):
        following: list[tuple[str, NotebookValue]] = []
        for path, obj in level:
            if type(obj) in _ATOMS or id(obj) in visited:
                continue
            visited.add(id(obj))
            try:  # an object whose attributes raise (a __getattr__ of the notebook's) is skipped, not the walk
                leaf = kinds.leaf(obj)
                if leaf is not None:
                    yield path, leaf
                    continue
                following.extend(
                    (path + step, child) for step, child in _children(obj, kinds) if type(child) not in _ATOMS
                )
            except Exception as exc:  # noqa: BLE001 - a notebook object whose attributes raise is skipped, not the walk
                fallback(_log, "an object of the notebook's raised while walked: skipped", exc)
                continue
            if time.perf_counter() > deadline:
                return
        if not following:
            return
        level = following


def _key_text(key: object) -> str:
    if isinstance(key, str) and len(key) > 40:
        key = key[:37]  # a dict keyed by whole documents: never repr() the whole key
    text = repr(key) if isinstance(key, (str, int, float, tuple)) else "…"
    return text if len(text) <= 40 else text[:37] + "…"


def _children(obj: NotebookValue, kinds: _Kinds) -> list[tuple[str, NotebookValue]]:
    """(path step, child) of what the walk goes into from `obj` (see the module's docstring for which objects)."""
    if isinstance(obj, (type, types.ModuleType)):
        return []
    if isinstance(obj, dict):  # islice: a dict of ten million entries is never copied whole
        return [(f"[{_key_text(k)}]", v) for k, v in islice(obj.items(), MAX_ITEMS)]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(islice(obj, MAX_ITEMS))]
    if isinstance(obj, (set, frozenset)):
        return [(" (an item)", v) for v in islice(obj, MAX_ITEMS)]
    if isinstance(obj, types.FunctionType):
        if obj.__module__ != "__main__":
            return []
        cells = []
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            try:
                cells.append((f" (closes over {var})", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        defaults = [(" (a default argument)", d) for d in (obj.__defaults__ or ())]
        return cells + defaults + [(f" (default {k})", v) for k, v in (obj.__kwdefaults__ or {}).items()]
    python_function = getattr(obj, "python_function", None)  # a tf.function: the Python function it wraps
    if isinstance(python_function, types.FunctionType) and type(obj).__module__.startswith("tensorflow"):
        return _children(python_function, kinds)
    own = (
        type(obj).__module__ == "__main__"
        or isinstance(obj, types.SimpleNamespace)
        or (bool(kinds.callbacks) and isinstance(obj, kinds.callbacks))
    )
    attrs = getattr(obj, "__dict__", None) if own else None
    if not isinstance(attrs, dict):
        return []
    return [(f".{_attribute_name(type(obj), k)}", v) for k, v in islice(attrs.items(), MAX_ITEMS) if isinstance(k, str)]


def _attribute_name(cls: type, key: str) -> str:
    """`model` for a Keras callback's `_model`: the name a person types (the property over the private slot)."""
    public = key.lstrip("_")
    return public if key != public and isinstance(getattr(cls, public, None), property) else key
