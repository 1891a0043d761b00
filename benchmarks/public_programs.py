"""The pre-flight on stand-ins of public programs, as a new user meets it: the program's own code (model,
loss, how it feeds fit) with synthetic data of the same shapes (the programs' datasets are not reachable here).

    python benchmarks/public_programs.py [--programs anomaly,denoise,cifar,unet,ner] [--out FILE]
    python benchmarks/public_programs.py --programs seq2seq,vit --out benchmarks/results/public_programs_more.json

Each program runs in a fresh IPython shell with the extension loaded, in its own process: its data and model code,
then one fit at its own batch outside tfmem (TensorFlow is running, as in a notebook), then `%tfmem limit` at the
process's RSS plus HEADROOM_MIB. Cell A fits a new model at an oversized batch: the pre-flight should refuse it
before its first step (the optimizer's step counter unmoved) and name a batch. Cell B fits a new model at the batch
A named, under the same limit: it should be judged from A's kept replay (no new probes), run, and keep the process
within the limit (its VmHWM over the cell: tfmem resets the high-water mark as a cell starts). Every cell fits one
epoch of at most three steps (the step's peak is what the pre-flight predicts).

Printed per program, and kept by --out (benchmarks/results/public_programs.json; `python benchmarks/doc_tables.py
--write` renders docs/preflight.md's table from it): A's verdict, seconds and named batch; B's verdict, whether it
was kept, its status; the process's peak over B's start against the limit's room (the share of the budget the
named batch used, over 100% = past the limit); and xMem's figures for B's pre-flight (the error of its predicted
process growth, and whether that prediction, used as the limit, would have been run over). Where A's refusal said
what batch a restart would let it name (the regions TensorFlow held from the own fit), that batch runs in another
fresh process as after a restart: the program's data and code again, not its own fit, the same limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _fresh import fresh_env

HEADROOM_MIB = 1536
REALCODE = Path(__file__).resolve().parents[1] / "tests" / "realcode"  # public examples as published

PROGRAMS: dict[str, dict[str, object]] = {
    # keras-io "Timeseries anomaly detection using an Autoencoder": Conv1D / Conv1DTranspose on 288 steps
    "anomaly": {
        "own": 128,
        "over": 16384,
        "setup": """
            import numpy as np, keras
            from keras import layers
            x_train = np.random.rand(20000, 288, 1).astype("float32")
            def build():
                model = keras.Sequential([
                    layers.Input(shape=(288, 1)),
                    layers.Conv1D(filters=32, kernel_size=7, padding="same", strides=2, activation="relu"),
                    layers.Dropout(rate=0.2),
                    layers.Conv1D(filters=16, kernel_size=7, padding="same", strides=2, activation="relu"),
                    layers.Conv1DTranspose(filters=16, kernel_size=7, padding="same", strides=2, activation="relu"),
                    layers.Dropout(rate=0.2),
                    layers.Conv1DTranspose(filters=32, kernel_size=7, padding="same", strides=2, activation="relu"),
                    layers.Conv1DTranspose(filters=1, kernel_size=7, padding="same"),
                ])
                model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
                return model
        """,
        "fit": "model.fit(x_train, x_train, epochs=1, batch_size={batch}, validation_split=0.1, steps_per_epoch=3, "
        "verbose=0)",
    },
    # tensorflow/docs "Intro to Autoencoders", the denoising one: a subclassed model fed a tf.Tensor
    "denoise": {
        "own": 32,
        "over": 16384,
        "setup": """
            import numpy as np, tensorflow as tf, keras
            from keras import layers, losses
            from keras.models import Model
            x_train = np.random.rand(20000, 28, 28, 1).astype("float32")
            x_train_noisy = tf.clip_by_value(x_train + 0.2 * tf.random.normal(shape=x_train.shape),
                                             clip_value_min=0., clip_value_max=1.)
            class Denoise(Model):
                def __init__(self):
                    super().__init__()
                    self.encoder = keras.Sequential([
                        layers.Input(shape=(28, 28, 1)),
                        layers.Conv2D(16, (3, 3), activation="relu", padding="same", strides=2),
                        layers.Conv2D(8, (3, 3), activation="relu", padding="same", strides=2)])
                    self.decoder = keras.Sequential([
                        layers.Conv2DTranspose(8, kernel_size=3, strides=2, activation="relu", padding="same"),
                        layers.Conv2DTranspose(16, kernel_size=3, strides=2, activation="relu", padding="same"),
                        layers.Conv2D(1, kernel_size=(3, 3), activation="sigmoid", padding="same")])
                def call(self, x):
                    return self.decoder(self.encoder(x))
            def build():
                model = Denoise()
                model.compile(optimizer="adam", loss=losses.MeanSquaredError())
                return model
        """,
        "fit": "model.fit(x_train_noisy, x_train, epochs=1, batch_size={batch}, shuffle=True, steps_per_epoch=3, "
        "verbose=0)",
    },
    # tensorflow/docs "Convolutional Neural Network (CNN)" on CIFAR-10's shapes
    "cifar": {
        "own": 32,
        "over": 16384,
        "setup": """
            import numpy as np, tensorflow as tf
            from tensorflow.keras import layers, models
            train_images = np.random.rand(20000, 32, 32, 3).astype("float32")
            train_labels = np.random.randint(0, 10, (20000, 1))
            test_images, test_labels = train_images[:2000], train_labels[:2000]
            def build():
                model = models.Sequential()
                model.add(layers.Input((32, 32, 3)))
                model.add(layers.Conv2D(32, (3, 3), activation="relu"))
                model.add(layers.MaxPooling2D((2, 2)))
                model.add(layers.Conv2D(64, (3, 3), activation="relu"))
                model.add(layers.MaxPooling2D((2, 2)))
                model.add(layers.Conv2D(64, (3, 3), activation="relu"))
                model.add(layers.Flatten())
                model.add(layers.Dense(64, activation="relu"))
                model.add(layers.Dense(10))
                model.compile(optimizer="adam",
                              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              metrics=["accuracy"])
                return model
        """,
        "fit": "model.fit(train_images, train_labels, epochs=1, batch_size={batch}, "
        "validation_data=(test_images, test_labels), steps_per_epoch=3, verbose=0)",
    },
    # keras-io "Image segmentation with a U-Net-like architecture" (Oxford pets), fed by a PyDataset of image files
    "unet": {
        "own": 32,
        "over": 512,
        "setup": """
            import os, tempfile, numpy as np, keras
            from keras import layers
            folder = tempfile.mkdtemp(prefix="pets-")
            rng = np.random.default_rng(0)
            for i in range(600):
                np.save(os.path.join(folder, f"img{i}.npy"), rng.integers(0, 256, (160, 160, 3), dtype="uint8"))
                np.save(os.path.join(folder, f"seg{i}.npy"), rng.integers(0, 3, (160, 160, 1), dtype="uint8"))
            class OxfordPets(keras.utils.PyDataset):
                def __init__(self, batch_size, count, **kwargs):
                    super().__init__(**kwargs)
                    self.batch_size, self.count = batch_size, count
                def __len__(self):
                    return self.count // self.batch_size
                def __getitem__(self, idx):
                    rows = range(idx * self.batch_size, (idx + 1) * self.batch_size)
                    x = np.stack([np.load(os.path.join(folder, f"img{i}.npy")) for i in rows]).astype("float32")
                    y = np.stack([np.load(os.path.join(folder, f"seg{i}.npy")) for i in rows])
                    return x / 255.0, y
            def get_model(img_size, num_classes):
                inputs = keras.Input(shape=img_size + (3,))
                x = layers.Conv2D(32, 3, strides=2, padding="same")(inputs)
                x = layers.BatchNormalization()(x)
                x = layers.Activation("relu")(x)
                previous_block_activation = x
                for filters in [64, 128, 256]:
                    x = layers.Activation("relu")(x)
                    x = layers.SeparableConv2D(filters, 3, padding="same")(x)
                    x = layers.BatchNormalization()(x)
                    x = layers.Activation("relu")(x)
                    x = layers.SeparableConv2D(filters, 3, padding="same")(x)
                    x = layers.BatchNormalization()(x)
                    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
                    residual = layers.Conv2D(filters, 1, strides=2, padding="same")(previous_block_activation)
                    x = layers.add([x, residual])
                    previous_block_activation = x
                for filters in [256, 128, 64, 32]:
                    x = layers.Activation("relu")(x)
                    x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
                    x = layers.BatchNormalization()(x)
                    x = layers.Activation("relu")(x)
                    x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
                    x = layers.BatchNormalization()(x)
                    x = layers.UpSampling2D(2)(x)
                    residual = layers.UpSampling2D(2)(previous_block_activation)
                    residual = layers.Conv2D(filters, 1, padding="same")(residual)
                    x = layers.add([x, residual])
                    previous_block_activation = x
                outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)
                return keras.Model(inputs, outputs)
            def build():
                model = get_model((160, 160), 3)
                model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
                return model
        """,
        "fit": "model.fit(OxfordPets({batch}, 600), epochs=1, steps_per_epoch=min(3, 600 // {batch}), verbose=0)",
    },
    # keras-io "Named Entity Recognition using Transformers", on tf_keras: custom layers, a custom Loss, and
    # TextLineDataset -> map -> StringLookup -> padded_batch (each batch padded to its longest sentence)
    "ner": {
        "own": 32,
        "over": 4096,
        "env": {"TF_USE_LEGACY_KERAS": "1"},
        "setup": """
            import os, tempfile, numpy as np, tensorflow as tf
            from tensorflow import keras
            from tensorflow.keras import layers
            rng = np.random.default_rng(0)
            vocab = [f"w{i}" for i in range(20000)]
            path = os.path.join(tempfile.mkdtemp(prefix="conll-"), "train.txt")
            with open(path, "w") as out:
                for _ in range(20000):
                    n = int(rng.integers(3, 125))  # CoNLL-2003's longest sentence has 124 tokens
                    words = [vocab[int(k)] for k in rng.integers(0, 20000, n)]
                    tags = [str(int(t)) for t in rng.integers(0, 9, n)]
                    out.write("\\t".join([str(n), *words, *tags]) + "\\n")
            lookup_layer = keras.layers.StringLookup(vocabulary=vocab)
            class TransformerBlock(layers.Layer):
                def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
                    super().__init__()
                    self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
                    self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                                 keras.layers.Dense(embed_dim)])
                    self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
                    self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
                    self.dropout1 = keras.layers.Dropout(rate)
                    self.dropout2 = keras.layers.Dropout(rate)
                def call(self, inputs, training=False):
                    attn_output = self.att(inputs, inputs)
                    attn_output = self.dropout1(attn_output, training=training)
                    out1 = self.layernorm1(inputs + attn_output)
                    ffn_output = self.ffn(out1)
                    ffn_output = self.dropout2(ffn_output, training=training)
                    return self.layernorm2(out1 + ffn_output)
            class TokenAndPositionEmbedding(layers.Layer):
                def __init__(self, maxlen, vocab_size, embed_dim):
                    super().__init__()
                    self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
                    self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)
                def call(self, inputs):
                    maxlen = tf.shape(inputs)[-1]
                    positions = tf.range(start=0, limit=maxlen, delta=1)
                    return self.token_emb(inputs) + self.pos_emb(positions)
            class NERModel(keras.Model):
                def __init__(self, num_tags, vocab_size, maxlen=128, embed_dim=32, num_heads=2, ff_dim=32):
                    super().__init__()
                    self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
                    self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
                    self.dropout1 = layers.Dropout(0.1)
                    self.ff = layers.Dense(ff_dim, activation="relu")
                    self.dropout2 = layers.Dropout(0.1)
                    self.ff_final = layers.Dense(num_tags, activation="softmax")
                def call(self, inputs, training=False):
                    x = self.embedding_layer(inputs)
                    x = self.transformer_block(x)
                    x = self.dropout1(x, training=training)
                    x = self.ff(x)
                    x = self.dropout2(x, training=training)
                    return self.ff_final(x)
            class CustomNonPaddingTokenLoss(keras.losses.Loss):
                def __init__(self, name="custom_ner_loss"):
                    super().__init__(name=name)
                def call(self, y_true, y_pred):
                    loss_fn = keras.losses.SparseCategoricalCrossentropy(
                        from_logits=False, reduction=keras.losses.Reduction.NONE)
                    loss = loss_fn(y_true, y_pred)
                    mask = tf.cast((y_true > 0), dtype=tf.float32)
                    return tf.reduce_sum(loss * mask) / tf.reduce_sum(mask)
            def map_record_to_training_data(record):
                record = tf.strings.split(record, sep="\\t")
                length = tf.strings.to_number(record[0], out_type=tf.int32)
                tokens = record[1 : length + 1]
                tags = tf.strings.to_number(record[length + 1 :], out_type=tf.int64) + 1
                return tokens, tags
            def lowercase_and_convert_to_ids(tokens):
                return lookup_layer(tf.strings.lower(tokens))
            def batches(batch_size):
                return (tf.data.TextLineDataset(path).map(map_record_to_training_data)
                        .map(lambda x, y: (lowercase_and_convert_to_ids(x), y)).padded_batch(batch_size))
            def build():
                model = NERModel(10, lookup_layer.vocabulary_size(), embed_dim=32, num_heads=4, ff_dim=64)
                model.compile(optimizer="adam", loss=CustomNonPaddingTokenLoss())
                return model
        """,
        "fit": "model.fit(batches({batch}), epochs=1, steps_per_epoch=3, verbose=0)",
    },
    # keras-io "Character-level recurrent sequence-to-sequence model": two inputs of one-hot characters with an open
    # time dimension, an encoder LSTM whose states start the decoder's, RMSprop, a validation split
    "seq2seq": {
        "own": 64,
        "over": 8000,
        "setup": """
            import numpy as np, keras
            # the example's first 10000 pairs of fra.txt: 71 input and 93 target characters, at most 15 and 59 long
            num_samples, num_encoder_tokens, num_decoder_tokens = 10000, 71, 93
            max_encoder_seq_length, max_decoder_seq_length, latent_dim = 15, 59, 256
            rng = np.random.default_rng(0)
            encoder_input_data = np.zeros((num_samples, max_encoder_seq_length, num_encoder_tokens), dtype="float32")
            decoder_input_data = np.zeros((num_samples, max_decoder_seq_length, num_decoder_tokens), dtype="float32")
            decoder_target_data = np.zeros((num_samples, max_decoder_seq_length, num_decoder_tokens), dtype="float32")
            rows = np.arange(num_samples)[:, None]
            encoder_input_data[rows, np.arange(max_encoder_seq_length),
                               rng.integers(0, num_encoder_tokens, (num_samples, max_encoder_seq_length))] = 1.0
            chars = rng.integers(0, num_decoder_tokens, (num_samples, max_decoder_seq_length + 1))
            decoder_input_data[rows, np.arange(max_decoder_seq_length), chars[:, :-1]] = 1.0
            decoder_target_data[rows, np.arange(max_decoder_seq_length), chars[:, 1:]] = 1.0
            def build():
                encoder_inputs = keras.Input(shape=(None, num_encoder_tokens))
                encoder = keras.layers.LSTM(latent_dim, return_state=True)
                encoder_outputs, state_h, state_c = encoder(encoder_inputs)
                encoder_states = [state_h, state_c]
                decoder_inputs = keras.Input(shape=(None, num_decoder_tokens))
                decoder_lstm = keras.layers.LSTM(latent_dim, return_sequences=True, return_state=True)
                decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
                decoder_dense = keras.layers.Dense(num_decoder_tokens, activation="softmax")
                decoder_outputs = decoder_dense(decoder_outputs)
                model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
                model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
                return model
        """,
        "fit": "model.fit([encoder_input_data, decoder_input_data], decoder_target_data, batch_size={batch}, "
        "epochs=1, validation_split=0.2, steps_per_epoch=3, verbose=0)",
    },
    # keras-io "Image classification with Vision Transformer" on CIFAR-100's shapes: augmentation layers (a
    # Normalization adapted on the data, Resizing to 72), a Patches layer of keras.ops.image.extract_patches, a
    # PatchEncoder with a position Embedding, eight MultiHeadAttention blocks, a 2048-1024 head, AdamW
    "vit": {
        "own": 256,
        "over": 4096,
        "setup": """
            import numpy as np, keras
            from keras import layers, ops
            num_classes, input_shape = 100, (32, 32, 3)
            rng = np.random.default_rng(0)
            x_train = rng.integers(0, 256, (5000, 32, 32, 3)).astype("uint8")
            y_train = rng.integers(0, num_classes, (5000, 1))
            learning_rate, weight_decay = 0.001, 0.0001
            image_size, patch_size = 72, 6
            num_patches = (image_size // patch_size) ** 2
            projection_dim, num_heads = 64, 4
            hidden_dim = projection_dim * num_heads
            transformer_units = [hidden_dim * 2, hidden_dim]
            transformer_layers = 8
            mlp_head_units = [2048, 1024]
            data_augmentation = keras.Sequential([
                layers.Normalization(),
                layers.Resizing(image_size, image_size),
                layers.RandomFlip("horizontal"),
                layers.RandomRotation(factor=0.02),
                layers.RandomZoom(height_factor=0.2, width_factor=0.2),
            ], name="data_augmentation")
            data_augmentation.layers[0].adapt(x_train)
            def mlp(x, hidden_units, dropout_rate):
                for units in hidden_units:
                    x = layers.Dense(units, activation=keras.activations.gelu)(x)
                    x = layers.Dropout(dropout_rate)(x)
                return x
            class Patches(layers.Layer):
                def __init__(self, patch_size):
                    super().__init__()
                    self.patch_size = patch_size
                def call(self, images):
                    input_shape = ops.shape(images)
                    batch_size, height, width, channels = input_shape[0], input_shape[1], input_shape[2], input_shape[3]
                    num_patches_h, num_patches_w = height // self.patch_size, width // self.patch_size
                    patches = keras.ops.image.extract_patches(images, size=self.patch_size)
                    return ops.reshape(patches, (batch_size, num_patches_h * num_patches_w,
                                                 self.patch_size * self.patch_size * channels))
            class PatchEncoder(layers.Layer):
                def __init__(self, num_patches, projection_dim):
                    super().__init__()
                    self.num_patches = num_patches
                    self.projection = layers.Dense(units=projection_dim)
                    self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)
                def call(self, patch):
                    positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
                    return self.projection(patch) + self.position_embedding(positions)
            def build():
                inputs = keras.Input(shape=input_shape)
                augmented = data_augmentation(inputs)
                patches = Patches(patch_size)(augmented)
                encoded_patches = PatchEncoder(num_patches, hidden_dim)(patches)
                for _ in range(transformer_layers):
                    x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
                    attention_output = layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim,
                                                                 dropout=0.1)(x1, x1)
                    x2 = layers.Add()([attention_output, encoded_patches])
                    x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
                    x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
                    encoded_patches = layers.Add()([x3, x2])
                representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
                representation = layers.Flatten()(representation)
                representation = layers.Dropout(0.5)(representation)
                features = mlp(representation, hidden_units=mlp_head_units, dropout_rate=0.5)
                logits = layers.Dense(num_classes)(features)
                model = keras.Model(inputs=inputs, outputs=logits)
                model.compile(optimizer=keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=weight_decay),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                                       keras.metrics.SparseTopKCategoricalAccuracy(5, name="top-5-accuracy")])
                return model
        """,
        "fit": "model.fit(x=x_train, y=y_train, batch_size={batch}, epochs=1, validation_split=0.1, steps_per_epoch=3, "
        "verbose=0)",
    },
    # keras-io "Variational AutoEncoder" as tests/realcode/vae.py has it (the example as published): a subclassed
    # Model with its own train_step (a GradientTape, three metric trackers), a Sampling layer drawing from a
    # SeedGenerator, fed numpy arrays of x only; the example's code runs again for each new model
    "vae": {
        "own": 128,
        "over": 16384,
        "setup": f"""
            import numpy as np, keras
            from pathlib import Path
            EXAMPLE = Path({str(REALCODE / "vae.py")!r}).read_text().split('\"\"\"\\n## Train the VAE')[0]
            mnist_digits = np.random.rand(20000, 28, 28, 1).astype("float32")
            def build():
                ns = {{}}
                exec(compile(EXAMPLE, "vae.py", "exec"), ns)  # its encoder, decoder and VAE class, made anew
                model = ns["VAE"](ns["encoder"], ns["decoder"])
                model.compile(optimizer=keras.optimizers.Adam())
                return model
        """,
        "fit": "model.fit(mnist_digits, epochs=1, batch_size={batch}, steps_per_epoch=3, verbose=0)",
    },
    # keras-io "Character-level text generation with LSTM": one-hot sequences as bool arrays, LSTM(128), RMSprop
    "charlstm": {
        "own": 128,
        "over": 65536,
        "setup": """
            import numpy as np, keras
            from keras import layers
            maxlen, chars = 40, 57
            rng = np.random.default_rng(0)
            x = np.zeros((100000, maxlen, chars), dtype="bool")
            y = np.zeros((100000, chars), dtype="bool")
            x[np.arange(100000)[:, None], np.arange(maxlen)[None, :], rng.integers(0, chars, (100000, maxlen))] = 1
            y[np.arange(100000), rng.integers(0, chars, 100000)] = 1
            def build():
                model = keras.Sequential([keras.Input(shape=(maxlen, chars)), layers.LSTM(128),
                                          layers.Dense(chars, activation="softmax")])
                model.compile(loss="categorical_crossentropy", optimizer=keras.optimizers.RMSprop(learning_rate=0.01))
                return model
        """,
        "fit": "model.fit(x, y, batch_size={batch}, epochs=1, steps_per_epoch=3, verbose=0)",
    },
    # keras-io "Timeseries classification from scratch" on FordA's shapes: three Conv1D + BatchNormalization + ReLU
    # blocks on 500 steps, global average pooling, a validation split
    "fordA": {
        "own": 32,
        "over": 16384,
        "setup": """
            import numpy as np, keras
            rng = np.random.default_rng(0)
            x_train = rng.standard_normal((3601, 500, 1)).astype("float32")
            y_train = rng.integers(0, 2, 3601)
            def build():
                input_layer = keras.layers.Input((500, 1))
                x = input_layer
                for _ in range(3):
                    x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
                    x = keras.layers.BatchNormalization()(x)
                    x = keras.layers.ReLU()(x)
                gap = keras.layers.GlobalAveragePooling1D()(x)
                output_layer = keras.layers.Dense(2, activation="softmax")(gap)
                model = keras.models.Model(inputs=input_layer, outputs=output_layer)
                model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                              metrics=["sparse_categorical_accuracy"])
                return model
        """,
        "fit": "model.fit(x_train, y_train, batch_size={batch}, epochs=1, validation_split=0.2, steps_per_epoch=3, "
        "verbose=0)",
    },
}

WORKER = """
import json, os, sys
import tfmem_magic
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
import psutil

