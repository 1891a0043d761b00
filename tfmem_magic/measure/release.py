"""Give back what TensorFlow still holds for models that are gone, without a restart: `tfmem_magic.free()` and
`%tfmem free [NAME ...]`.

Why it is needed (measured, docs/held-memory.md). On TF 2.21 a trained Keras 3 (or tf_keras) model's weights and
optimizer slots stay in TensorFlow's allocator after `del model`, `keras.backend.clear_session()` and
`gc.collect()`. The holder is TensorFlow's global gradient registry. Keras' optimizer sums gradients through the
default replica context's `all_reduce`, a `@tf.custom_gradient`. Traced inside the train function, that registers a
gradient closure under `CustomGradient-<uid>` (`tensorflow/python/ops/custom_gradient.py`), which is never removed.
The closure holds the traced graph, and the graph's captures hold every variable's resource handle. A live handle
keeps its buffer. One entry per traced train function, so every model ever fitted stays pinned (tensorflow#97697).

What releases it: dropping those registry entries, then a garbage collection. Both `ops._gradient_registry` and
its `_registry` dict are private (measure/capabilities.py checks them; without them, `free` clears what the public
calls can and says the rest is held). What dropping them gives up: a gradient taken *from outside* a tf.function
that was traced before, through a `@tf.custom_gradient` inside it, needs the function traced again (Keras takes
its gradients inside its train function, so `fit` is unaffected, measured: a live model fits again after `free`).

No IPython here: the adapter drops the user's names and prints `Released.text()`.
"""

from __future__ import annotations

import gc
import logging
import math
import sys
from dataclasses import dataclass, field

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import Holder
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.core.types import NotebookValue, TFGraph, TFTensor
from tfmem_magic.measure import capabilities, holders, kerases
from tfmem_magic.measure.sampling import bytes_in_use, main_tf_device, process_rss

_log = logging.getLogger(__name__)

PREFIX = "CustomGradient-"
STILL_HELD_MIN = 2**20  # a name that reaches this much is listed as still holding memory after free()
ENTRY_MIN_BYTES = 4096  # unreachable bytes that make a registry entry one that holds a model's memory


@dataclass
class Released:
    """What `free()` did and what came back."""

    dropped: list[str] = field(default_factory=list)  # the names dropped from the namespace
    device: str | None = None  # the TensorFlow device whose allocator was read
    tf_before: int | None = None  # its bytes in use before, after (None: no allocator statistics)
    tf_after: int | None = None
    rss_before: int = 0
    rss_after: int = 0
    purged: int = 0  # gradient registry entries dropped
    registry_readable: bool = True  # the private registry was there to purge
    still_held: list[Holder] = field(default_factory=list)  # names that still reach TensorFlow memory after it

    @property
    def freed(self) -> int | None:
        return None if self.tf_before is None or self.tf_after is None else self.tf_before - self.tf_after

    def text(self) -> str:
        parts = [f"Dropped {', '.join(self.dropped)}." if self.dropped else ""]
        if self.freed is None:
            parts.append(
                "TensorFlow's allocator keeps no statistics here (TensorFlow has not run, or its CPU "
                "allocator is not BFC): what came back cannot be read."
            )
        else:
            parts.append(
                f"TensorFlow's allocator on {self.device}: {format_bytes(self.tf_before or 0)} in use before, "
                f"{format_bytes(self.tf_after or 0)} after ({format_bytes(max(self.freed, 0))} given back)."
            )
        if self.purged:
            parts.append(
                f"{self.purged} traced gradient function(s) TensorFlow kept for models that are gone were "
                "dropped (its gradient registry pins a fitted model's weights and slots: "
                "docs/held-memory.md)."
            )
        if not self.registry_readable:
            parts.append(
                "TensorFlow's gradient registry (a private API) is not where tfmem expects it in this "
                "version: trained models' memory may stay held until the kernel restarts."
            )
        if self.still_held:
            named = "; ".join(f"{h.name} ({h.kind}) {format_bytes(h.bytes)}" for h in self.still_held[:6])
            more = f" and {len(self.still_held) - 6} more" if len(self.still_held) > 6 else ""
            names = " ".join(h.name for h in self.still_held[:3] if h.name != "Out")
            how = (
                [f"%tfmem free {names} drops them (a list or dict you keep using: .clear() it instead)"]
                if names
                else []
            )
            if any(h.name == "Out" for h in self.still_held):
                how.append("%reset -f out empties IPython's output cache")
            parts.append(f"Still held by names in the notebook: {named}{more}. " + "; ".join(how) + ".")
        parts.append(
            f"The process's RSS: {format_bytes(self.rss_before)} → {format_bytes(self.rss_after)}: the "
            "allocator keeps its regions and reuses them for the next tensors (a GPU's reservation stays "
            "too), so RSS does not shrink; what was given back is room for later cells."
        )
        return " ".join(p for p in parts if p)


