"""Lines of the user's code: which source files are the user's, and the line that made each Keras layer.

The report's by-line view (analyze/lines.py) names the line of the user's code that made each tensor. A graph op's
stack (recorded by TensorFlow when the op was traced) runs through TensorFlow, Keras and the standard library: the
user's frame is the innermost one outside them (`is_user_file`). A built-in layer's ops have no user frame inside
the layer: their stack ends at the `fit(...)` line, and what a person wants there is the line that made the layer (a
`Dense(4096)` in a notebook cell). So while tfmem is loaded in a kernel (`%load_ext tfmem_magic`) or a measurement
runs, `Layer.__init__` of each Keras (Keras 3, tf_keras) is wrapped and notes the line that created the layer, once
per layer, in `SESSION.layer_sites`. A Keras imported later is wrapped as its layer module finishes importing (an
import hook that looks for two module names only). `release` puts everything back when the last holder lets go.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable, Sequence
from types import FrameType, ModuleType
from typing import Any

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.types import KerasLayer, NotebookValue

_log = logging.getLogger(__name__)

# the module that defines each Keras' Layer class: patched as soon as it has run, before the package finishes importing
LAYER_MODULES = {"keras.src.layers.layer": "keras", "tf_keras.src.engine.base_layer": "tf_keras"}
# packages whose frames are never the user's (with the standard library and everything installed in site-packages)
LIBRARY_PACKAGES = ("tensorflow", "keras", "tf_keras", "tensorboard", "absl", "numpy", "IPython", "ipykernel")
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# the frames of Keras' fit/evaluate/predict: an op whose user frame calls one of them was made by Keras' own step
KERAS_ENTRIES = frozenset({"fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch"})
_KERAS_DIRS = (os.sep + "keras" + os.sep, os.sep + "tf_keras" + os.sep)
_user_files: dict[str, bool] = {}
_library_roots: list[str] = []
_roots_seen: list[int] = [-1]  # how many of LIBRARY_PACKAGES were imported when the roots were read


def _roots() -> list[str]:
    """Folders whose files are library code: the standard library, site-packages, tfmem, and the packages above
    wherever they are installed (a development checkout of TensorFlow included). Read again when one of them has
    been imported since."""
    imported = [m for name in LIBRARY_PACKAGES if (m := sys.modules.get(name)) is not None]
    if len(imported) != _roots_seen[0]:
        paths = sysconfig.get_paths()
        roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tfmem_magic/
        for module in imported:
            path = getattr(module, "__file__", None)
            if path:
                roots.add(os.path.dirname(os.path.abspath(path)))
        _library_roots[:] = sorted(r.rstrip(os.sep) + os.sep for r in roots if r)
        _roots_seen[0] = len(imported)
        _user_files.clear()
    return _library_roots


def is_user_file(filename: str) -> bool:
    """A frame in this file is the user's: a notebook cell (IPython names it `/tmp/ipykernel_<pid>/<hash>.py` or
    `<ipython-input-3-...>`), a script, a module of the user's project. Not TensorFlow, Keras, tf_keras, tfmem, the
    standard library or anything installed in site-packages; not Python's frozen modules."""
    known = _user_files.get(filename)
    if known is not None:
        return known
    roots = _roots()
    if filename.startswith("<"):
        user = not filename.startswith("<frozen")
    else:
        path = os.path.abspath(filename)
        user = not any(part in path for part in _INSTALLED) and not any(path.startswith(r) for r in roots)
    if len(_user_files) < 10_000:
        _user_files[filename] = user
    return user


def is_keras_entry(filename: str, function: str) -> bool:
    """A frame of Keras' (or tf_keras') fit, evaluate, predict or their `*_on_batch`: an op made under it, with no
    frame of the user's in between, is Keras' own step's."""
    return function in KERAS_ENTRIES and any(d in filename for d in _KERAS_DIRS)


# ---- the line that made each layer ----------------------------------------------------------------------------