spec = json.loads(sys.argv[1])
shell = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
shell.run_line_magic("load_ext", "tfmem_magic")

def cell(code):
    result = shell.run_cell(code)
    return result

assert cell(spec["setup"]).success, "the program's setup failed"
after = spec.get("after_restart")  # [limit MiB, batch]: a kernel restarted, its cells run again but the own fit
if after is None:
    # TensorFlow running, as in a notebook: one fit at the program's own batch, outside tfmem
    assert cell("model = build()\\n" + spec["fit"].format(batch=spec["own"])).success, "its own batch failed"
    limit_mib = psutil.Process().memory_info().rss // 2**20 + spec["headroom"]
else:
    limit_mib = after[0]
shell.run_line_magic("tfmem", f"limit {limit_mib}MiB")
out = {"limit_mib": limit_mib}

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

def run(name, batch):
    before = psutil.Process().memory_info().rss
    cell(f"%%tfmem --quick --no-panel --as {name}\\nmodel = build()\\n" + spec["fit"].format(batch=batch))
    report = shell.user_ns.get(name)
    info = report.preflight if report is not None else None
    steps = shell.user_ns["model"].optimizer.iterations
    row = {
        "batch": batch,
        "status": report.status if report is not None else None,
        "verdict": info.verdict if info else None,
        "basis": info.basis if info else None,
        "kept": bool(info and info.kept),
        "seconds": info.seconds if info else None,
        "named": info.largest_batch if info else None,
        "restart": info.restart_batch if info else None,
        "reusable": info.reusable_bytes if info else None,
        "predicted_growth": (info.predicted_rss_bytes - info.rss_bytes) if info else None,
        "optimizer_steps": int(steps.numpy()) if hasattr(steps, "numpy") else None,
        "rss_before": before,
        "hwm": hwm(),
        "notes": [n for n in (report.notes if report is not None else []) if "re-flight" in n][:2],
    }
    return row

