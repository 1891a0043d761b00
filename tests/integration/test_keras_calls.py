"""Keras code as people write it runs unchanged under %%tfmem, and the report describes the call the user made:
validation (split and data), callbacks in every form Keras accepts, calls Keras makes inside fit, tf.data pipelines
whose batch is not the last step, generators, custom loops, models used as layers, classes defined in the notebook.
Each test here failed before the change that made it pass (issue: real Keras code)."""

from __future__ import annotations

import textwrap

import pytest

from tfmem_magic.measure import feeding

pytestmark = pytest.mark.slow

SETUP = """
import numpy as np, keras, tensorflow as tf
from keras import layers
keras.utils.set_random_seed(0)
def small_cnn(name="cnn"):
    m = keras.Sequential([keras.Input((16, 16, 1)), layers.Conv2D(8, 3, activation="relu", name="conv"),
                          layers.Flatten(name="flat"), layers.Dense(10, activation="softmax", name="head")], name=name)
    m.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    return m
x = np.random.rand(600, 16, 16, 1).astype("float32")
y = keras.utils.to_categorical(np.random.randint(0, 10, 600), 10).astype("float32")
"""


def run(shell, cell: str):
    result = shell.run_cell(cell)
    assert result.error_in_exec is None, result.error_in_exec
    assert result.error_before_exec is None, result.error_before_exec
    return result


def test_validation_split_runs_and_the_report_describes_the_training_call(shell):
    run(shell, SETUP + "model = small_cnn()")
    run(shell, "%%tfmem --as r\nh = model.fit(x, y, batch_size=50, epochs=2, validation_split=0.1, verbose=0)")
    report, history = shell.user_ns["r"], shell.user_ns["h"]
    assert report.status == "ok"
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    m = report.model
    assert m.name == "cnn" and m.calls == ["fit"]  # fit's own evaluate is not a call of the user's
    assert m.samples == 540 and m.batch_size == 50 and m.batch_source == "batch_size argument"
    assert m.validation is not None and "60 of 600 rows" in m.validation
    row = 16 * 16 * 4 + 10 * 4
    assert m.input_copy_bytes == 540 * row and m.validation_copy_bytes == 60 * row
    # whatever copies TensorFlow made, each is named as training or validation data by its exact size
    sizes = {540 * 16 * 16 * 4: "training", 540 * 40: "training", 60 * 16 * 16 * 4: "validation", 60 * 40: "validation"}
    assert all(sizes.get(c.requested_bytes) == c.role for c in report.trace.input_copies)
    # the train and test steps share a name: not a retrace
    assert "retracing" not in {f.id for f in report.findings}


def test_validation_data_and_every_callbacks_form_keras_accepts(shell):
    run(
        shell,
        SETUP
        + """
model = small_cnn()
class Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__(); self.epochs = 0; self.predicted = None
    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1
        self.predicted = self.model.predict(x[:7], verbose=0).shape  # Keras-internal style: a call inside fit
stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=5)
""",
    )
    for form in ("[Counter(), stop]", "(Counter(), stop)", "Counter()", "None"):
        run(
            shell,
            f"%%tfmem --as r\ncb = {form}\n"
            "h = model.fit(x, y, batch_size=60, epochs=2, validation_data=(x[:100], y[:100]), callbacks=cb, "
            "verbose=0)",
        )
        report, history = shell.user_ns["r"], shell.user_ns["h"]
        assert "val_loss" in history.history and report.status == "ok", form
        assert report.model.calls == ["fit"] and report.model.samples == 600, form  # not the callback's predict
        assert report.model.validation == "validation_data: 100 rows"
    run(shell, "%%tfmem --as r\nc = Counter()\nh = model.fit(x, y, epochs=2, callbacks=c, verbose=0)")
    assert shell.user_ns["c"].epochs == 2 and shell.user_ns["c"].predicted == (7, 10)
    # a CallbackList the user built is theirs: left alone, and the report says what was not added
    run(
        shell,
        "%%tfmem --as r\ncl = keras.callbacks.CallbackList([Counter()], model=model)\n"
        "h = model.fit(x, y, epochs=1, callbacks=cl, verbose=0)",
    )
    assert any("CallbackList" in n for n in shell.user_ns["r"].notes)


def test_predict_in_a_loop_is_not_retracing_and_fit_twice_is_not_either(shell):
    run(shell, SETUP + "model = small_cnn()")
    run(shell, "%%tfmem --as r\nfor i in range(5):\n    p = model.predict(x[:64], verbose=0)")
    assert "retracing" not in {f.id for f in shell.user_ns["r"].findings}
    run(
        shell,
        "%%tfmem --as r\nfor v in (None, (x[:64], y[:64])):\n"
        "    model.fit(x, y, epochs=1, validation_data=v, verbose=0)",
    )
    assert "retracing" not in {f.id for f in shell.user_ns["r"].findings}


