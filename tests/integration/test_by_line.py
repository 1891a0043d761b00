"""Which line of the user's code holds the memory (docs/lines.md): the report's by-line view, in a real IPython shell.

Each cell runs with its own execution count (store_history=True), so a line is named by the cell it is in
(`In [2] line 5`), not by the cell that ran it. Each test's TensorFlow work is one small fit (a few steps).
"""

from __future__ import annotations

import pytest

import tfmem_magic
from tfmem_magic.core import fallbacks
from tfmem_magic.core.report import LineGroup, Report
from tfmem_magic.show.render import render_text

pytestmark = pytest.mark.slow

IMPORTS = "import numpy as np, keras, tensorflow as tf"
WIDE = """class Wide(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 8192))
    def call(self, x):
        return keras.ops.matmul(x, self.w)
"""
DATA = 'x = np.random.rand(512, 64).astype("float32"); y = np.random.rand(512, 1).astype("float32")'
MODEL = (  # the cell that makes the model of the custom layers (In [3]), and the data
    "model = keras.Sequential([keras.Input((64,)), Wide(), Square(), keras.layers.Dense(1)])\n"
    f'model.compile("sgd", "mse")\n{DATA}'
)
FIT = "%%tfmem --no-panel\nmodel.fit(x, y, batch_size=256, epochs=1, verbose=0)\n"
MiB = 1 << 20
# x * x's gradient reads x: Wide's output is live until its own gradient is made, so it is live at the step's peak in
# every order the executor runs the backward pass in (with a Dense alone next, a run that computes the Dense's kernel
# gradient first frees it early, and the peak holds only gradients). Grappler rewrites the Mul as a Square node of
# its own name (`square_1/ReplaceMulWithSquare_mul`): it is named by the one line of its name scope
SQUARE = """
class Square(keras.layers.Layer):
    def call(self, x):
        return x * x
"""


def run(shell, *cells: str) -> Report:
    """Run each cell as a notebook would (each its own `In [n]`); the last published report."""
    for cell in cells:
        result = shell.run_cell(cell, store_history=True)
        assert result.success, result.error_in_exec or result.error_before_exec
    report = tfmem_magic.last_report()
    assert report is not None and report.trace is not None
    return report


def group(report: Report, code: str) -> LineGroup:
    """The by-line group whose line's text holds `code` (and the report's JSON and text name it too)."""
    assert report.trace is not None
    found = [g for g in report.trace.by_line if g.kind == "line" and code in (g.code or "")]
    assert found, f"no line with {code!r} in {[(g.label, g.code, g.bytes) for g in report.trace.by_line]}"
    as_json = report.to_dict()["trace"]["by_line"]
    assert any(code in (g["code"] or "") and g["label"] == found[0].label for g in as_json)
    text = render_text(report)
    assert "By line" in text and found[0].label in text and code in text, text
    return found[0]


def test_a_custom_layers_call_line_is_named_in_the_cell_it_is_defined(shell):
    report = run(
        shell,
        IMPORTS,
        WIDE + SQUARE,
        MODEL,
        FIT,
    )
    line = group(report, "keras.ops.matmul(x, self.w)")
    assert line.label == "In [2] line 5"  # the class's cell, not the cell that ran the fit
    assert line.bytes >= 256 * 8192 * 4 and line.forward_bytes >= 256 * 8192 * 4
    assert any(t.shape == "[256,8192]" and t.op == "MatMul" for t in line.tensors)
    # the Mul grappler rewrote is in no function's def: named by the one line of its layer's name scope, not guessed
    assert report.trace is not None
    for g in report.trace.by_line:
        if (g.layer or "").startswith("square"):
            assert g.kind == "line" and g.code == "return x * x" and g.label == "In [2] line 9", g
    assert (
        (line.layer or "").startswith("wide")
        and line.made_by == "In [3] line 1"
        and "Wide()" in (line.made_by_code or "")
    )


def test_a_built_in_layer_is_named_by_the_line_that_made_it(shell):
    report = run(
        shell,
        IMPORTS,
        "model = keras.Sequential([\n"
        "    keras.Input((64,)),\n"
        "    keras.layers.Dense(4096),\n"
        "    keras.layers.Dense(1),\n"
        "])\n"
        f'model.compile("sgd", "mse")\n{DATA}',
        FIT,
    )
    dense = group(report, "keras.layers.Dense(4096)")
    assert dense.label == dense.made_by == "In [2] line 3" and (dense.layer or "").startswith("dense")
    # the peak holds its activations [256,4096], their gradient, or its kernel's gradient [64,4096] (the step's
    # moment varies from run to run): at least one tensor it made, whole
    assert dense.bytes >= 64 * 4096 * 4 and any("4096" in (t.shape or "") for t in dense.tensors)
    assert report.trace is not None and report.trace.by_line_named_bytes >= dense.bytes


