"""Optimizers' step counters, read before and after a cell: the custom training loop that calls no Python update.

tfmem sees a custom loop's update where Python calls it (`Instrumentation._remember_apply`): every step of an eager
loop, but only the tracing of a `tf.function` step. A cell that runs an already-traced step again (the second run of a
training cell, the most common one in a notebook) calls no Python update at all. Each update still advances its
optimizer's `iterations` counter, so the counters of the optimizers the user's namespace names, read at the cell's
start and end, tell that such a loop ran (the pre-flight's note: pipeline._unchecked_loop). Reading one is a scalar
copy off a variable (microseconds); only the top level of the namespace is looked at, and a model's `.optimizer`,
and only in a cell the pre-flight is on for. A counter moved otherwise (a checkpoint restored with its optimizer,
`iterations.assign`) reads as steps too: the note says how the loop was seen, "by its step counter".
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.types import KerasOptimizer, NotebookValue, TFTensor

_log = logging.getLogger(__name__)

_SKIP = {"In", "Out", "_", "__", "___", "exit", "quit", "get_ipython"}


@dataclass
class Counter:
    optimizer: weakref.ref[KerasOptimizer]
    name: str  # how the user reaches it: "opt", "model.optimizer"
    steps: int


def _of_keras(value: NotebookValue) -> bool:
    """An object of a Keras 3 or tf_keras class, or of a class derived from one (a notebook's `class GAN(Model)`)."""
    try:
        return any((cls.__module__ or "").startswith(("keras", "tf_keras")) for cls in type(value).__mro__)
    except Exception as exc:  # noqa: BLE001 - a notebook object's class may raise on inspection
        fallback(_log, "a value's class could not be inspected: not an optimizer", exc)
        return False


def _counter(value: NotebookValue) -> TFTensor | None:
    """The optimizer's step counter variable, or None: only one that exists already (reading `iterations` of a
    tf_keras legacy optimizer makes its variable; a LossScaleOptimizer's is its inner optimizer's, which its
    `iterations` gives)."""
    try:
        if (
            not _of_keras(value)
            or vars(value).get("_iterations") is None
            or not (hasattr(type(value), "apply") or hasattr(type(value), "apply_gradients"))
        ):
            return None
        return value.iterations
    except Exception as exc:  # noqa: BLE001 - a notebook object may raise on any attribute
        fallback(_log, "an optimizer's step counter could not be read", exc)
        return None


def _steps(counter: TFTensor) -> int | None:
    try:
        return int(counter.numpy())
    except Exception as exc:  # noqa: BLE001 - a graph's variable, a counter on a device that cannot be read now
        fallback(_log, "a step counter's value could not be read", exc)
        return None


def read(namespace: dict[str, NotebookValue] | None) -> list[Counter]:
    """The step counters of the optimizers the namespace names, directly or as a Keras model's `.optimizer` (each
    counter once: a LossScaleOptimizer and its inner optimizer share one)."""
    found: dict[int, Counter] = {}
    for name, value in list((namespace or {}).items()):
        if not isinstance(name, str) or name.startswith("_") or name in _SKIP:
            continue
        try:  # a proxy or lazy object may raise on any attribute: it is no optimizer of the user's loop
            candidates = [(name, value)]
            if _of_keras(value) and not isinstance(value, type):
                candidates.append(
                    (f"{name}.optimizer", vars(value).get("optimizer") or getattr(value, "optimizer", None))
                )
            counters = [(label, c, _counter(c)) for label, c in candidates if c is not None]
        except Exception as exc:  # noqa: BLE001 - a proxy or lazy object may raise on any attribute
            fallback(_log, "a name's optimizer could not be read: skipped", exc)
            continue
        for label, optimizer, counter in counters:
            steps = None if counter is None or id(counter) in found else _steps(counter)
            if steps is None:
                continue
            try:
                found[id(counter)] = Counter(weakref.ref(optimizer), label, steps)
            except TypeError:  # not weak-referenceable
                continue
    return list(found.values())


def advanced(before: list[Counter]) -> str:
    """The steps counted since `before`, in words ("opt (Adam) stepped 32 times"), or "" when none advanced."""
    moved = []
    for counter in before:
        optimizer = counter.optimizer()
        variable = _counter(optimizer) if optimizer is not None else None
        steps = _steps(variable) if variable is not None else None
        if steps is not None and steps > counter.steps:
            moved.append(f"{counter.name} ({type(optimizer).__name__}) stepped {steps - counter.steps} times")
    return ", ".join(moved)