def test_new_pipelines_in_a_loop_are_not_one_function_retraced(shell):
    """Each tf.data `map` (as in a loop of `adapt()` calls) makes a new function, each traced once. (Counting by name
    gave 8 traces here. The case that tripped the real-code suite, a freed function's cache id passing to the next,
    depends on the allocator and does not reproduce on demand; the counter now holds the caches for the cell.)"""
    run(shell, "import gc, tensorflow as tf")
    run(
        shell,
        "%%tfmem --quick --as r\nfor i in range(8):\n"
        "    list(tf.data.Dataset.range(4).map(lambda v: v + 1))\n    gc.collect()",
    )
    report = shell.user_ns["r"]
    assert report.tf_function_traces.get("Dataset_map_lambda") == 1
    assert "retracing" not in {f.id for f in report.findings}


def test_the_batch_of_a_pipeline_whose_last_step_is_not_batch(shell):
    run(shell, SETUP + "model = small_cnn()")
    cases = {
        "tf.data.Dataset.from_tensor_slices((x, y)).batch(40).map(lambda a, b: (a * 2, b)).prefetch(2)": (
            40,
            "the dataset's .batch()",
        ),
        "tf.data.Dataset.from_tensor_slices((x, y)).batch(24, drop_remainder=True).prefetch(tf.data.AUTOTUNE)": (
            24,
            "the dataset's element_spec",
        ),
        "tf.data.Dataset.from_tensor_slices((x, y)).shuffle(100).batch(16).cache().repeat()": (
            16,
            "the dataset's .batch()",
        ),
    }
    for pipeline, (batch, source) in cases.items():
        steps = ", steps_per_epoch=5" if "repeat" in pipeline else ""
        run(shell, f"%%tfmem --as r\nds = {pipeline}\nmodel.fit(ds, epochs=1, verbose=0{steps})")
        m = shell.user_ns["r"].model
        assert (m.batch_size, m.batch_source, m.feed) == (batch, source, "dataset"), pipeline
        assert m.input_array_bytes == 0  # a pipeline's tensors are not fit's copy of numpy arrays
    # a generator: the first batch it yields, and it is still consumed exactly as before
    run(
        shell,
        "%%tfmem --as r\n"
        "def batches():\n    for i in range(0, 600, 30):\n        yield x[i:i + 30], y[i:i + 30]\n"
        "h = model.fit(batches(), epochs=1, verbose=0)",
    )
    m = shell.user_ns["r"].model
    assert (m.batch_size, m.batch_source, m.feed) == (30, "the generator's first batch", "generator")
    from tfmem_magic.core.session import SESSION

    remembered = SESSION.models[id(shell.user_ns["r"])]
    # what the calibration probes will make: batches like the cell's
    assert remembered[2]["y"] == {feeding.LEAF: [[10], "float32"]}
    # a PyDataset that does not say its batch: its first batch (what Keras asks for first) tells
    run(
        shell,
        """%%tfmem --as r
class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return x[i * 60:(i + 1) * 60], y[i * 60:(i + 1) * 60]
model.fit(Batches(), epochs=1, verbose=0)""",
    )
    report = shell.user_ns["r"]
    assert (report.model.batch_size, report.model.batch_source) == (60, "the PyDataset's first batch")
    assert report.model.feed == "pydataset"
    # a pipeline of batches made elsewhere (from_generator, leading dimension None, no .batch()): unknown, and no
    # what-if pretends to know it
    run(
        shell,
        """%%tfmem --as r
def made_elsewhere():
    for i in range(10):
        yield x[i * 60:(i + 1) * 60], y[i * 60:(i + 1) * 60]
spec = (tf.TensorSpec((None, *x.shape[1:]), "float32"), tf.TensorSpec((None, *y.shape[1:]), "float32"))
model.fit(tf.data.Dataset.from_generator(made_elsewhere, output_signature=spec), epochs=1, verbose=0)""",
    )
    import tfmem_magic
    from tfmem_magic.core.errors import TfmemUsageError

    report = shell.user_ns["r"]
    assert report.model.batch_size is None and report.model.feed == "dataset"
    with pytest.raises(TfmemUsageError, match="batch size could not be read"):
        tfmem_magic.predict(report, batch_size=64)
    assert not any(f.id == "shrink-batch" for f in report.fixes)


