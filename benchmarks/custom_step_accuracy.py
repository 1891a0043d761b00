"""The what-if for custom training, measured: a model that trains in a loop of its own (an overridden `train_step`
with two optimizers, a distiller's `compute_loss`, a GradientTape loop) cannot be cloned into calibration's probe
processes, so its what-if stands on the analytic basis. This script measures that basis, and a candidate
replacement, against real runs at other batches.

The candidate is the cell's own trace replayed: the trace's allocation sequence goes through tfmem's BFC simulator
(analyze/bfc.py) at the cell's batch and at the asked one, each allocation whose shape carries the batch scaled
(`step_replay.shape_lines`), and the prediction is the cell's measured peak plus the change between the two
replays. The cell's trace starts from a warm allocator (the model was built in an earlier cell), so its own
replay need not give back its peak to the byte: only the change is used, and both replays share the seed's error.

The third column is what calibration does for custom training: the cell's own step, saved with its variables
and run by the step replay's two probe processes (advise/step_export.py; `predict(..., calibrate=True)`).

    .venv/bin/python benchmarks/custom_step_accuracy.py [--programs gan,dcgan,distiller,tape] [--batch 32]
                                                        [--batches 16,64] [--runs 2]

Per program it prints the self-check of the cell's trace (its own sequence against TensorFlow's peak) and per
asked batch the real peaks (`--runs` fresh processes, each a cell run under `%%tfmem --quick`'s measurement), the
analytic prediction, the trace replay's and the own step's, each with its error against the nearest real peak.
Results: docs/bfc-replay.md, "The cell's own trace, for custom training" and "The cell's own step, saved".
"""

from __future__ import annotations

import argparse
import json
import textwrap
import time

from _fresh import KEEP_TRACE, run_fresh_json

