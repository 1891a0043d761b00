# Follows the keras.io example "Timeseries forecasting for weather prediction"
# https://keras.io/examples/timeseries/timeseries_weather_forecasting/
"""The example's preprocessing, model and training code as published (Keras 3 version), on a synthetic
Jena-climate-like table (numpy instead of pandas: the 14 feature columns as arrays) of 6,000 rows instead of 420,551,
a 20-hour window instead of 5 days, 2 epochs; the checkpoint goes to a temporary folder. Defines `model`, `history`."""

import os
import tempfile

import numpy as np
import keras

keras.utils.set_random_seed(0)

feature_keys = [
    "p (mbar)",
    "T (degC)",
    "Tpot (K)",
    "Tdew (degC)",
    "rh (%)",
    "VPmax (mbar)",
    "VPact (mbar)",
    "VPdef (mbar)",
    "sh (g/kg)",
    "H2OC (mmol/mol)",
    "rho (g/m**3)",
    "wv (m/s)",
    "max. wv (m/s)",
    "wd (deg)",
]

# synthetic stand-in for pd.read_csv("jena_climate_2009_2016.csv"): a daily cycle plus noise, one reading every 10 min
rows = 6000
t = np.arange(rows, dtype="float32")
rng = np.random.default_rng(0)
columns = {
    key: (np.sin(2 * np.pi * t / 144 + i) * (i + 1) + rng.normal(0, 0.3, rows) + 10 * i).astype("float32")
    for i, key in enumerate(feature_keys)
}

split_fraction = 0.715
train_split = int(split_fraction * rows)
step = 6

past = 120  # 720 in the example
future = 12  # 72 in the example
learning_rate = 0.001
batch_size = 256
epochs = 2  # 10 in the example


def normalize(data, train_split):
    data_mean = data[:train_split].mean(axis=0)
    data_std = data[:train_split].std(axis=0)
    return (data - data_mean) / data_std


selected_features = [feature_keys[i] for i in [0, 1, 5, 7, 8, 10, 11]]
features = np.stack([columns[key] for key in selected_features], axis=1)  # df[selected_features].values

features = normalize(features, train_split)

train_data = features[0:train_split]
val_data = features[train_split:]

"""
# Training dataset

The training dataset labels starts from the 132nd observation (120 + 12).
"""

start = past + future
end = start + train_split

x_train = train_data[:, [i for i in range(7)]]
y_train = features[start:end][:, [1]]

sequence_length = int(past / step)

dataset_train = keras.utils.timeseries_dataset_from_array(
    x_train,
    y_train,
    sequence_length=sequence_length,
    sampling_rate=step,
    batch_size=batch_size,
)

"""
## Validation dataset
"""

x_end = len(val_data) - past - future

label_start = train_split + past + future

x_val = val_data[:x_end][:, [i for i in range(7)]]
y_val = features[label_start:][:, [1]]

dataset_val = keras.utils.timeseries_dataset_from_array(
    x_val,
    y_val,
    sequence_length=sequence_length,
    sampling_rate=step,
    batch_size=batch_size,
)


for batch in dataset_train.take(1):
    inputs, targets = batch

print("Input shape:", inputs.numpy().shape)
print("Target shape:", targets.numpy().shape)

"""
## Training
"""

inputs = keras.layers.Input(shape=(inputs.shape[1], inputs.shape[2]))
lstm_out = keras.layers.LSTM(32)(inputs)
outputs = keras.layers.Dense(1)(lstm_out)

model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate), loss="mse")
model.summary()

"""
We'll use the `ModelCheckpoint` callback to regularly save checkpoints, and
the `EarlyStopping` callback to interrupt training when the validation loss
is not longer improving.
"""

path_checkpoint = os.path.join(tempfile.mkdtemp(), "model_checkpoint.weights.h5")
es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)

modelckpt_callback = keras.callbacks.ModelCheckpoint(
    monitor="val_loss",
    filepath=path_checkpoint,
    verbose=1,
    save_weights_only=True,
    save_best_only=True,
)

history = model.fit(
    dataset_train,
    epochs=epochs,
    validation_data=dataset_val,
    callbacks=[es_callback, modelckpt_callback],
)
