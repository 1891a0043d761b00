"""mixed_float16 (a GPU's precision, run here on CPU: slow there, not wrong): Keras wraps the optimizer in a
LossScaleOptimizer. Every fix that applies to such a report is written with a prediction, and the fix cells that
retrain run in the kernel: the wrapper's name must break none of them."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

CELL = "model.fit(x, y, batch_size=64, epochs=1, verbose=0)"


def test_every_fix_of_a_mixed_float16_report_predicts_and_its_cells_run(shell):
    import keras

    from tfmem_magic.advise import fixes

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(512, activation="relu", name="hidden"),
                keras.layers.Dense(512, activation="relu", name="hidden2"),
                keras.layers.Dense(10, dtype="float32", name="out"),
            ]
        )
        model.compile("adam", "sparse_categorical_crossentropy")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    shell.user_ns.update(model=model, x=np.random.rand(256, 64).astype("float32"), y=np.random.randint(0, 10, 256))
    assert shell.run_cell(f"%%tfmem --as rep\n{CELL}").success
    report = shell.user_ns["rep"]
    assert report.model.optimizer == "Adam" and report.model.dtype_policy == "mixed_float16"
    ctx = fixes.FixContext(source=CELL, model_name="model", array_names=("x", "y"), number=report.number)
    written = {}
    for fix_id in ("shrink-batch", "grad-accumulation", "lighter-optimizer", "freeze-layers", "tf-data-streaming"):
        fix = fixes.WRITERS[fix_id](report, ctx)  # none may raise on the wrapper
        if fix is not None:
            written[fix_id] = fix
    # the fixes that change what a step holds predict their peak from the what-if, through the wrapper
    for fix_id in ("grad-accumulation", "lighter-optimizer", "freeze-layers"):
        assert fix_id in written, sorted(written)
        assert written[fix_id].predicted_peak_bytes is not None, fix_id
        assert 0 < written[fix_id].predicted_peak_bytes < 2 * report.tf_peak_bytes, fix_id
    # SGD keeps no slots: Adam's two (float32, under the wrapper) go
    assert written["lighter-optimizer"].predicted_peak_bytes < report.tf_peak_bytes
    # the cells run as a user would run them, one after another, each measured against the report it fixes
    for fix_id in ("grad-accumulation", "lighter-optimizer", "freeze-layers"):
        result = shell.run_cell(written[fix_id].code)
        assert result.success, (fix_id, result.error_in_exec)