# each program: code run before the measured cell (model, data; TensorFlow already running), the measured cell
PROGRAMS = {
    # keras-io's DCGAN pattern: a train_step that applies two optimizers of the model's own
    "gan": (
        """
        latent = 64
        disc = keras.Sequential([keras.Input((28, 28, 1)), layers.Conv2D(32, 4, strides=2, padding="same"),
                                 layers.LeakyReLU(0.2), layers.Conv2D(64, 4, strides=2, padding="same"),
                                 layers.LeakyReLU(0.2), layers.Flatten(), layers.Dense(1)])
        gen = keras.Sequential([keras.Input((latent,)), layers.Dense(7 * 7 * 64), layers.Reshape((7, 7, 64)),
                                layers.Conv2DTranspose(64, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
                                layers.Conv2DTranspose(32, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
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
                fake = self.g(tf.random.normal((n, latent)))
                images = tf.concat([fake, real], 0)
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
        data = tf.data.Dataset.from_tensor_slices(np.random.rand(4096, 28, 28, 1).astype("float32"))
        data = data.batch(BATCH).take(8)
    """,
        "gan.fit(data, epochs=1, verbose=0)",
    ),
    # keras-io's DCGAN itself (its discriminator and generator, its train_step with two Adams and a seed generator),
    # at 32x32x3 instead of 64x64x3 (one upsampling less) so that a CPU runs its steps in seconds
    "dcgan": (
        """
        latent = 128
        disc = keras.Sequential([keras.Input((32, 32, 3)), layers.Conv2D(64, 4, strides=2, padding="same"),
                                 layers.LeakyReLU(0.2), layers.Conv2D(128, 4, strides=2, padding="same"),
                                 layers.LeakyReLU(0.2), layers.Conv2D(128, 4, strides=2, padding="same"),
                                 layers.LeakyReLU(0.2), layers.Flatten(), layers.Dropout(0.2),
                                 layers.Dense(1, activation="sigmoid")])
        gen = keras.Sequential([keras.Input((latent,)), layers.Dense(8 * 8 * 128), layers.Reshape((8, 8, 128)),
                                layers.Conv2DTranspose(128, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
                                layers.Conv2DTranspose(256, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
                                layers.Conv2D(3, 5, padding="same", activation="sigmoid")])

        class GAN(keras.Model):
            def __init__(self, discriminator, generator, latent_dim):
                super().__init__()
                self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
                self.seed_generator = keras.random.SeedGenerator(1337)

            def compile(self, d_optimizer, g_optimizer, loss_fn):
                super().compile()
                self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
                self.d_loss_metric = keras.metrics.Mean(name="d_loss")
                self.g_loss_metric = keras.metrics.Mean(name="g_loss")

            def train_step(self, real_images):
                batch_size = tf.shape(real_images)[0]
                noise = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
                combined = tf.concat([self.generator(noise), real_images], axis=0)
                labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
                labels += 0.05 * tf.random.uniform(tf.shape(labels))
                with tf.GradientTape() as tape:
                    d_loss = self.loss_fn(labels, self.discriminator(combined))
                grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
                self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
                noise = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
                with tf.GradientTape() as tape:
                    g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(noise)))
                grads = tape.gradient(g_loss, self.generator.trainable_weights)
                self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
                self.d_loss_metric.update_state(d_loss)
                self.g_loss_metric.update_state(g_loss)
                return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

        gan = GAN(disc, gen, latent)
        gan.compile(keras.optimizers.Adam(1e-4), keras.optimizers.Adam(1e-4), keras.losses.BinaryCrossentropy())
        data = tf.data.Dataset.from_tensor_slices(np.random.rand(1024, 32, 32, 3).astype("float32"))
        data = data.batch(BATCH).take(4)
    """,
        "gan.fit(data, epochs=1, verbose=0)",
    ),
    # keras-io's knowledge distillation (Keras 3): compute_loss overridden, a teacher run inside the step
    "distiller": (
        """
        def conv(width):
            return keras.Sequential([keras.Input((28, 28, 1)), layers.Conv2D(width, 3, strides=2, padding="same"),
                                     layers.LeakyReLU(0.2), layers.Conv2D(2 * width, 3, strides=2, padding="same"),
                                     layers.Flatten(), layers.Dense(10)])

        class Distiller(keras.Model):
            def __init__(self, student, teacher):
                super().__init__()
                self.teacher, self.student = teacher, student

            def compile(self, optimizer, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
                super().compile(optimizer=optimizer)
                self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
                self.alpha, self.temperature = alpha, temperature

            def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
                t = self.temperature
                teacher_pred = self.teacher(x, training=False)
                student_loss = self.student_loss_fn(y, y_pred)
                distillation_loss = self.distillation_loss_fn(keras.ops.softmax(teacher_pred / t, axis=1),
                                                              keras.ops.softmax(y_pred / t, axis=1)) * t ** 2
                return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

            def call(self, x):
                return self.student(x)

        distiller = Distiller(student=conv(16), teacher=conv(64))
        distiller.compile(keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          keras.losses.KLDivergence())
        x = np.random.rand(8 * BATCH, 28, 28, 1).astype("float32")
        y = np.random.randint(0, 10, 8 * BATCH)
    """,
        "distiller.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)",
    ),
    # TensorFlow's "quickstart for experts": a subclassed model, a @tf.function step with a GradientTape
    "tape": (
        """
        class MyModel(keras.Model):
            def __init__(self):
                super().__init__()
                self.conv1 = layers.Conv2D(32, 3, activation="relu")
                self.flatten = layers.Flatten()
                self.d1 = layers.Dense(128, activation="relu")
                self.d2 = layers.Dense(10)

            def call(self, x):
                return self.d2(self.d1(self.flatten(self.conv1(x))))

        model = MyModel()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer = keras.optimizers.Adam()
        train_ds = tf.data.Dataset.from_tensor_slices((np.random.rand(4096, 28, 28, 1).astype("float32"),
                                                       np.random.randint(0, 10, 4096))).shuffle(1000).batch(BATCH)

        @tf.function
        def train_step(images, labels):
            with tf.GradientTape() as tape:
                loss = loss_object(labels, model(images, training=True))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    """,
        "for images, labels in train_ds.take(8):\n    train_step(images, labels)",
    ),
}

HEAD = """
import json, sys
import numpy as np
import tfmem_magic
tfmem_magic.prepare()
import tensorflow as tf, keras
from keras import layers
keras.utils.set_random_seed(0)
tf.constant(0.0)  # TensorFlow runs before the cell, as in a notebook
BATCH = {batch}
"""

# the measured cell as a user runs it: quick (allocator statistics: the real peak), or traced (the trace kept)
REAL = """
with tfmem_magic.profile(mode="quick") as p:
{cell}
print(json.dumps({{"peak": p.report.tf_peak_bytes}}))
"""

