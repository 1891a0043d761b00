# Follows the keras.io example "Image classification from scratch"
# https://keras.io/examples/vision/image_classification_from_scratch/
"""The example's code as published (Keras 3 version), on a synthetic "PetImages" folder: small JPEG files written into
Cat/ and Dog/ subfolders of a temporary directory (instead of the Kaggle download), 64x64 images, a narrower Xception,
two epochs. The callbacks are the example's ModelCheckpoint plus ReduceLROnPlateau and a custom Callback (from the
keras.io guide "Writing your own callbacks"). Defines `model` and `history`."""

import os
import tempfile

import numpy as np
import keras
from keras import layers
from tensorflow import data as tf_data

keras.utils.set_random_seed(0)

"""
## Load the data: the Cats vs Dogs dataset (synthetic)
"""

workdir = tempfile.mkdtemp()
rng = np.random.default_rng(0)
for label, folder_name in enumerate(("Cat", "Dog")):
    os.makedirs(os.path.join(workdir, "PetImages", folder_name))
    for i in range(60):
        img = rng.integers(0, 160, size=(72, 72, 3)).astype("float32")
        img[..., label * 2] += 90  # cats are redder, dogs bluer
        keras.utils.save_img(os.path.join(workdir, "PetImages", folder_name, f"{i}.jpg"), img, scale=False)

"""
### Filter out corrupted images
"""

num_skipped = 0
for folder_name in ("Cat", "Dog"):
    folder_path = os.path.join(workdir, "PetImages", folder_name)
    for fname in os.listdir(folder_path):
        fpath = os.path.join(folder_path, fname)
        try:
            fobj = open(fpath, "rb")
            is_jfif = b"JFIF" in fobj.peek(10)
        finally:
            fobj.close()

        if not is_jfif:
            num_skipped += 1
            # Delete corrupted image
            os.remove(fpath)

print(f"Deleted {num_skipped} images.")

"""
## Generate a `Dataset`
"""

image_size = (64, 64)  # (180, 180) in the example
batch_size = 16  # 128 in the example

train_ds, val_ds = keras.utils.image_dataset_from_directory(
    os.path.join(workdir, "PetImages"),
    validation_split=0.2,
    subset="both",
    seed=1337,
    image_size=image_size,
    batch_size=batch_size,
)

"""
## Using image data augmentation
"""

data_augmentation_layers = [
    layers.RandomFlip("horizontal"),
    layers.RandomRotation(0.1),
]


def data_augmentation(images):
    for layer in data_augmentation_layers:
        images = layer(images)
    return images


# Apply `data_augmentation` to the training images.
train_ds = train_ds.map(
    lambda img, label: (data_augmentation(img), label),
    num_parallel_calls=tf_data.AUTOTUNE,
)
# Prefetching samples in GPU memory helps maximize GPU utilization.
train_ds = train_ds.prefetch(tf_data.AUTOTUNE)
val_ds = val_ds.prefetch(tf_data.AUTOTUNE)

"""
## Build a model

A small version of the Xception network (the example's widths divided by 8 or more).
"""


def make_model(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)

    # Entry block
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(16, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    for size in [32, 64]:  # [256, 512, 728] in the example
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    x = layers.SeparableConv2D(128, 3, padding="same")(x)  # 1024 in the example
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.GlobalAveragePooling2D()(x)
    if num_classes == 2:
        units = 1
    else:
        units = num_classes

    x = layers.Dropout(0.25)(x)
    # We specify activation=None so as to return logits
    outputs = layers.Dense(units, activation=None)(x)
    return keras.Model(inputs, outputs)


model = make_model(input_shape=image_size + (3,), num_classes=2)

"""
## Train the model
"""


class LossHistory(keras.callbacks.Callback):
    """Keeps every batch's loss (keras.io guide "Writing your own callbacks")."""

    def on_train_begin(self, logs=None):
        self.per_batch_losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.per_batch_losses.append(logs["loss"])

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch}: {len(self.per_batch_losses)} batches so far, val_loss {logs['val_loss']:.4f}")


epochs = 2  # 25 in the example

callbacks = [
    keras.callbacks.ModelCheckpoint(os.path.join(workdir, "save_at_{epoch}.keras")),
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_lr=1e-5),
    LossHistory(),
]
model.compile(
    optimizer=keras.optimizers.Adam(3e-4),
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy(name="acc")],
)
history = model.fit(
    train_ds,
    epochs=epochs,
    callbacks=callbacks,
    validation_data=val_ds,
)