def free(namespace: dict[str, NotebookValue] | None = None, names: tuple[str, ...] | list[str] = ()) -> Released:
    """Drop `names` from `namespace`, clear every imported Keras' session, drop the gradient functions TensorFlow
    keeps for traced train functions, collect, and say what TensorFlow's allocator gave back. A name that is not
    there is a KeyError before anything is dropped."""
    missing = [n for n in names if namespace is None or n not in namespace]
    if missing:
        raise KeyError(", ".join(missing))
    out = Released(rss_before=process_rss())
    out.device = main_tf_device()
    out.tf_before = bytes_in_use(out.device)
    for name in names:
        assert namespace is not None  # `missing` above holds every name when there is no namespace
        del namespace[name]
        out.dropped.append(name)
    for _, keras in kerases.loaded():
        backend = getattr(keras, "backend", None)
        if backend is not None and hasattr(backend, "clear_session"):
            backend.clear_session()
    out.registry_readable = capabilities.check().get("gradient registry", False)
    if out.registry_readable:
        out.purged = purge_custom_gradients()
    gc.collect()
    out.tf_after = bytes_in_use(out.device)
    out.rss_after = process_rss()
    if namespace is not None and out.tf_after is not None:
        try:  # the memory is already given back: a failed walk costs only the list of what is still held
            out.still_held = [h for h in holders.walk(namespace).holders if h.bytes >= STILL_HELD_MIN]
        except Exception as exc:  # noqa: BLE001 - the memory is given back already; the walk only lists holders
            fallback(_log, "the walk of what still holds memory failed after %tfmem free", exc)
            out.still_held = []
    return out


def purge_custom_gradients() -> int:
    """Drop TensorFlow's `CustomGradient-*` registry entries (private: see the module's docstring); how many."""
    ops = sys.modules.get("tensorflow.python.framework.ops")
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    if not isinstance(registry, dict):
        return 0
    stale = [name for name in registry if isinstance(name, str) and name.startswith(PREFIX)]
    for name in stale:
        del registry[name]
    return len(stale)


@dataclass
class Pinned:
    """What TensorFlow's gradient registry keeps alive that no name reaches."""

    bytes: int = 0  # the values of the variables whose resource handles its traced graphs capture
    entries: int = 0  # registry entries holding them
    readable: bool = True  # the private registry was where tfmem expects it
    # alive, but reached by no name of the notebook: most often a model in a reference cycle that the garbage
    # collector has not reached yet (it becomes `bytes` at the next collection)
    unnamed_bytes: int = 0


