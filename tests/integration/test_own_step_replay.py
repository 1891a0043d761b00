"""Custom training calibrates on its own step (issue 29): a model whose `train_step` is its own (keras-io's DCGAN
pattern, two optimizers) and a GradientTape loop's `@tf.function` step (TensorFlow's quickstart for experts) are
not clones of a Keras config, so calibration saves the step the cell ran, with its variables, and the step replay's
two probe processes run it (advise/step_export.py). The programs are benchmarks/custom_step_accuracy.py's, run as a
notebook runs them in a fresh process (model and data first, TensorFlow running, then the measured cell); the
prediction at twice the cell's batch is compared with a fresh process that runs the cell at that batch."""

from __future__ import annotations

import pytest
from fresh import load_benchmark

from tfmem_magic.advise.bands import OWN_STEP_BAND

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("program, step", [("gan", "GAN.train_step"), ("tape", "a GradientTape loop's step")])
def test_custom_training_calibrates_on_the_step_the_cell_ran(program, step):
    bench = load_benchmark("custom_step_accuracy")
    cell = bench.run(program, 32, True, [64])
    assert cell["basis"] == "analytic"  # no clone: until calibrated, the parts model
    assert cell["step_basis"] == "replay" and cell["step_source"] == "step", cell
    assert cell["step_own_error"] <= 0.01  # each probe's trace replays to its own peak
    assert any(step in note for note in cell["step_notes"]), cell["step_notes"]
    assert any(f"The band is ±{OWN_STEP_BAND:.0%}" in note for note in cell["step_notes"])
    real = bench.run(program, 64, False, [64])["peak"]
    predicted = cell["step"]["64"]
    # within the band it states (its error on these programs at twice the batch: 0-7%, the benchmark's table)
    assert abs(predicted - real) <= OWN_STEP_BAND * real, (predicted, real, cell["peak"])
