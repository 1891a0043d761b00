"""What a fit/evaluate/predict call was fed, read from its arguments by name (no TensorFlow needed: numpy only)."""

from __future__ import annotations

import numpy as np

from tfmem_magic.measure import feeding


def fit(
    self,
    x=None,
    y=None,
    batch_size=None,
    epochs=1,
    verbose="auto",
    callbacks=None,
    validation_split=0.0,
    validation_data=None,
    shuffle=True,
    class_weight=None,
    sample_weight=None,
):
    """Keras 3's fit signature (the parts that matter here)."""


def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """Keras 3's predict signature: batch_size is the second parameter, not the third as in fit."""


def test_positional_and_keyword_arguments_read_the_same():
    x, y = np.zeros((100, 4), "float32"), np.zeros(100, "int64")
    by_position = feeding.describe_feed("fit", feeding.bind(fit, (x, y, 25), {}))
    by_name = feeding.describe_feed("fit", feeding.bind(fit, (), {"x": x, "y": y, "batch_size": 25}))
    assert by_position == by_name
    assert (by_position.batch_size, by_position.batch_source, by_position.samples) == (25, "batch_size argument", 100)
    assert feeding.describe_feed("predict", feeding.bind(predict, (x, 10), {})).batch_size == 10
    assert feeding.bind(fit, (), {"nonsense": 1}) == {}  # Keras will say what is wrong, not us


def test_validation_split_counts_the_training_rows_and_both_copies():
    x, y = np.zeros((1000, 8), "float32"), np.zeros((1000, 1), "float32")
    feed = feeding.describe_feed("fit", feeding.bind(fit, (x, y), {"validation_split": 0.1}))
    assert feed.samples == 900 and feed.validation_samples == 100
    assert feed.batch_size == 32 and feed.batch_source == "Keras' default for arrays (32)"
    copies = {(a.role, a.copy_bytes) for a in feed.arrays}
    assert copies == {("x", 900 * 32), ("validation x", 100 * 32), ("y", 900 * 4), ("validation y", 100 * 4)}
    # validation_data wins over validation_split (as in Keras)
    feed = feeding.describe_feed(
        "fit", feeding.bind(fit, (x, y), {"validation_split": 0.1, "validation_data": (x[:50], y[:50])})
    )
    assert feed.samples == 1000 and feed.validation == "validation_data: 50 rows"


def test_dict_inputs_sample_weights_and_a_small_dataset():
    x = {"age": np.zeros((20, 1), "float32"), "city": np.zeros((20, 1), "int64")}
    feed = feeding.describe_feed(
        "fit", feeding.bind(fit, (x, np.zeros(20)), {"sample_weight": np.ones(20), "batch_size": 64})
    )
    assert feed.batch_size == 20  # fewer rows than the batch: one batch of 20
    assert sorted(a.role for a in feed.arrays) == ["sample_weight", "x", "x", "y"]
    leaf = feeding.LEAF
    assert feed.structure == {
        "x": {"age": {leaf: [[1], "float32"]}, "city": {leaf: [[1], "int64"]}},
        "y": {leaf: [[], "float64"]},
        "sample_weight": {leaf: [[], "float64"]},
    }
    assert feeding.structure_leaves(feed.structure["x"]) == [([1], "float32"), ([1], "int64")]


def test_a_generator_is_passed_through_whole_and_its_first_batch_noted():
    seen = []
    source = ((np.zeros((16, 3)), np.zeros((16, 2), "float32")) for _ in range(3))
    spied = feeding.spy_generator(source, seen.append)
    assert len(list(spied)) == 3 and len(seen) == 1
    leaf = feeding.LEAF
    assert feeding.batch_of(seen[0]) == (16, {"x": {leaf: [[3], "float64"]}, "y": {leaf: [[2], "float32"]}}, (16, 3))
    # several outputs, and a Python list (no shape): the nesting is kept, the list has no spec
    batch = (np.zeros((8, 5)), [np.zeros((8, 1)), [0] * 8], np.ones(8))
    assert feeding.split_batch(batch)["y"] == [{leaf: [[1], "float64"]}, [None] * 8]
    assert feeding.split_batch(batch)["sample_weight"] == {leaf: [[], "float64"]}
    # the probes can make x and the weights, not targets with a shapeless list among them
    assert feeding.complete(feeding.split_batch(batch)["x"]) and not feeding.complete(feeding.split_batch(batch)["y"])
    # a failure while describing must never reach the user's training
    assert len(list(feeding.spy_generator(iter([1, 2]), lambda item: 1 / 0))) == 2