def registry_pinned(reachable_handles: set[int] | frozenset[int] = frozenset()) -> Pinned:
    """The variables captured by the graphs of TensorFlow's `CustomGradient-*` registry entries that no Python object
    holds any more: what only the registry keeps, and what `free()` gives back. Follows each entry's gradient closure
    (three closures deep: `internal_grad_fn` -> `tape_grad_fn` -> its `result` tensors) to the traced `FuncGraph`,
    whose `captures` are (eager handle, placeholder) pairs; a handle's `_handle_data` says its variable's shape and
    dtype. Whether the variable is alive comes from the graph itself: a `FuncGraph` keeps weak references to the
    variables it uses (`_weak_variables`), so a captured handle whose variable is dead is held by the registry alone.
    A graph without them (another TensorFlow) falls back on `reachable_handles`, the handles of the variables the
    notebook's names reach."""
    ops = sys.modules.get("tensorflow.python.framework.ops")
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    if not isinstance(registry, dict):
        return Pinned(readable=ops is None)
    graphs: dict[int, TFGraph] = {}
    holding: dict[int, set[int]] = {}  # id(graph) -> registry entries (by index) that reach it
    for index, (name, entry) in enumerate(list(registry.items())):
        if not (isinstance(name, str) and name.startswith(PREFIX) and isinstance(entry, dict)):
            continue
        for graph in _graphs_of(entry.get("type")):
            graphs[id(graph)] = graph
            holding.setdefault(id(graph), set()).add(index)
    sizes: dict[int, int] = {}
    unnamed: dict[int, int] = {}
    per_entry: dict[int, int] = {}
    for key, graph in graphs.items():
        alive = _live_handles(graph)
        for handle in _captured_handles(graph):
            if id(handle) in (reachable_handles if alive is None else alive):
                if id(handle) not in reachable_handles:
                    unnamed.setdefault(id(handle), _handle_bytes(handle))
                continue
            size = sizes.setdefault(id(handle), _handle_bytes(handle))
            for index in holding[key]:
                per_entry[index] = per_entry.get(index, 0) + size
    # an entry of a model still in use may pin a few counters no object holds: it does not hold a model's memory
    entries = sum(1 for size in per_entry.values() if size >= ENTRY_MIN_BYTES)
    return Pinned(bytes=sum(sizes.values()), entries=entries, unnamed_bytes=sum(unnamed.values()))


def _live_handles(graph: TFGraph) -> set[int] | None:
    """ids of the resource handles of the graph's variables that are still alive; None when the graph keeps no weak
    references to its variables."""
    refs = getattr(graph, "_weak_variables", None)
    if not isinstance(refs, list):
        return None
    alive: set[int] = set()
    for ref in refs:
        variable = ref() if callable(ref) else None
        if variable is None:
            continue
        try:
            alive.add(id(variable.handle))
        except Exception as exc:  # noqa: BLE001 - a variable of a strategy outside its replica context: count it alive, never freed
            fallback(_log, "a graph's captured variables could not be read: counted alive", exc)
            alive.update(id(h) for h in _captured_handles(graph))
    return alive


def _graphs_of(function: object, depth: int = 0) -> list[TFGraph]:
    """The traced graphs a gradient function's closures reach (tensors' `.graph`, when it has `captures`)."""
    found = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            graph = getattr(item, "graph", None) if not callable(item) else None
            if graph is not None and hasattr(graph, "captures"):
                found.append(graph)
        if callable(value) and depth < 3:
            found.extend(_graphs_of(value, depth + 1))
    return found


def _captured_handles(graph: TFGraph) -> list[TFTensor]:
    try:
        return [
            external
            for external, _ in graph.captures
            if str(getattr(getattr(external, "dtype", None), "name", "")) == "resource"
        ]
    except Exception as exc:  # noqa: BLE001 - a graph whose captures cannot be read in this version
        fallback(_log, "a graph's captures could not be read", exc)
        return []


def _handle_bytes(handle: TFTensor) -> int:
    """Bytes of the variable behind an eager resource handle, from its handle data (0 when unknown)."""
    try:
        total = 0
        for item in handle._handle_data.shape_and_type:
            if item.shape.unknown_rank or any(d.size < 0 for d in item.shape.dim):
                continue
            total += math.prod(d.size for d in item.shape.dim) * _dtype_enum_size(item.dtype)
        return total
    except Exception as exc:  # noqa: BLE001 - handle data is private and version-dependent
        fallback(_log, "a resource handle's size could not be read: taken as 0", exc)
        return 0


def _dtype_enum_size(enum: int) -> int:
    tf_dtypes = sys.modules.get("tensorflow.python.framework.dtypes")
    try:
        return int(tf_dtypes.as_dtype(enum).size)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - a dtype enum from another TensorFlow version
        fallback(_log, "a dtype's size could not be read: 4 bytes assumed", exc)
        return 4
