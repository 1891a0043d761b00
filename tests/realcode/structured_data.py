# Follows the keras.io example "Structured data classification from scratch"
# https://keras.io/examples/structured_data/structured_data_classification_from_scratch/
"""The example's code as published, on a synthetic heart-disease table of 600 rows (a dict of numpy columns stands in
for the pandas DataFrame: `dict(dataframe)` is what the example hands to tf.data), one epoch; `class_weight` and the
metrics follow keras.io "Imbalanced classification: credit card fraud detection". Defines `model` and `history`."""

import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)

"""
## Preparing the data (synthetic stand-in for pd.read_csv(heart.csv))
"""

rows = 600
rng = np.random.default_rng(0)
dataframe = {
    "age": rng.integers(29, 78, rows),
    "sex": rng.integers(0, 2, rows),
    "cp": rng.integers(0, 5, rows),
    "trestbps": rng.integers(94, 201, rows),
    "chol": rng.integers(126, 565, rows),
    "fbs": rng.integers(0, 2, rows),
    "restecg": rng.integers(0, 3, rows),
    "thalach": rng.integers(71, 203, rows),
    "exang": rng.integers(0, 2, rows),
    "oldpeak": rng.uniform(0, 6.2, rows).round(1),
    "slope": rng.integers(0, 4, rows),
    "ca": rng.integers(0, 4, rows),
    "thal": rng.choice(["normal", "fixed", "reversible"], rows),
}
dataframe["target"] = ((dataframe["age"] > 55) & (dataframe["chol"] > 250)).astype("int64")  # imbalanced: ~1 in 5

val_rows = rng.random(rows) < 0.2
val_dataframe = {name: column[val_rows] for name, column in dataframe.items()}
train_dataframe = {name: column[~val_rows] for name, column in dataframe.items()}

print(
    "Using %d samples for training and %d for validation"
    % (len(train_dataframe["target"]), len(val_dataframe["target"]))
)


def dataframe_to_dataset(dataframe):
    dataframe = dataframe.copy()
    labels = dataframe.pop("target")
    ds = tf.data.Dataset.from_tensor_slices((dict(dataframe), labels))
    ds = ds.shuffle(buffer_size=len(labels))
    return ds


train_ds = dataframe_to_dataset(train_dataframe)
val_ds = dataframe_to_dataset(val_dataframe)

for x, y in train_ds.take(1):
    print("Input:", x)
    print("Target:", y)

train_ds = train_ds.batch(32)
val_ds = val_ds.batch(32)

"""
## Feature preprocessing with Keras layers
"""

from keras.layers import IntegerLookup  # noqa: E402
from keras.layers import Normalization  # noqa: E402
from keras.layers import StringLookup  # noqa: E402


def encode_numerical_feature(feature, name, dataset):
    # Create a Normalization layer for our feature
    normalizer = Normalization()

    # Prepare a Dataset that only yields our feature
    feature_ds = dataset.map(lambda x, y: x[name])
    feature_ds = feature_ds.map(lambda x: tf.expand_dims(x, -1))

    # Learn the statistics of the data
    normalizer.adapt(feature_ds)

    # Normalize the input feature
    encoded_feature = normalizer(feature)
    return encoded_feature


def encode_categorical_feature(feature, name, dataset, is_string):
    lookup_class = StringLookup if is_string else IntegerLookup
    # Create a lookup layer which will turn strings into integer indices
    lookup = lookup_class(output_mode="binary")

    # Prepare a Dataset that only yields our feature
    feature_ds = dataset.map(lambda x, y: x[name])
    feature_ds = feature_ds.map(lambda x: tf.expand_dims(x, -1))

    # Learn the set of possible string values and assign them a fixed integer index
    lookup.adapt(feature_ds)

    # Turn the string input into integer indices
    encoded_feature = lookup(feature)
    return encoded_feature


"""
## Build a model
"""

# Categorical features encoded as integers
sex = keras.Input(shape=(1,), name="sex", dtype="int64")
cp = keras.Input(shape=(1,), name="cp", dtype="int64")
fbs = keras.Input(shape=(1,), name="fbs", dtype="int64")
restecg = keras.Input(shape=(1,), name="restecg", dtype="int64")
exang = keras.Input(shape=(1,), name="exang", dtype="int64")
ca = keras.Input(shape=(1,), name="ca", dtype="int64")

# Categorical feature encoded as string
thal = keras.Input(shape=(1,), name="thal", dtype="string")

# Numerical features
age = keras.Input(shape=(1,), name="age")
trestbps = keras.Input(shape=(1,), name="trestbps")
chol = keras.Input(shape=(1,), name="chol")
thalach = keras.Input(shape=(1,), name="thalach")
oldpeak = keras.Input(shape=(1,), name="oldpeak")
slope = keras.Input(shape=(1,), name="slope")

all_inputs = [
    sex,
    cp,
    fbs,
    restecg,
    exang,
    ca,
    thal,
    age,
    trestbps,
    chol,
    thalach,
    oldpeak,
    slope,
]

# Integer categorical features
sex_encoded = encode_categorical_feature(sex, "sex", train_ds, False)
cp_encoded = encode_categorical_feature(cp, "cp", train_ds, False)
fbs_encoded = encode_categorical_feature(fbs, "fbs", train_ds, False)
restecg_encoded = encode_categorical_feature(restecg, "restecg", train_ds, False)
exang_encoded = encode_categorical_feature(exang, "exang", train_ds, False)
ca_encoded = encode_categorical_feature(ca, "ca", train_ds, False)

# String categorical features
thal_encoded = encode_categorical_feature(thal, "thal", train_ds, True)

# Numerical features
age_encoded = encode_numerical_feature(age, "age", train_ds)
trestbps_encoded = encode_numerical_feature(trestbps, "trestbps", train_ds)
chol_encoded = encode_numerical_feature(chol, "chol", train_ds)
thalach_encoded = encode_numerical_feature(thalach, "thalach", train_ds)
oldpeak_encoded = encode_numerical_feature(oldpeak, "oldpeak", train_ds)
slope_encoded = encode_numerical_feature(slope, "slope", train_ds)

all_features = layers.concatenate(
    [
        sex_encoded,
        cp_encoded,
        fbs_encoded,
        restecg_encoded,
        exang_encoded,
        slope_encoded,
        ca_encoded,
        thal_encoded,
        age_encoded,
        trestbps_encoded,
        chol_encoded,
        thalach_encoded,
        oldpeak_encoded,
    ]
)
x = layers.Dense(32, activation="relu")(all_features)
x = layers.Dropout(0.5)(x)
output = layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(all_inputs, output)
model.compile("adam", "binary_crossentropy", metrics=["accuracy", keras.metrics.AUC(name="auc")])

"""
## Train the model with `class_weight` (as in the imbalanced-classification example)
"""

counts = np.bincount(train_dataframe["target"])
weight_for_0 = 1.0 / counts[0]
weight_for_1 = 1.0 / counts[1]
class_weight = {0: weight_for_0, 1: weight_for_1}

history = model.fit(train_ds, epochs=1, validation_data=val_ds, class_weight=class_weight)  # epochs=50 in the example