def test_a_custom_train_steps_line_is_named(shell):
    report = run(
        shell,
        IMPORTS,
        """class Scratchy(keras.Model):
    def train_step(self, data):
        x, y = data
        scratch = tf.tile(tf.ones([1024, 1024]) * tf.reduce_mean(x), [16, 1])
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=pred) + 1e-12 * tf.reduce_sum(scratch)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}

inputs = keras.Input((64,))
model = Scratchy(inputs, keras.layers.Dense(1)(keras.layers.Dense(64)(inputs)))
model.compile("sgd", "mse")
""",
        DATA,
        # the allocator's regions grown to hold the scratch tensor before the profiled cell: a 64 MiB jump of the
        # process in a young trace segment can make the tracer restart the segment around it (measure/tracer.py),
        # and the tensor is then "allocated while the trace was paused", in no line
        "_ = tf.zeros([24, 1024, 1024]).numpy().sum(); del _",
        FIT,
    )
    tile = group(report, "tf.tile(tf.ones([1024, 1024]) * tf.reduce_mean(x), [16, 1])")
    assert tile.label == "In [2] line 4"
    assert tile.bytes >= 64 * MiB and any(t.shape == "[16384,1024]" and t.op == "Tile" for t in tile.tensors)


def test_a_function_traced_in_an_earlier_cell_still_names_the_line(shell):
    """The train function is traced by an unprofiled fit in an earlier cell: the profiled cell runs that concrete
    function, whose stacks are its first trace's; the line is still the one in the class's cell."""
    report = run(
        shell,
        IMPORTS,
        WIDE + SQUARE,
        MODEL,
        "model.fit(x, y, batch_size=256, epochs=1, verbose=0)",
        FIT,
    )
    traced = {name for name in report.tf_function_traces if "step_on" in name}  # Keras' own (tf.data's differ)
    assert not traced, f"the train function was traced anew: {traced}"
    line = group(report, "keras.ops.matmul(x, self.w)")
    assert line.label == "In [2] line 5" and line.bytes >= 256 * 8192 * 4


COMPREHENSION = "parts = [tf.random.normal([1024, 1024]) for _ in range(8)]"
CONCAT = "whole = tf.concat(parts, 0)"


def op_callbacks_left() -> list[object]:
    """The op callbacks this thread still has, and whether TensorFlow's execute still calls them."""
    from tensorflow.python.eager import context, execute

    left = list(context.context().op_callbacks)
    return left + ([execute.execute] if execute.execute is not execute.quick_execute else [])


def test_eager_ops_are_named_by_the_line_that_ran_them(shell):
    """Eager ops' allocations carry their op type alone in the trace: the op callback tfmem adds while the trace
    records notes the line that ran each, and the peak's eager tensors are paired with those ops by type, size and
    order (eight 4 MiB tensors of a list comprehension, and their concat)."""
    report = run(
        shell,
        IMPORTS,
        # the allocator's regions grown first, as in the custom train_step test: a 64 MiB jump of the process in a
        # young trace segment can make the tracer restart the segment around it, and what it allocated then is in
        # no line (the trace lost it)
        "_ = tf.zeros([24, 1024, 1024]).numpy().sum(); del _",
        f"%%tfmem --no-panel\n{COMPREHENSION}\n{CONCAT}\n",
    )
    parts = group(report, COMPREHENSION)
    assert parts.label == "In [3] line 2" and parts.kind == "line"  # the %%tfmem cell's line, as the notebook shows it
    assert parts.bytes >= 8 * 4 * MiB and parts.count >= 8
    assert all(t.shape == "[1024,1024]" and t.dtype == "float32" for t in parts.tensors), parts.tensors
    whole = group(report, CONCAT)
    assert whole.label == "In [3] line 3" and whole.bytes >= 32 * MiB
    assert whole.tensors[0].shape == "[8192,1024]" and whole.tensors[0].op == "ConcatV2"
    assert report.trace is not None and report.trace.by_line_named_bytes >= 64 * MiB
    assert not op_callbacks_left()  # removed with the trace


def test_the_op_callback_is_removed_when_the_cell_raises(shell):
    assert shell.run_cell(IMPORTS, store_history=True).success
    # a Keras layer called eagerly: TensorFlow's op wrappers run some of its ops on their slow path, which names the
    # op in bytes (the callback must never fail the user's op)
    fallbacks.forget()
    layer = shell.run_cell("%%tfmem --no-panel\ny = keras.layers.Dense(8)(tf.ones([4, 4]))\n", store_history=True)
    assert layer.success, layer.error_in_exec
    assert not [f for f in fallbacks.recent() if "eager_ops" in f.where], fallbacks.recent()
    result = shell.run_cell("%%tfmem --no-panel\nx = tf.ones([4]) + 1\nraise ValueError('the cell failed')\n")
    assert not result.success and isinstance(result.error_in_exec, ValueError)
    assert not op_callbacks_left()