def test_custom_training_loop_and_a_gan_like_pair_of_models(shell):
    run(
        shell,
        SETUP
        + """
generator = keras.Sequential([keras.Input((8,)), layers.Dense(16 * 16, name="g_dense"),
                              layers.Reshape((16, 16, 1))], name="generator")
discriminator = keras.Sequential([keras.Input((16, 16, 1)), layers.Conv2D(16, 3, name="d_conv"),
                                  layers.Flatten(), layers.Dense(1, name="d_out")], name="discriminator")
g_opt, d_opt = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)
loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
""",
    )
    run(
        shell,
        """%%tfmem --as r
for start in range(0, 600, 64):  # the last batch is a partial one (24)
    real = x[start:start + 64]
    noise = tf.random.normal((len(real), 8))
    with tf.GradientTape() as tape:
        fake = generator(noise)
        d_loss = loss_fn(tf.ones((len(real), 1)), discriminator(real)) + \\
            loss_fn(tf.zeros((len(real), 1)), discriminator(fake))
    grads = tape.gradient(d_loss, discriminator.trainable_weights)
    d_opt.apply(grads, discriminator.trainable_weights)
    with tf.GradientTape() as tape:
        g_loss = loss_fn(tf.ones((len(real), 1)), discriminator(generator(noise)))
    grads = tape.gradient(g_loss, generator.trainable_weights)
    g_opt.apply_gradients(zip(grads, generator.trainable_weights))
""",
    )
    m = shell.user_ns["r"].model
    assert m.name == "discriminator"  # the larger of the two trained networks
    assert m.training and "optimizer.apply" in m.calls and m.optimizer == "Adam" and m.optimizer_slots == 2
    assert m.batch_size == 64  # the largest batch the model was called on, not the last partial one
    assert any(o.startswith("generator (") for o in m.other_models)
    import tfmem_magic
    from tfmem_magic.core.errors import TfmemUsageError

    with pytest.raises(TfmemUsageError, match="loop of its own"):  # probes cannot replay it: no ±10% claimed
        tfmem_magic.predict(shell.user_ns["r"], calibrate=True)


def test_sparse_labels_from_a_pipeline_calibrate(shell):
    """Integer labels with SparseCategoricalCrossentropy, fed by tf.data: the probes make targets like the
    pipeline's (not like the model's outputs, which failed with 'Argument output must have rank target.ndim - 1')."""
    run(
        shell,
        SETUP
        + """
model = keras.Sequential([keras.Input((20,)), layers.Embedding(100, 8), layers.GRU(16), layers.Dense(4)], name="gru")
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
labels = np.random.randint(0, 4, 512)
ds = tf.data.Dataset.from_tensor_slices((np.random.randint(0, 100, (512, 20)), labels)).batch(32).prefetch(2)
""",
    )
    run(shell, "%%tfmem --as r\nmodel.fit(ds, epochs=1, verbose=0)")
    import tfmem_magic

    report = shell.user_ns["r"]
    assert report.model.batch_size == 32 and report.model.feed == "dataset"
    what = tfmem_magic.predict(report, batch_size=64, calibrate=True)
    assert what.basis == "replay" and what.error_band == 0.15, report.whatif_basis.replay


def test_a_model_used_as_a_layer_counts_its_own_layers(shell):
    run(
        shell,
        SETUP
        + """
encoder = keras.Sequential([keras.Input((16, 16, 1)), layers.Conv2D(32, 3, activation="relu", name="enc_conv"),
                            layers.Conv2D(32, 3, activation="relu", name="enc_conv2"), layers.GlobalAveragePooling2D()],
                           name="encoder")
inputs = keras.Input((16, 16, 1))
outputs = layers.Dense(10, activation="softmax", name="head")(encoder(inputs))
model = keras.Model(inputs, outputs, name="transfer")
model.compile("adam", "categorical_crossentropy")
""",
    )
    run(shell, "%%tfmem --as r\nmodel.fit(x, y, batch_size=32, epochs=1, verbose=0)")
    layers = {layer.name: layer for layer in shell.user_ns["r"].model.layers}
    assert set(layers) >= {"encoder", "head"}  # the model's own layers
    inner = (14 * 14 * 32 + 12 * 12 * 32 + 32) * 4  # the encoder's layers' outputs, not only its 32 floats
    assert layers["encoder"].activation_bytes_per_sample == inner and "3 layers" in layers["encoder"].type