TRACED = (
    """
from tfmem_magic.analyze import bfc, step_replay
"""
    + KEEP_TRACE
    + """
with tfmem_magic.profile() as p:
{cell}
report = p.report
events = kept["trace"].events
lines = step_replay.shape_lines(events, BATCH)
asked = {asked}
out = {{"peak": report.tf_peak_bytes, "events": len(events), "scaled": lines.aligned,
        "allocations": lines.allocations, "basis": report.whatif_basis.name if report.whatif_basis else None,
        "calls": report.model.calls if report.model else None,
        "analytic": {{b: tfmem_magic.predict(report, batch_size=b).peak_bytes for b in asked}}}}
# what was live before the trace is seeded packed ("compact", the CPU's default: its regions are separate mallocs,
# so the trace's addresses say nothing of the gaps between them)
own = bfc.self_check(events)

def simulated(b):
    return bfc.replay_prepared(own.prepared, requested=lines.sizes(b),
                               memory_limit=step_replay.UNLIMITED).peak_bytes_in_use

started = __import__("time").perf_counter()
at_cell = simulated(BATCH)
out["replayed"] = {{b: report.tf_peak_bytes + simulated(b) - at_cell for b in asked}}
out["own_error"], out["diverged"] = own.peak_error, own.first_divergence
out["replay_s"] = round(__import__("time").perf_counter() - started, 2)
# the step replay of the cell's own step (advise/step_export.py): calibration saves it, two probes run it
started = __import__("time").perf_counter()
try:
    out["step"] = {{b: tfmem_magic.predict(report, batch_size=b, calibrate=True).peak_bytes for b in asked}}
    out["step_basis"] = report.whatif_basis.name
    out["step_source"] = report.whatif_basis.replay.source if report.whatif_basis.replay else None
    out["step_notes"] = tfmem_magic.predict(report, batch_size=asked[-1]).notes
    out["step_own_error"] = report.whatif_basis.replay.own_error if report.whatif_basis.replay else None
except tfmem_magic.TfmemUsageError as exc:
    out["step"], out["step_basis"] = None, str(exc)[:300]
out["step_s"] = round(__import__("time").perf_counter() - started, 2)
print(json.dumps(out))
"""
)


def run(program: str, batch: int, traced: bool, asked: list[int]) -> dict:
    setup, cell = PROGRAMS[program]
    body = TRACED if traced else REAL
    code = (
        HEAD.format(batch=batch) + textwrap.dedent(setup) + body.format(cell=textwrap.indent(cell, "    "), asked=asked)
    )
    return run_fresh_json(code, f"{program} at batch {batch}")


def error(predicted: float, real: list[int]) -> float:
    """Against the nearest real peak: the real peak at one batch is itself a range (op order, oneDNN's choices)."""
    if min(real) <= predicted <= max(real):
        return 0.0
    nearest = min(real, key=lambda r: abs(predicted - r))
    return (predicted - nearest) / nearest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    asked = [int(b) for b in args.batches.split(",")]
    began = time.perf_counter()
    table: dict[str, list[float]] = {"analytic": [], "replayed": [], "step": []}
    for program in args.programs.split(","):
        cell = run(program, args.batch, True, asked)
        print(
            f"{program}: cell at batch {args.batch} peaked {cell['peak'] / 2**20:.1f} MiB ({cell['basis']} basis, "
            f"calls {cell['calls']}); its trace: {cell['events']} events, {cell['scaled']}/{cell['allocations']} "
            f"allocations batch-shaped; its own replay "
            f"{cell['own_error']:+.1%} of its peak (first divergence at event {cell['diverged']}); "
            f"{cell['replay_s']} s for the replays; calibrated on its own step: {cell['step_basis']} basis in "
            f"{cell['step_s']} s",
            flush=True,
        )
        for b in asked:
            real = [run(program, b, False, asked)["peak"] for _ in range(args.runs)]
            words = []
            for name in table:
                if not cell[name]:  # no prediction on this basis (the calibration said why, above)
                    continue
                predicted = cell[name][str(b)]
                e = error(predicted, real)
                table[name].append(abs(e))
                words.append(f"{name} {predicted / 2**20:7.1f} MiB ({e:+6.1%})")
            print(
                f"  batch {b:>4}: real {', '.join(f'{r / 2**20:.1f}' for r in real)} MiB; " + "; ".join(words),
                flush=True,
            )
    print(
        json.dumps(
            {name: {"max_abs_error": round(max(errs), 4), "points": len(errs)} for name, errs in table.items() if errs}
            | {"seconds": round(time.perf_counter() - began)}
        )
    )


if __name__ == "__main__":
    main()
