"""The two Keras a TensorFlow process can run: Keras 3 (`keras`) and tf_keras (Keras 2, what `tf.keras` is under
`TF_USE_LEGACY_KERAS=1`: many courses, older code bases, TF Hub models). Both can be imported at once (TensorFlow
depends on Keras 3 while `tf.keras` is tf_keras), so the question is asked per model: which Keras made it.

Only `sys.modules` is read here: nothing imports Keras on its own."""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

KERAS3, TF_KERAS = "keras", "tf_keras"
LEGACY_ENV = "TF_USE_LEGACY_KERAS"


def legacy_requested() -> bool:
    """`TF_USE_LEGACY_KERAS` is on: `tf.keras` is tf_keras (TensorFlow reads it at `import tensorflow`)."""
    return os.environ.get(LEGACY_ENV, "").strip().lower() in ("1", "true", "yes")


def module(name: str) -> ModuleType | None:
    """The imported Keras of that name (KERAS3 or TF_KERAS), None when it is not imported (or `keras` is Keras 2,
    which TensorFlow before 2.16 installed: not a Keras 3)."""
    found = sys.modules.get(name)
    if found is None or not hasattr(found, "Model") or not hasattr(found, "layers"):
        return None
    if name == KERAS3 and str(getattr(found, "__version__", "3")).split(".")[0] not in ("3", "4"):
        return None
    return found


def loaded() -> list[tuple[str, ModuleType]]:
    """Every Keras imported in this process, Keras 3 first."""
    return [(name, mod) for name in (KERAS3, TF_KERAS) if (mod := module(name)) is not None]


def optimizer_classes() -> tuple[type, ...]:
    """The optimizer base class of every Keras imported (`isinstance` against it tells any of their optimizers)."""
    return tuple(
        c for _, mod in loaded() if isinstance(c := getattr(getattr(mod, "optimizers", None), "Optimizer", None), type)
    )


def flavour_of(obj: object) -> str:
    """KERAS3 or TF_KERAS: which Keras defined the object's class (a model, a layer, an optimizer)."""
    for klass in type(obj).__mro__:
        root = (getattr(klass, "__module__", "") or "").split(".")[0]
        if root in (KERAS3, TF_KERAS):
            return root
    return in_use()


def is_model(obj: object) -> bool:
    """Whether `obj` is a Keras model (a Model, Functional or Sequential of either Keras), not a plain layer."""
    return any(c.__name__ in ("Model", "Functional", "Sequential") for c in type(obj).__mro__)


def in_use() -> str:
    """The Keras a user's `tf.keras` code gets: tf_keras under TF_USE_LEGACY_KERAS when it is installed."""
    if legacy_requested() and (module(TF_KERAS) is not None or _installed(TF_KERAS)):
        return TF_KERAS
    return KERAS3


def import_flavour(name: str) -> ModuleType:
    """Import and return that Keras (KERAS3 or TF_KERAS), for code that must build with it: callbacks, clones."""
    if name == TF_KERAS:
        import tf_keras

        legacy: ModuleType = tf_keras  # an untyped module (Any to mypy)
        return legacy
    import keras

    keras3: ModuleType = keras
    return keras3


def version(name: str) -> str | None:
    mod = module(name)
    if mod is None:
        return None
    return str(getattr(mod, "__version__", "")) or None


def _installed(name: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def variables_of(obj: object, kind: str = "weights") -> list[Any]:
    """`obj.weights` (or another list of its variables: "trainable_weights", "trainable_variables"), [] where it has
    none. tf_keras raises ValueError where a model is not built yet and holds a Sequential with no input shape
    (keras-io's NER Transformer before its first call): its variables do not exist yet, so there are none."""
    try:
        return list(getattr(obj, kind, None) or ())
    except (ValueError, RuntimeError):
        return []
