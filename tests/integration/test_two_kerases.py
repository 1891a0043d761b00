"""Keras 3 and tf_keras (Keras 2) loaded in one process, as TensorFlow 2.16+ does under TF_USE_LEGACY_KERAS=1
(TensorFlow imports Keras 3 itself while `tf.keras` is tf_keras): each model is instrumented with its own Keras."""

from __future__ import annotations

import textwrap

import pytest
from fresh import FRESH_SHELL, run_in_fresh_shell, run_python

pytest.importorskip("tf_keras")
pytestmark = pytest.mark.slow


def test_a_keras3_model_and_a_tf_keras_model_in_one_kernel():
    out = run_in_fresh_shell("""
        import numpy as np, keras, tf_keras
        x, y = np.random.rand(512, 64).astype("float32"), np.random.randint(0, 4, 512)
        results = {}
        for name, k in (("k3", keras), ("k2", tf_keras)):
            model = k.Sequential([k.layers.Input((64,)), k.layers.Dense(256, activation="relu", name=f"{name}_hidden"),
                                  k.layers.Dense(4, name=f"{name}_out")], name=f"{name}_model")
            model.compile(k.optimizers.Adam(), "sparse_categorical_crossentropy")
            sh.user_ns.update(model=model, x=x, y=y)
            result = sh.run_cell("%%tfmem --as rep\\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0, "
                                 "validation_split=0.25)")
            rep = sh.user_ns["rep"]
            results[name] = {"ok": result.success, "package": rep.model.keras_package, "model": rep.model.name,
                             "optimizer": rep.model.optimizer, "slots": rep.model.optimizer_slots,
                             "batch": rep.model.batch_size, "env": rep.env.keras_package,
                             "env_version": rep.env.keras, "version": k.__version__,
                             "layers": [g.layer for g in rep.trace.by_layer],
                             "window": rep.trace.complete or "first" in (rep.trace.note or "")}
        # a custom loop with tf_keras' apply_gradients(zip(...)): the zip is read once by us and still by Keras
        import tensorflow as tf
        opt = tf_keras.optimizers.SGD(0.01)
        sh.user_ns.update(opt=opt, tf=tf, tf_keras=tf_keras)
        result = sh.run_cell(
            "%%tfmem --as loop\\nfor i in range(3):\\n    with tf.GradientTape() as tape:\\n"
            "        loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y[:64], model(x[:64])))\\n"
            "    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))")
        loop = sh.user_ns["loop"]
        results["loop"] = {"ok": result.success, "calls": loop.model.calls, "iterations": int(opt.iterations.numpy())}
        print(json.dumps(results))
    """)
    for name, package in (("k3", "keras"), ("k2", "tf_keras")):
        got = out[name]
        assert got["ok"] and got["package"] == package and got["model"] == f"{name}_model", got
        assert got["optimizer"] == "Adam" and got["slots"] == 2 and got["batch"] == 64, got
        # which of the model's layers hold bytes at the peak depends on where it falls (tf_keras: often in Adam's
        # update, where only the last layer's gradient is live): one of them is named
        assert {f"{name}_hidden", f"{name}_out"} & set(got["layers"]), got
    assert out["k3"]["env"] == "keras"  # tf.keras is Keras 3 here: TF_USE_LEGACY_KERAS is not set
    # the tf_keras model's report names the Keras that made it, though tf.keras is Keras 3 in this process
    assert out["k2"]["env"] == "tf_keras" and out["k2"]["env_version"] == out["k2"]["version"], out["k2"]
    assert out["loop"]["ok"] and "optimizer.apply" in out["loop"]["calls"], out["loop"]
    assert out["loop"]["iterations"] == 3  # every pair reached the optimizer


def test_a_tf_keras_model_not_built_yet_is_checked_before_its_first_fit():
    """keras-io's NER Transformer on tf_keras: a subclassed model whose layer holds a Sequential with no input shape.
    Before its first call tf_keras raises on `model.weights` (ValueError: weights not created yet), which made the
    pre-flight of its first fit fail ("could not check") and the call run unchecked. Its variables are none yet."""
    out = run_python(
        FRESH_SHELL
        + textwrap.dedent("""
        import numpy as np, psutil, tf_keras
        from tfmem_magic.measure import kerases

        class Block(tf_keras.layers.Layer):
            def __init__(self):
                super().__init__()
                self.ffn = tf_keras.Sequential([tf_keras.layers.Dense(64, activation="relu"),
                                                tf_keras.layers.Dense(16)])
            def call(self, x):
                return self.ffn(x)

        class Net(tf_keras.Model):
            def __init__(self):
                super().__init__()
                self.block = Block()
                self.head = tf_keras.layers.Dense(4)
            def call(self, x):
                return self.head(self.block(x))

        model = Net()
        model.compile("adam", "sparse_categorical_crossentropy")
        try:
            model.weights
            raised = None
        except ValueError as exc:
            raised = type(exc).__name__
        before = len(kerases.variables_of(model))
        x, y = np.random.rand(512, 32).astype("float32"), np.random.randint(0, 4, 512)
        limit = psutil.Process().memory_info().rss + 2**30
        sh.user_ns.update(model=model, x=x, y=y)
        result = sh.run_cell(f"%%tfmem --quick --limit {limit} --as rep\\nmodel.fit(x, y, batch_size=64, epochs=1, "
                             "verbose=0)")
        rep = sh.user_ns["rep"]
        print(json.dumps({"ok": result.success, "raised": raised, "before": before,
                          "after": len(kerases.variables_of(model)),
                          "verdict": rep.preflight and rep.preflight.verdict,
                          "unchecked": [n for n in rep.notes if "could not check" in n]}))
    """),
        env={"TF_USE_LEGACY_KERAS": "1"},
    )
    assert out["ok"] and out["raised"] == "ValueError" and out["before"] == 0 and out["after"] == 6, out
    assert out["verdict"] in ("fits", "uncertain") and not out["unchecked"], out
