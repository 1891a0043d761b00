# Follows the keras.io example "Simple MNIST convnet" — synthetic MNIST-shaped data.
# https://keras.io/examples/vision/mnist_convnet/
"""The example's code as published (Keras 3 version), with keras.datasets.mnist.load_data() replaced by random uint8
images of the same shape and dtype, fewer samples and one epoch. Defines `model` and `history`."""

import numpy as np
import keras
from keras import layers

keras.utils.set_random_seed(0)

"""
## Prepare the data
"""

# Model / data parameters
num_classes = 10
input_shape = (28, 28, 1)

# Load the data and split it between train and test sets
# (synthetic stand-in for keras.datasets.mnist.load_data(): same shapes and dtypes, 1200 + 200 samples)
rng = np.random.default_rng(0)
x_train = rng.integers(0, 256, size=(1200, 28, 28), dtype=np.uint8)
y_train = rng.integers(0, num_classes, size=(1200,), dtype=np.uint8)
x_test = rng.integers(0, 256, size=(200, 28, 28), dtype=np.uint8)
y_test = rng.integers(0, num_classes, size=(200,), dtype=np.uint8)

# Scale images to the [0, 1] range
x_train = x_train.astype("float32") / 255
x_test = x_test.astype("float32") / 255
# Make sure images have shape (28, 28, 1)
x_train = np.expand_dims(x_train, -1)
x_test = np.expand_dims(x_test, -1)
print("x_train shape:", x_train.shape)
print(x_train.shape[0], "train samples")
print(x_test.shape[0], "test samples")


# convert class vectors to binary class matrices
y_train = keras.utils.to_categorical(y_train, num_classes)
y_test = keras.utils.to_categorical(y_test, num_classes)

"""
## Build the model
"""

model = keras.Sequential(
    [
        keras.Input(shape=input_shape),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ]
)

model.summary()

"""
## Train the model
"""

batch_size = 128
epochs = 1  # 15 in the example

model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])

history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1)
