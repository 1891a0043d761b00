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
import sys
from dataclasses import dataclass, field
from typing import Any

import psutil

from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import capabilities, environment, kerases
from tfmem_magic.measure.sampling import main_tf_device, memory_info

PREFIX = "CustomGradient-"


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

    @property
    def freed(self) -> int | None:
        return None if self.tf_before is None or self.tf_after is None else self.tf_before - self.tf_after

    def text(self) -> str:
        parts = [f"Dropped {', '.join(self.dropped)}." if self.dropped else ""]
        if self.freed is None:
            parts.append("TensorFlow's allocator keeps no statistics here (TensorFlow has not run, or its CPU "
                         "allocator is not BFC): what came back cannot be read.")
        else:
            parts.append(f"TensorFlow's allocator on {self.device}: {format_bytes(self.tf_before or 0)} in use before, "
                         f"{format_bytes(self.tf_after or 0)} after ({format_bytes(max(self.freed, 0))} given back).")
        if self.purged:
            parts.append(f"{self.purged} traced gradient function(s) TensorFlow kept for models that are gone were "
                         "dropped (its gradient registry pins a fitted model's weights and slots: "
                         "docs/held-memory.md).")
        if not self.registry_readable:
            parts.append("TensorFlow's gradient registry (a private API) is not where tfmem expects it in this "
                         "version: trained models' memory may stay held until the kernel restarts.")
        parts.append(f"The process's RSS: {format_bytes(self.rss_before)} → {format_bytes(self.rss_after)}: the "
                     "allocator keeps its regions and reuses them for the next tensors (a GPU's reservation stays "
                     "too), so RSS does not shrink; what was given back is room for later cells.")
        return " ".join(p for p in parts if p)


def free(namespace: dict[str, Any] | None = None, names: tuple[str, ...] | list[str] = ()) -> Released:
    """Drop `names` from `namespace`, clear every imported Keras' session, drop the gradient functions TensorFlow
    keeps for traced train functions, collect, and say what TensorFlow's allocator gave back. A name that is not
    there is a KeyError before anything is dropped."""
    missing = [n for n in names if namespace is None or n not in namespace]
    if missing:
        raise KeyError(", ".join(missing))
    out = Released(rss_before=_rss())
    out.device = main_tf_device()
    out.tf_before = _in_use(out.device)
    for name in names:
        del namespace[name]  # type: ignore[index]
        out.dropped.append(name)
    for _, keras in kerases.loaded():
        backend = getattr(keras, "backend", None)
        if backend is not None and hasattr(backend, "clear_session"):
            backend.clear_session()
    out.registry_readable = capabilities.check().get("gradient registry", False)
    if out.registry_readable:
        out.purged = purge_custom_gradients()
    gc.collect()
    out.tf_after = _in_use(out.device)
    out.rss_after = _rss()
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


def _in_use(device: str | None) -> int | None:
    if device is None or not environment.tensorflow_initialized():
        return None
    info = memory_info(device)
    return info["current"] if info else None


def _rss() -> int:
    return psutil.Process().memory_info().rss
