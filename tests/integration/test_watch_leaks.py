"""Watch mode, history and compare, and the rules that need several runs: leak-growth and retracing."""

from __future__ import annotations

import gc
import textwrap
import threading

import psutil
import pytest
from fresh import run_in_fresh_shell
from IPython.core.error import UsageError

from tfmem_magic import pipeline


def hooks(shell) -> tuple[int, int]:
    return len(shell.events.callbacks["pre_run_cell"]), len(shell.events.callbacks["post_run_cell"])


@pytest.fixture
def watching(shell):
    before = hooks(shell)
    shell.run_line_magic("tfmem", "watch on")
    yield shell
    shell.run_line_magic("tfmem", "watch off")
    assert hooks(shell) == before  # turning it off leaves no hook


def test_watch_reports_every_cell_once(watching, displayed):
    shell = watching
    assert hooks(shell) != (0, 0)
    before = pipeline.last_report()
    shell.run_cell("import tensorflow as tf\nw = tf.ones((256, 256))")
    watched = pipeline.last_report()
    assert watched is not before and watched.mode == "quick" and watched.label.startswith("import tensorflow")
    line = displayed()[-1]["text/plain"]
    assert line.startswith("tfmem · TF peak +") and "RSS" in line
    shell.run_cell("%%tfmem --quick --label own\nz = 1")  # reports itself; watch must not measure it again
    assert pipeline.last_report().label == "own" and pipeline.history[-2] is watched


def test_watch_over_200_cells_adds_no_thread_and_little_memory(watching):
    shell = watching
    for i in range(20):
        shell.run_cell(f"warm = {i}")
        shell.display_pub.outputs.clear()
    gc.collect()
    threads = {t.name for t in threading.enumerate()}
    rss = psutil.Process().memory_info().rss
    for i in range(200):
        shell.run_cell(f"v = {i}")
        shell.display_pub.outputs.clear()
    gc.collect()
    growth = psutil.Process().memory_info().rss - rss
    print(f"RSS growth over 200 watched cells: {growth / 2**20:.2f} MiB")
    assert {t.name for t in threading.enumerate()} == threads
    assert growth < 4 * 2**20


LEAK_RUNS = """
import gc
sh.run_line_magic("tfmem", "watch on")
sh.run_cell("import tensorflow as tf\\nkept = []")
out = {"leaking": [], "clean": []}
for cell, runs in (("kept.append(tf.ones((256, 1024)))", out["leaking"]),  # 1 MiB more every run
                   ("scratch = tf.ones((256, 1024))", out["clean"])):  # replaced every run
    for _ in range(5):
        gc.collect()  # garbage collected during a run would free tensors and hide that run's growth
        sh.run_cell(cell)
        report = pipeline.last_report()
        fired = [f.evidence for f in report.findings if f.id == "leak-growth"]
        runs.append([report.run, fired[0] if fired else None])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_leak_rule_fires_on_a_leaking_cell_and_not_on_a_clean_one():
    # in a fresh process: after other tests TensorFlow sometimes kept a cache of its own during one of the runs
    out = run_in_fresh_shell(LEAK_RUNS)
    assert [run for run, _ in out["leaking"]] == [1, 2, 3, 4, 5]
    fired = [evidence for _, evidence in out["leaking"]]
    assert [e is not None for e in fired] == [False, False, True, True, True]  # three growing runs in a row
    growth = fired[-1].split(" left ", 1)[1].split(" live ")[0]
    steps = [float(part.strip().lstrip("+").split()[0]) for part in growth.split(",")]
    assert len(steps) == 3 and all(1.0 <= step <= 1.5 for step in steps) and "MiB" in growth, growth
    assert "list" in fired[-1]
    assert [e for _, e in out["clean"]] == [None] * 5


def test_retracing_rule(shell):
    shell.run_cell(
        "import tensorflow as tf\n@tf.function\ndef double(x):\n    return x * 2\n"
        "@tf.function\ndef triple(x):\n    return x * 3"
    )
    assert shell.run_cell("%%tfmem --quick --as r\nfor i in range(5):\n    double(i)").success
    report = shell.user_ns["r"]
    assert report.tf_function_traces.get("double") == 5
    finding = next(f for f in report.findings if f.id == "retracing")
    assert "'double' was traced 5 times" in finding.title and "Python number" in finding.evidence
    assert shell.run_cell("%%tfmem --quick --as r\nfor i in range(5):\n    triple(tf.constant(i))").success
    assert shell.user_ns["r"].tf_function_traces.get("triple") == 1
    assert not any(f.id == "retracing" for f in shell.user_ns["r"].findings)


def test_a_train_step_over_batches_with_a_partial_last_one_is_not_a_retrace(shell):
    """TensorFlow's "quickstart for experts": a @tf.function train step that creates the optimizer's variables on
    its first call (TensorFlow traces that call twice) over a dataset whose last batch is partial (a second
    signature): 3 graphs, 2 signatures, neither growing with the calls."""
    shell.run_cell(
        textwrap.dedent("""
        import keras, tensorflow as tf
        qs_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        qs_opt = keras.optimizers.Adam()
        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((qs_model(x) - y) ** 2)
            grads = tape.gradient(loss, qs_model.trainable_variables)
            qs_opt.apply_gradients(zip(grads, qs_model.trainable_variables))
        qs_data = tf.data.Dataset.from_tensor_slices((tf.zeros((100, 8)), tf.zeros((100, 4)))).batch(32)
    """)
    )
    assert shell.run_cell(
        "%%tfmem --quick --as r\nfor epoch in range(3):\n    for x, y in qs_data:\n        train_step(x, y)"
    ).success
    report = shell.user_ns["r"]
    assert report.tf_function_traces.get("train_step") == 3 and report.tf_function_signatures["train_step"] == 1
    assert not any(f.id == "retracing" for f in report.findings)
    # batches of a new size on every call do grow: each is a graph kept
    shell.run_cell("@tf.function\ndef total(x):\n    return tf.reduce_sum(x)")
    assert shell.run_cell("%%tfmem --quick --as r\nfor n in range(1, 6):\n    total(tf.ones((n, 3)))").success
    report = shell.user_ns["r"]
    assert report.tf_function_signatures["total"] == 4  # sizes 1 and 2 are the natural pair; 3, 4, 5 grow
    assert any(f.id == "retracing" for f in report.findings)


def test_compare_two_reports(shell, displayed):
    shell.run_cell("%%tfmem --quick --label small --as a\nimport tensorflow as tf\nx = tf.ones((64, 64))")
    shell.run_cell("%%tfmem --quick --label big\ny = tf.ones((1024, 1024))")
    shell.run_line_magic("tfmem", "compare a big")
    text = displayed()[-1]["text/plain"]
    assert "TF peak over baseline" in text and "small" in text and "big" in text
    number = pipeline.history[-1].number  # numbers stay with their report while the history rolls over
    shell.run_line_magic("tfmem", f"compare {number - 1} {number}")
    assert "small" in displayed()[-1]["text/plain"] and "big" in displayed()[-1]["text/plain"]
    with pytest.raises(UsageError, match="no report 'nope'"):
        shell.run_line_magic("tfmem", "compare a nope")
    with pytest.raises(UsageError, match="give two reports"):
        shell.run_line_magic("tfmem", "compare a")
