"""A model that ran `fit` is never freed: TF's gradient registry pins its traced graph.

Run:  python fitted_model_not_freed.py          (Keras 3 model.fit; needs keras>=3)
      python fitted_model_not_freed.py puretf   (no Keras: tf.custom_gradient in a tf.function)

Measured on TF 2.21.0 + Keras 3.15.1, CPU (BFC allocator switched on so get_memory_info reads it):
  keras : held after del/clear_session/gc = 48.7 MiB (Dense(4096) weights + Adam m and v), freed by the purge
  puretf: held after del/gc = 4.0 MiB (the 4 MiB variable), freed by the purge

Mechanism: tf.custom_gradient, when traced in graph mode (inside tf.function), registers
`internal_grad_fn` under "CustomGradient-<uid>" in the global `ops._gradient_registry`
(tensorflow/python/ops/custom_gradient.py:512) and never unregisters it. Its closure `tape_grad_fn`
(custom_gradient.py:489) captures `result` (a list of SymbolicTensors, custom_gradient.py:491-492),
whose `.graph` is the tf.function's FuncGraph, whose captures hold the variables' resource-handle
EagerTensors; a live handle keeps the variable's buffer alive even after the tf.Variable is gone.
Keras 3 hits this on every train trace: TFOptimizer._all_reduce_sum_gradients
(keras/src/backend/tensorflow/optimizer.py:159) calls the default ReplicaContext.all_reduce, which
wraps a @custom_gradient (tensorflow/python/distribute/distribute_lib.py:3649).
Upstream: tensorflow/tensorflow#97697, #27492; fix PRs tensorflow#109334, keras-team/tf-keras#898.
"""
import gc
import os
import sys
import weakref

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"  # before TF is imported: lets get_memory_info('CPU:0') work
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops  # private: only for the purge at the end

MiB = 1 << 20


def live():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


def custom_gradient_entries():
    return [k for k in ops._gradient_registry._registry if k.startswith("CustomGradient-")]


def keras_case():
    import keras

    x = np.random.rand(96, 1024).astype("float32")
    y = np.random.rand(96, 10).astype("float32")
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse")  # run_eagerly=True does not leak
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # 3 steps
    print(f"after fit:                      {(live() - base) / MiB:7.2f} MiB live")
    ref = weakref.ref(model)
    del model
    keras.backend.clear_session()  # also resets the default graph and clears the kernel cache
    gc.collect()
    return ref


def puretf_case():
    v = tf.Variable(tf.zeros([1024 * 1024]))  # 4 MiB

    @tf.custom_gradient
    def ident(x):
        return tf.identity(x), lambda dy: dy

    @tf.function
    def f():
        return tf.reduce_sum(ident(tf.ones([4]))) + tf.reduce_sum(v)

    f()
    print(f"after tf.function call:         {(live() - base) / MiB:7.2f} MiB live")
    ref = weakref.ref(v)
    del v, f, ident
    gc.collect()
    return ref


tf.constant(1.0) + 1  # initialise the runtime before the baseline
gc.collect()
base = live()
ref = puretf_case() if sys.argv[1:] == ["puretf"] else keras_case()
print(f"after del + clear_session + gc: {(live() - base) / MiB:7.2f} MiB live   "
      f"(object dead: {ref() is None}; CustomGradient entries: {len(custom_gradient_entries())})")

# The holder: drop the CustomGradient-* registrations, and the memory comes back.
for name in custom_gradient_entries():
    del ops._gradient_registry._registry[name]
gc.collect()
print(f"after purging the registry:     {(live() - base) / MiB:7.2f} MiB live")
