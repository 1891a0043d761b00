"""A model's fingerprint (measure/model_print.py): the same model built again has the same one, and anything its step's
memory depends on changes it, a model not built yet included."""

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


class Net(keras.Model):
    """A subclassed model, not built until it is called: no weights to read."""

    def __init__(self, width: int = 8, scale: int = 2, blocks: dict | None = None, heads: int = 2):
        super().__init__()
        self.dense = keras.layers.Dense(width)
        self.attention = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=4)  # heads: a private attribute
        self._scale = scale  # private, read by call: part of the step
        self.blocks = blocks or {"depth": 2}

    def call(self, x):
        return keras.ops.tile(self.dense(x), [1, self._scale])


def test_an_unbuilt_subclassed_model_is_printed_from_its_layers_settings():
    assert Net().weights == []
    assert fingerprint(Net()) is not None and fingerprint(Net()) == fingerprint(Net())


@pytest.mark.parametrize("other", [{"width": 16}, {"scale": 4}, {"blocks": {"depth": 3}}, {"heads": 4}], ids=str)
def test_an_unbuilt_models_settings_change_it_its_private_ones_and_nested_ones_too(other):
    assert fingerprint(Net(**other)) != fingerprint(Net())


def test_an_unbuilt_model_is_another_state_than_the_same_model_built():
    built = Net()
    built(np.zeros((2, 4), "float32"))
    assert fingerprint(built) is not None and fingerprint(built) != fingerprint(Net())
