"""A model's fingerprint (measure/model_print.py): the same model built again has the same one, and anything its step's
memory depends on changes it; a model it cannot read whole has none (its replay stays keyed on the object)."""

from __future__ import annotations

import numpy as np
import pytest

from tfmem_magic.measure.model_print import fingerprint

keras = pytest.importorskip("keras")


def mlp(units: int = 64, activation: str = "relu", optimizer: str = "adam", loss: str = "mse"):
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(units, activation=activation), keras.layers.Dense(1)]
    )
    model.compile(optimizer, loss)
    return model


def test_the_same_model_built_again_has_the_same_fingerprint():
    first, again = mlp(), mlp()
    assert first.layers[0].name != again.layers[0].name  # Keras numbers each instance: not part of it
    assert fingerprint(first) is not None and fingerprint(first) == fingerprint(again)


@pytest.mark.parametrize(
    "other", [{"units": 128}, {"activation": "tanh"}, {"optimizer": "sgd"}, {"loss": "mae"}], ids=str
)
def test_what_the_step_depends_on_changes_it(other):
    assert fingerprint(mlp(**other)) != fingerprint(mlp())


def test_a_slot_built_optimizer_is_another_state():
    model = mlp()
    before = fingerprint(model)
    model.fit(np.zeros((8, 32), "float32"), np.zeros((8, 1), "float32"), verbose=0)
    assert fingerprint(model) != before


def test_a_layer_class_written_again_with_other_code_changes_it():
    def model(cls):
        inputs = keras.Input((8,))
        m = keras.Model(inputs, keras.layers.Dense(1)(cls()(keras.layers.Dense(8)(inputs))))
        m.compile("adam", "mse")
        return m

    class Twice(keras.layers.Layer):
        def call(self, x):
            return keras.ops.tile(x, [1, 2])

    class Four(keras.layers.Layer):
        def call(self, x):
            return keras.ops.tile(x, [1, 4])

    Four.__name__ = Four.__qualname__ = Twice.__qualname__
    Four.__module__ = Twice.__module__
    assert fingerprint(model(Twice)) == fingerprint(model(Twice))
    assert fingerprint(model(Twice)) != fingerprint(model(Four))


def test_an_unbuilt_subclassed_model_has_none():
    class Net(keras.Model):
        def __init__(self, width):
            super().__init__()
            self.dense = keras.layers.Dense(width)

        def call(self, x):
            return self.dense(x)

    assert fingerprint(Net(8)) is None  # its sizes are not known before it is called
