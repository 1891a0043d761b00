"""The optimizers' step counters read around a cell (measure/step_counters.py): which names are read, and the words
for the updates a traced loop ran. The optimizers are stand-ins with Keras' module and counter; the real one runs in
tests/integration/test_preflight.py (a GradientTape loop run again once its step is traced)."""

from __future__ import annotations

from tfmem_magic.measure import step_counters


class _Counter:
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def numpy(self) -> int:
        return self.steps


def _keras(cls: type) -> type:
    cls.__module__ = "keras.src.optimizers.adam"
    return cls


@_keras
class Adam:
    def __init__(self, steps: int = 0) -> None:
        self.iterations = _Counter(steps)

    def apply(self, grads, variables=None):
        self.iterations.steps += 1


@_keras
class Sequential:
    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer


class NotKeras:  # an object of the user's with an `iterations` and an `apply`: not an optimizer of Keras'
    iterations = _Counter(5)

    def apply(self) -> None:
        pass


def test_the_namespaces_optimizers_and_models_optimizers_are_read_once_each():
    opt, other = Adam(3), Adam(10)
    ns = {"opt": opt, "model": Sequential(opt), "gan": Sequential(other), "_hidden": Adam(), "thing": NotKeras(),
          "Out": {1: Adam()}, "n": 4}
    counters = step_counters.read(ns)
    assert sorted((c.name, c.steps) for c in counters) == [("gan.optimizer", 10), ("opt", 3)]


def test_only_counters_that_moved_are_named():
    opt, idle = Adam(3), Adam(7)
    before = step_counters.read({"opt": opt, "idle": idle})
    assert step_counters.advanced(before) == ""
    for _ in range(32):
        opt.apply([])
    assert step_counters.advanced(before) == "32 updates of opt (Adam)"


def test_an_optimizer_whose_counter_cannot_be_read_is_left_out():
    class Unbuilt(Adam):  # tf_keras makes its counter on first use
        @property
        def iterations(self):
            raise AttributeError("iterations")

        @iterations.setter
        def iterations(self, value):
            pass

    assert step_counters.read({"opt": _keras(Unbuilt)()}) == []
