"""`%tfmem free` and `tfmem_magic.free()`: a fitted model's memory, which TensorFlow 2.21 keeps after `del`,
`clear_session()` and `gc.collect()` (its gradient registry pins it: docs/held-memory.md), comes back without a
restart; models still in use keep training. Each case in a fresh process: the allocator must start empty."""

from __future__ import annotations

import textwrap

import pytest
from fresh import run_in_fresh_shell, run_python

pytestmark = pytest.mark.slow
MiB = 2**20

PREPARED = "import tfmem_magic\ntfmem_magic.prepare()\n"
FIT = """
import gc, json, numpy as np, keras, tensorflow as tf
def current():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]
def fitted(width=4096):
    m = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(width), keras.layers.Dense(10)])
    m.compile("adam", "mse")
    m.fit(np.zeros((96, 1024), "float32"), np.zeros((96, 10), "float32"), batch_size=32, verbose=0)
    return m
"""


def test_free_gives_back_a_fitted_models_memory_that_del_and_clear_session_do_not():
    data = run_python(
        PREPARED
        + FIT
        + textwrap.dedent("""
        start = current()
        m = fitted()
        weights_and_slots = sum(int(np.prod(v.shape)) * 4 for v in m.weights) * 3  # weights, Adam's m and v
        del m
        keras.backend.clear_session(); gc.collect()
        held = current() - start
        keeper = fitted(512)  # a model in use: it must keep training after free()
        with_keeper = current()
        done = tfmem_magic.free()
        after = current()
        keeper.fit(np.zeros((64, 1024), "float32"), np.zeros((64, 10), "float32"), batch_size=16, verbose=0)
        print(json.dumps({"held": held, "expected": weights_and_slots, "freed": done.freed, "purged": done.purged,
                          "before": with_keeper, "after": after, "text": done.text(),
                          "keeper_ok": bool(np.isfinite(keeper.get_weights()[0]).all())}))
    """)
    )
    # what TF 2.21 keeps without help: the fitted model's weights and both Adam slots
    assert data["held"] >= 0.95 * data["expected"], data
    assert data["purged"] >= 1 and data["freed"] == data["before"] - data["after"]
    assert data["freed"] >= 0.95 * data["expected"], data  # all of it came back
    assert data["keeper_ok"]  # the model still in use fitted again (its graph is retraced as needed)
    assert "given back" in data["text"] and "RSS does not shrink" in data["text"]


def test_percent_tfmem_free_drops_the_names_and_says_what_came_back():
    data = run_in_fresh_shell(
        FIT
        + textwrap.dedent("""
        sh.user_ns.update(fitted=fitted, current=current)
        sh.run_cell("models = [fitted(), fitted()]")
        before = current()
        from IPython.utils.capture import capture_output
        with capture_output() as said:
            sh.run_cell("%tfmem free models")
        unknown = sh.run_cell("%tfmem free no_such_name")
        print(json.dumps({"before": before, "after": current(), "said": said.stdout,
                          "gone": "models" not in sh.user_ns,
                          "unknown": type(unknown.error_in_exec).__name__, "why": str(unknown.error_in_exec)}))
    """)
    )
    assert data["gone"] and data["before"] - data["after"] >= 2 * 3 * 4 * 1024 * 4096 * 0.95, data
    assert "Dropped models." in data["said"] and "given back" in data["said"] and "traced gradient" in data["said"]
    assert data["unknown"] == "UsageError" and "no variable named no_such_name" in data["why"]


def test_without_the_private_registry_free_says_the_memory_stays_held():
    data = run_python(
        PREPARED
        + FIT
        + textwrap.dedent("""
        from tensorflow.python.framework import ops
        from tfmem_magic.measure import capabilities
        m = fitted(); del m
        ops._gradient_registry = object()  # a TensorFlow whose registry moved
        capabilities.forget()
        done = tfmem_magic.free()
        print(json.dumps({"purged": done.purged, "readable": done.registry_readable, "text": done.text(),
                          "notes": capabilities.notes()}))
    """)
    )
    assert data["purged"] == 0 and data["readable"] is False
    assert "may stay held until the kernel restarts" in data["text"]
    assert any("gradient registry is unavailable" in n for n in data["notes"]), data["notes"]