def test_notebook_defined_custom_layers_calibrate(shell):
    """keras.io's TokenAndPositionEmbedding: defined in a cell, not registered, no get_config, no **kwargs."""
    run(
        shell,
        """
import numpy as np, keras, tensorflow as tf
from keras import layers
class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)
    def call(self, x):
        positions = self.pos_emb(tf.range(start=0, limit=tf.shape(x)[-1], delta=1))
        return self.token_emb(x) + positions
inputs = layers.Input(shape=(40,))
h = TokenAndPositionEmbedding(40, 500, 16)(inputs)
h = layers.GlobalAveragePooling1D()(h)
model = keras.Model(inputs, layers.Dense(2, activation="softmax")(h))
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
xs = np.random.randint(0, 500, (512, 40)); ys = np.random.randint(0, 2, 512)
""",
    )
    run(
        shell,
        "%%tfmem --as r\nmodel.fit(xs, ys, batch_size=32, epochs=1, verbose=0, validation_data=(xs[:64], ys[:64]))",
    )
    import tfmem_magic

    what = tfmem_magic.predict(shell.user_ns["r"], batch_size=64, calibrate=True)
    assert what.basis == "replay" and what.error_band == 0.15 and what.peak_bytes > 0


def test_a_subclassed_model_without_config_calibrates_on_its_step(shell):
    """No config, so no clone: calibration sends the step the cell ran (Keras' own train_step, on this model) to the
    step replay's probes instead (advise/step_export.py)."""
    run(
        shell,
        SETUP
        + """
class TwoTowers(keras.Model):
    def __init__(self, tower):
        super().__init__()
        self.tower = tower
        self.head = layers.Dense(10, activation="softmax")
    def call(self, inputs):
        return self.head(self.tower(inputs))
model = TwoTowers(keras.Sequential([layers.Flatten(), layers.Dense(32, activation="relu")]))
model.compile("adam", "categorical_crossentropy")
""",
    )
    run(shell, "%%tfmem --as r\nmodel.fit(x, y, batch_size=32, epochs=1, verbose=0)")
    import tfmem_magic

    report = shell.user_ns["r"]
    assert tfmem_magic.predict(report, batch_size=64).basis == "analytic"
    what = tfmem_magic.predict(report, batch_size=64, calibrate=True)
    assert what.basis == "replay" and report.whatif_basis.replay.source == "step", report.whatif_basis.replay
    assert any("TwoTowers.train_step, Keras' own" in note for note in what.notes), what.notes
    # a model used as a layer may hold a convolution; the graphs its step ran hold none: no workspace on a GPU
    assert report.whatif_basis.replay.convolves is False
    assert tfmem_magic.predict(report, gpu="16GB").split["workspace"] == 0


def test_which_steps_are_the_models_own_and_how_their_batches_are_passed(shell):
    """Calibration sends the cell's own step (advise/step_export.py) for a model that overrides train_step or
    compute_loss; a model with only its own call() trains in Keras' step, which a clone runs. The step's argument
    is packed as Keras packs a batch: x alone, (x,) for a list of inputs, (x, y), (x, y, sample_weight)."""
    run(
        shell,
        SETUP
        + """
class Distiller(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return super().compute_loss(x, y, y_pred, sample_weight, allow_empty)
class Critic(keras.Model):
    def train_step(self, data):
        return {}
class Later(Critic):
    def call(self, x):
        return x
class OnlyCall(keras.Model):
    def call(self, x):
        return x
""",
    )
    from tfmem_magic.advise import step_export

    ns = shell.user_ns
    assert step_export.own_step(ns["Distiller"]()) == "Distiller.compute_loss"
    assert step_export.own_step(ns["Later"]()) == "Critic.train_step"  # inherited from the notebook's class
    assert step_export.own_step(ns["OnlyCall"]()) is None and step_export.own_step(ns["small_cnn"]()) is None
    image = {feeding.LEAF: [[16, 16, 1], "float64"]}
    label = {feeding.LEAF: [[], "int64"]}
    sig = step_export.data_signature({"x": image})
    assert sig.shape.as_list() == [None, 16, 16, 1] and sig.dtype.name == "float32"  # floats as the probes make them
    pair = step_export.data_signature({"x": image, "y": label})
    assert isinstance(pair, tuple) and len(pair) == 2 and pair[1].dtype.name == "int64"
    listed = step_export.data_signature({"x": [image, image]})
    assert isinstance(listed, tuple) and len(listed) == 1 and len(listed[0]) == 2
    assert len(step_export.data_signature({"x": image, "y": label, "sample_weight": label})) == 3


