"""Optimizers' step counters, read before and after a cell: the custom training loop that calls no Python update.

tfmem sees a custom loop's update where Python calls it (`Instrumentation._remember_apply`): every step of an eager
loop, but only the tracing of a `tf.function` step. A cell that runs an already-traced step again (the second run of a
training cell, the most common one in a notebook) calls no Python update at all. Each update still advances its
optimizer's `iterations` counter, so the counters of the optimizers the user's namespace names, read at the cell's
start and end, tell that such a loop ran (the pre-flight's note: pipeline._unchecked_loop). Reading one is a scalar
copy off a variable (microseconds); only the top level of the namespace is looked at, and a model's `.optimizer`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

_SKIP = {"In", "Out", "_", "__", "___", "exit", "quit", "get_ipython"}


@dataclass
class Counter:
    optimizer: weakref.ref[Any]
    name: str  # how the user reaches it: "opt", "model.optimizer"
    steps: int


def _is_optimizer(value: Any) -> bool:
    """A Keras 3 or tf_keras optimizer (its class from either package, and an `iterations` counter)."""
    module = type(value).__module__ or ""
    return module.startswith(("keras", "tf_keras")) and hasattr(value, "iterations") and (
        hasattr(value, "apply") or hasattr(value, "apply_gradients"))


def _steps(optimizer: Any) -> int | None:
    try:
        return int(optimizer.iterations.numpy())
    except Exception:  # not built yet (tf_keras makes the counter on first use), or not readable
        return None


def read(namespace: dict[str, Any] | None) -> list[Counter]:
    """The step counters of the optimizers the namespace names, directly or as a Keras model's `.optimizer`."""
    found: dict[int, Counter] = {}
    for name, value in list((namespace or {}).items()):
        if not isinstance(name, str) or name.startswith("_") or name in _SKIP:
            continue
        try:  # a proxy or lazy object may raise on any attribute: it is no optimizer of the user's loop
            keras_object = (type(value).__module__ or "").startswith(("keras", "tf_keras"))
            candidates = [(name, value), (f"{name}.optimizer", getattr(value, "optimizer", None) if keras_object
                                          else None)]
            candidates = [(label, c) for label, c in candidates if c is not None and _is_optimizer(c)]
        except Exception:
            continue
        for label, candidate in candidates:
            if id(candidate) in found:
                continue
            steps = _steps(candidate)
            if steps is not None:
                try:
                    found[id(candidate)] = Counter(weakref.ref(candidate), label, steps)
                except TypeError:  # not weak-referenceable
                    continue
    return list(found.values())


def advanced(before: list[Counter]) -> str:
    """The updates counted since `before`, in words ("32 updates of opt (Adam)"), or "" when none advanced."""
    moved = []
    for counter in before:
        optimizer = counter.optimizer()
        steps = _steps(optimizer) if optimizer is not None else None
        if steps is not None and steps > counter.steps:
            moved.append(f"{steps - counter.steps} updates of {counter.name} ({type(optimizer).__name__})")
    return ", ".join(moved)
