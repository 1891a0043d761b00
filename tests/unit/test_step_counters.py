"""The optimizers' step counters read around a cell (measure/step_counters.py): which names are read, and the words
for the steps a traced loop ran. The optimizers are stand-ins with Keras' module and counter; the real ones run in
tests/integration/test_preflight.py (a GradientTape loop run again once its step is traced)."""

from __future__ import annotations

from tfmem_magic.measure import step_counters


class _Variable:
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def numpy(self) -> int:
        return self.steps


class Optimizer:  # Keras' base class: its counter made in __init__, given by `iterations`
    def __init__(self, steps: int = 0) -> None:
        self._iterations = _Variable(steps)

    @property
    def iterations(self) -> _Variable:
        return self._iterations

    def apply(self, grads, variables=None) -> None:
        self._iterations.steps += 1


class Model:
    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer


class LegacyOptimizer(Optimizer):  # tf_keras' legacy optimizers make the counter when `iterations` is read
    def __init__(self) -> None:
        self._iterations = None

    @property
    def iterations(self) -> _Variable:
        self._iterations = self._iterations or _Variable(0)
        return self._iterations


class LossScaleOptimizer(Optimizer):  # its counter is its inner optimizer's
    def __init__(self, inner: Optimizer) -> None:
        super().__init__()
        self.inner = inner

    @property
    def iterations(self) -> _Variable:
        return self.inner.iterations


for _cls in (Optimizer, Model):
    _cls.__module__ = "keras.src.optimizers.adam"


class Adam(Optimizer):  # a notebook's subclass: its module is __main__, its base is Keras'
    __module__ = "__main__"


class NotKeras:  # the user's object with an `iterations` and an `apply`: not an optimizer of Keras'
    iterations = _Variable(5)

    def apply(self) -> None:
        pass


def test_the_namespaces_optimizers_and_models_optimizers_are_read_once_each():
    opt, other, inner = Adam(3), Adam(10), Adam(7)
    legacy = LegacyOptimizer()
    ns = {
        "opt": opt,
        "model": Model(opt),
        "gan": Model(other),
        "_hidden": Adam(),
        "thing": NotKeras(),
        "Out": {1: Adam()},
        "n": 4,
        "legacy": legacy,
        "scaled": LossScaleOptimizer(inner),
        "inner": inner,
    }
    counters = step_counters.read(ns)
    assert sorted((c.name, c.steps) for c in counters) == [("gan.optimizer", 10), ("opt", 3), ("scaled", 7)]
    assert legacy._iterations is None  # not made by reading it


def test_only_counters_that_moved_are_named():
    opt, idle = Adam(3), Adam(7)
    before = step_counters.read({"opt": opt, "idle": idle})
    assert step_counters.advanced(before) == ""
    for _ in range(32):
        opt.apply([])
    assert step_counters.advanced(before) == "opt (Adam) stepped 32 times"