def test_a_loops_train_step_is_found_among_its_tf_functions(shell):
    """A GradientTape loop's `@tf.function` train step is what calibration saves (step_export.loop_step): not the
    test step beside it, which holds the model's variables and a metric's; its arguments become the probes'."""
    run(
        shell,
        SETUP
        + """
looped = small_cnn("looped")
adam = keras.optimizers.Adam()
accuracy = keras.metrics.CategoricalAccuracy()

@tf.function
def test_step(images, labels):
    accuracy.update_state(labels, looped(images, training=False))

@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        loss = keras.losses.categorical_crossentropy(labels, looped(images, training=True))
    adam.apply_gradients(zip(tape.gradient(loss, looped.trainable_variables), looped.trainable_variables))

for start in (0, 32):
    train_step(x[start:start + 32], y[start:start + 32])
    test_step(x[start:start + 32], y[start:start + 32])
""",
    )
    from tfmem_magic.advise import step_export

    function, name, structure = step_export.loop_step(shell.user_ns["looped"])
    assert name == "train_step" and function is shell.user_ns["train_step"]
    assert structure["args"] == [{feeding.LEAF: [[16, 16, 1], "float32"]}, {feeding.LEAF: [[10], "float32"]}]


def test_a_patch_made_during_the_cell_survives(shell):
    run(shell, SETUP + "model = small_cnn()")
    run(
        shell,
        "%%tfmem\noriginal_fit = keras.Model.fit\ncalls = []\n"
        "def logged_fit(self, *a, **k):\n    calls.append('fit')\n    return original_fit(self, *a, **k)\n"
        "keras.Model.fit = logged_fit",
    )
    try:
        run(shell, "model.fit(x, y, epochs=1, verbose=0)")
        assert shell.user_ns["calls"] == ["fit"]  # theirs stayed, and ours (inside it) passes through
        run(shell, "%%tfmem --as r\nmodel.fit(x, y, epochs=1, verbose=0, validation_split=0.2)")
        assert shell.user_ns["calls"] == ["fit", "fit"] and shell.user_ns["r"].model.samples == 480
    finally:
        shell.run_cell(
            "keras.Model.fit = original_fit.__wrapped__ if hasattr(original_fit, '__wrapped__') else original_fit"
        )


def test_a_gan_that_trains_with_two_optimizers_of_its_own_is_described_by_them(shell):
    """keras-io's DCGAN pattern: `compile(d_optimizer=Adam, g_optimizer=Adam)` and a `train_step` that applies
    each. Keras gives the model a default RMSprop that never trains anything; the report names the two optimizers
    that hold slots, and counts both's slots (issue 29)."""
    run(
        shell,
        SETUP
        + textwrap.dedent("""
        class GAN(keras.Model):
            def __init__(self):
                super().__init__()
                self.disc = keras.Sequential([keras.Input((16,)), layers.Dense(256), layers.Dense(1)])
                self.gen = keras.Sequential([keras.Input((8,)), layers.Dense(256), layers.Dense(16)])
            def compile(self, d_optimizer, g_optimizer):
                super().compile()
                self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            def train_step(self, data):
                z = tf.random.normal((tf.shape(data)[0], 8))
                with tf.GradientTape() as tape:
                    d_loss = tf.reduce_mean(self.disc(self.gen(z))) - tf.reduce_mean(self.disc(data))
                grads = tape.gradient(d_loss, self.disc.trainable_weights)
                self.d_optimizer.apply_gradients(zip(grads, self.disc.trainable_weights))
                with tf.GradientTape() as tape:
                    g_loss = -tf.reduce_mean(self.disc(self.gen(z)))
                grads = tape.gradient(g_loss, self.gen.trainable_weights)
                self.g_optimizer.apply_gradients(zip(grads, self.gen.trainable_weights))
                return {"d_loss": d_loss, "g_loss": g_loss}
        gan = GAN()
        gan.compile(d_optimizer=keras.optimizers.Adam(), g_optimizer=keras.optimizers.Adam())
    """),
    )
    run(shell, "%%tfmem --as r\ngan.fit(np.zeros((256, 16), 'float32'), batch_size=32, epochs=1, verbose=0)")
    model = shell.user_ns["r"].model
    assert model.optimizer == "Adam" and model.optimizers == ["d_optimizer: Adam", "g_optimizer: Adam"]
    assert model.optimizer_slots == 2 and model.optimizer_text == "Adam ×2 (d_optimizer, g_optimizer)"
    assert 2 * model.trainable_bytes <= model.optimizer_bytes <= 2 * model.trainable_bytes + 1024
    assert model.calls == ["fit"]
