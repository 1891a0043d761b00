# Follows the keras.io example "Text classification from scratch"
# https://keras.io/examples/nlp/text_classification_from_scratch/
"""The example's TextVectorization pipeline as published, on synthetic sentences (a batched tf.data dataset of strings
and labels instead of text_dataset_from_directory on aclImdb), with the model of keras.io "Bidirectional LSTM on IMDB"
(https://keras.io/examples/nlp/bidirectional_lstm_imdb/), narrower and on shorter sequences, one epoch.
Defines `model` and `history`."""

import re
import string

import numpy as np
import tensorflow as tf
import keras
from keras import layers
from keras.layers import TextVectorization

keras.utils.set_random_seed(0)

"""
## Load the data (synthetic reviews with <br /> tags, like the raw IMDB text)
"""

rng = np.random.default_rng(0)
good = ["great", "wonderful", "moving", "brilliant", "fun", "superb"]
bad = ["boring", "awful", "dull", "terrible", "weak", "clumsy"]
filler = (
    "the film was a story with an actor and some scenes that felt like this movie in my opinion "
    "it is of plot cast music ending director"
).split()


def synthetic_review(label):
    words = list(rng.choice(filler, rng.integers(8, 30))) + list(rng.choice(good if label else bad, 3))
    rng.shuffle(words)
    return " ".join(words[:10]) + ". <br /><br />" + " ".join(words[10:]) + "!"


labels = rng.integers(0, 2, 800)
texts = [synthetic_review(label) for label in labels]

batch_size = 32
raw_train_ds = tf.data.Dataset.from_tensor_slices((texts[:640], labels[:640])).batch(batch_size)
raw_val_ds = tf.data.Dataset.from_tensor_slices((texts[640:], labels[640:])).batch(batch_size)

print(f"Number of batches in raw_train_ds: {raw_train_ds.cardinality()}")
print(f"Number of batches in raw_val_ds: {raw_val_ds.cardinality()}")

"""
## Prepare the data
"""


# Having looked at our data above, we see that the raw text contains HTML break
# tags of the form '<br />'. These tags will not be removed by the default
# standardizer (which doesn't strip HTML). Because of this, we will need to
# create a custom standardization function.
def custom_standardization(input_data):
    lowercase = tf.strings.lower(input_data)
    stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"[{re.escape(string.punctuation)}]", "")


# Model constants.
max_features = 2000  # 20000 in the example
embedding_dim = 32  # 128 in the example
sequence_length = 32  # 500 in the example

vectorize_layer = TextVectorization(
    standardize=custom_standardization,
    max_tokens=max_features,
    output_mode="int",
    output_sequence_length=sequence_length,
)

# Let's make a text-only dataset (no labels):
text_ds = raw_train_ds.map(lambda x, y: x)
# Let's call `adapt`:
vectorize_layer.adapt(text_ds)


def vectorize_text(text, label):
    text = tf.expand_dims(text, -1)
    return vectorize_layer(text), label


# Vectorize the data.
train_ds = raw_train_ds.map(vectorize_text)
val_ds = raw_val_ds.map(vectorize_text)

# Do async prefetching / buffering of the data for best performance on GPU.
train_ds = train_ds.cache().prefetch(buffer_size=10)
val_ds = val_ds.cache().prefetch(buffer_size=10)

"""
## Build a model (keras.io "Bidirectional LSTM on IMDB")
"""

# Input for variable-length sequences of integers
inputs = keras.Input(shape=(None,), dtype="int64")
# Embed each integer in a 32-dimensional vector
x = layers.Embedding(max_features, embedding_dim)(inputs)
# Add 2 bidirectional LSTMs
x = layers.Bidirectional(layers.LSTM(16, return_sequences=True))(x)  # LSTM(64) in the example
x = layers.Bidirectional(layers.LSTM(16))(x)
# Add a classifier
outputs = layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(inputs, outputs)
model.summary()

model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])

"""
## Train the model
"""

epochs = 1  # 3 in the example

# Fit the model using the train and test datasets.
history = model.fit(train_ds, validation_data=val_ds, epochs=epochs)
