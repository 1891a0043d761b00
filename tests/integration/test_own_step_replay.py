"""Custom training calibrates on its own step (issue 29): a model whose `train_step` is its own (keras-io's DCGAN
pattern, two optimizers) and a GradientTape loop's `@tf.function` step (TensorFlow's quickstart for experts) are
not clones of a Keras config, so calibration saves the step the cell ran, with its variables, and the step replay's
two probe processes run it (advise/step_export.py). Each program runs as a notebook does, in a fresh process
(model and data first, TensorFlow running, then the measured cell), and the prediction at twice the cell's batch is
compared with a fresh process that runs the cell at that batch."""

from __future__ import annotations

import textwrap

import pytest
from fresh import run_python

pytestmark = pytest.mark.slow

HEAD = """
import json
import numpy as np
import tfmem_magic
tfmem_magic.prepare()
import tensorflow as tf, keras
from keras import layers
keras.utils.set_random_seed(0)
tf.constant(0.0)  # TensorFlow runs before the cell, as in a notebook
BATCH = {batch}
"""

GAN = """
latent = 32
disc = keras.Sequential([keras.Input((28, 28, 1)), layers.Conv2D(32, 4, strides=2, padding="same"),
                         layers.LeakyReLU(0.2), layers.Conv2D(64, 4, strides=2, padding="same"),
                         layers.LeakyReLU(0.2), layers.Flatten(), layers.Dense(1)])
gen = keras.Sequential([keras.Input((latent,)), layers.Dense(7 * 7 * 32), layers.Reshape((7, 7, 32)),
                        layers.Conv2DTranspose(32, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
                        layers.Conv2DTranspose(16, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
                        layers.Conv2D(1, 5, padding="same", activation="sigmoid")])

class GAN(keras.Model):
    def __init__(self, d, g):
        super().__init__()
        self.d, self.g = d, g

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, real):
        n = tf.shape(real)[0]
        images = tf.concat([self.g(tf.random.normal((n, latent))), real], 0)
        labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.d(images))
        grads = tape.gradient(d_loss, self.d.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.d.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((n, 1)), self.d(self.g(tf.random.normal((n, latent)))))
        grads = tape.gradient(g_loss, self.g.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.g.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}

gan = GAN(disc, gen)
gan.compile(keras.optimizers.Adam(1e-4), keras.optimizers.Adam(1e-4),
            keras.losses.BinaryCrossentropy(from_logits=True))
data = tf.data.Dataset.from_tensor_slices(np.random.rand(2048, 28, 28, 1).astype("float32")).batch(BATCH).take(6)
"""

TAPE = """
class MyModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv1 = layers.Conv2D(32, 3, activation="relu")
        self.flatten = layers.Flatten()
        self.d1 = layers.Dense(64, activation="relu")
        self.d2 = layers.Dense(10)

    def call(self, x):
        return self.d2(self.d1(self.flatten(self.conv1(x))))

model = MyModel()
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam()
train_ds = tf.data.Dataset.from_tensor_slices((np.random.rand(1024, 28, 28, 1).astype("float32"),
                                               np.random.randint(0, 10, 1024))).batch(BATCH)

@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        loss = loss_object(labels, model(images, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
"""

PROGRAMS = {"gan": (GAN, "gan.fit(data, epochs=1, verbose=0)"),
            "tape": (TAPE, "for images, labels in train_ds.take(6):\n    train_step(images, labels)")}


def program(name: str, batch: int, after: str) -> str:
    setup, cell = PROGRAMS[name]
    return (HEAD.format(batch=batch) + textwrap.dedent(setup) + "with tfmem_magic.profile() as p:\n"
            + textwrap.indent(cell, "    ") + "\n" + textwrap.dedent(after))


CALIBRATED = """
report = p.report
before = tfmem_magic.predict(report, batch_size=64)
what = tfmem_magic.predict(report, batch_size=64, calibrate=True)
curve = report.whatif_basis.replay
print(json.dumps({"before": before.basis, "basis": what.basis, "band": what.error_band, "peak": what.peak_bytes,
                  "notes": what.notes, "source": curve.source, "own_error": curve.own_error,
                  "cell": report.tf_peak_bytes}))
"""


@pytest.mark.parametrize("name, step", [("gan", "GAN.train_step"), ("tape", "a GradientTape loop's step")])
def test_custom_training_calibrates_on_the_step_the_cell_ran(name, step):
    out = run_python(program(name, 32, CALIBRATED))
    assert out["before"] == "analytic"  # no clone: until calibrated, the parts model
    assert out["basis"] == "replay" and out["source"] == "step" and out["own_error"] <= 0.01, out
    assert any(step in note for note in out["notes"]), out["notes"]
    real = run_python(program(name, 64, 'print(json.dumps({"peak": p.report.tf_peak_bytes}))'))["peak"]
    # the band the replay earned on the zoo is 15%; these small steps' peaks vary by up to 13% between two fresh
    # runs (benchmarks/custom_step_accuracy.py), so a run is compared within 25%
    assert abs(out["peak"] - real) <= 0.25 * real, (out["peak"], real, out["cell"])