if after is not None:
    print(json.dumps({"limit_mib": limit_mib, "run": run("c", after[1])}))
    sys.exit(0)
out["oversized"] = run("a", spec["over"])
named = out["oversized"]["named"]
out["named"] = run("b", named) if named else None
print(json.dumps(out))
"""


def one(name: str, after_restart: tuple[int, int] | None = None) -> dict:
    """One program in a fresh process; with `after_restart` (the limit in MiB, a batch), as after a kernel restart:
    its data and code again, not its own fit, the same limit, a call at that batch."""
    spec = dict(PROGRAMS[name])
    spec["after_restart"] = after_restart
    env = fresh_env(**dict(spec.pop("env", {})))  # type: ignore[arg-type]
    spec["setup"] = textwrap.dedent(str(spec["setup"]))
    spec["headroom"] = HEADROOM_MIB
    done = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=1800
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return {"program": name, "error": done.stderr[-1500:]}
    return {"program": name, **json.loads(lines[-1])}


def on_tf_keras(name: str) -> bool:
    """Whether the program runs on tf_keras (Keras 2) rather than Keras 3."""
    env = PROGRAMS[name].get("env")
    return isinstance(env, dict) and "TF_USE_LEGACY_KERAS" in env


def scored(row: dict) -> dict:
    """Row figures: B's use of the room under the limit, and xMem's two figures for B's pre-flight."""
    b = row.get("named")
    if not b:
        return {}
    limit = row["limit_mib"] * 2**20
    room = max(1, limit - b["rss_before"])
    grew = b["hwm"] - b["rss_before"]
    out = {"used": round(grew / room, 3), "over_limit": b["hwm"] > limit}
    if b["predicted_growth"] is not None:  # 0 where it counted the regions TensorFlow holds as reused
        out["error"] = round(b["predicted_growth"] / max(1, grew) - 1, 3)
        out["prediction_as_limit_runs_out"] = grew > b["predicted_growth"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import keras
    import tensorflow as tf

    results: dict = {
        "command": f"python benchmarks/public_programs.py --programs {args.programs}",
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__, "cores": os.cpu_count()},
        "headroom_mib": HEADROOM_MIB,
        "tf_keras": [name for name in args.programs.split(",") if on_tf_keras(name)],
        "programs": [],
    }
    for name in args.programs.split(","):
        row = one(name)
        row["score"] = scored(row)
        restart = (row.get("oversized") or {}).get("restart")
        if restart:  # the refusal said what a restart would let it name: that batch after one, under the same limit
            row["after_restart"] = one(name, (row["limit_mib"], restart))
        results["programs"].append(row)
        print(json.dumps(row, default=str), flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