def site_of(layer: KerasLayer) -> tuple[str, int] | None:
    """(file, line) of the user's code that created the layer, if it was created while tfmem was loaded."""
    entry = SESSION.layer_sites.get(id(layer))
    if entry is None or entry[0]() is not layer:
        return None
    return entry[1], entry[2]


def _note(layer: KerasLayer, frame: FrameType | None) -> None:
    """Note the innermost user frame outside the layer's own constructors (`super().__init__()` of a custom layer
    is not where it was made; a layer a custom layer's `__init__` makes is made there)."""
    sites: dict[int, tuple[weakref.ref[Any], str, int]] = SESSION.layer_sites
    key = id(layer)
    entry = sites.get(key)
    if entry is not None and entry[0]() is layer:
        return  # a second Layer.__init__ in the chain of one object (a Model's)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename) and not (code.co_name == "__init__" and frame.f_locals.get("self") is layer):
            break
        frame = frame.f_back
    if frame is None:
        return

    def forget(_: object, key: int = key) -> None:
        if sites.get(key) is new:
            del sites[key]

    try:
        new = (weakref.ref(layer, forget), frame.f_code.co_filename, frame.f_lineno)
    except TypeError:  # not weak-referenceable: its line could later name another object
        return
    sites[key] = new


def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: KerasLayer, *args: NotebookValue, **kwargs: NotebookValue) -> None:
        __tracebackhide__ = True  # noqa: F841 (IPython leaves tfmem's wrapper out of the user's traceback)
        if _holders:
            try:
                _note(self, sys._getframe(1))
            except Exception as exc:  # noqa: BLE001 - a layer's line is a detail: never the user's failed layer
                fallback(_log, "a layer's creation line could not be noted", exc)
        original(self, *args, **kwargs)

    # Keras 3 reads a layer's constructor arguments with both inspect.signature (which follows __wrapped__) and
    # inspect.getfullargspec (which does not, but reads __signature__): both must see Keras' own parameters
    __init__.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    __init__.__tfmem_sites__ = True  # type: ignore[attr-defined]
    return __init__


EXTENSION = "the extension"  # the holder while `%load_ext tfmem_magic` is loaded
_holders: set[object] = set()
_patched: dict[str, tuple[type, object, object]] = {}  # module -> (Layer class, original __init__, our wrapper)


def _patch(module_name: str, module: ModuleType | None = None) -> None:
    module = module if module is not None else sys.modules.get(module_name)
    layer = getattr(module, "Layer", None)
    if module_name in _patched or not isinstance(layer, type):
        return
    original = layer.__dict__.get("__init__")
    if original is None or getattr(original, "__tfmem_sites__", False):
        return
    wrapper = _wrap_init(original)
    layer.__init__ = wrapper  # type: ignore[misc]
    _patched[module_name] = (layer, original, wrapper)


def _unpatch() -> None:
    for layer, original, wrapper in _patched.values():
        if layer.__dict__.get("__init__") is wrapper:  # else someone patched on top of ours: leave theirs
            layer.__init__ = original  # type: ignore[misc]
    _patched.clear()


class _LoaderAfter(importlib.abc.Loader):
    """The real loader of a Keras layer module, patching its Layer class once the module has run."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _holders:
            try:
                _patch(self._name, module)
            except Exception as exc:  # noqa: BLE001 - never the user's failed import
                fallback(_log, "a Keras layer class could not be wrapped for its creation lines", exc)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - the real loader's other methods (get_source, ...)
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a Keras layer module, the spec the other finders give, with its loader wrapped."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in LAYER_MODULES:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _LoaderAfter(spec.loader, fullname)
            return spec  # type: ignore[no-any-return]
        return None


_finder = _Finder()


def hold(holder: object) -> None:
    """Note layers' creation lines while `holder` (the extension, a running measurement) wants them."""
    _holders.add(holder)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    for name in LAYER_MODULES:
        if name in sys.modules:
            _patch(name)


def release(holder: object) -> None:
    """`holder` no longer wants the lines; the last one out puts Keras' `Layer.__init__` back."""
    _holders.discard(holder)
    if _holders:
        return
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _unpatch()


def holding() -> bool:
    return bool(_holders)
