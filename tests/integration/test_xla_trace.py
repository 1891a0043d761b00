"""XLA seen in the trace itself, not only in a Keras model's jit_compile flag.

Measured on TensorFlow 2.21's CPU: a jit_compile=True step runs in a "CpuExecutable::ExecuteAsyncOnStream" event
and XLA allocates its buffers inside it, on the same thread, untagged (a Keras model's step) or tagged with the
function's name (a tf.function of the user's: "(untagged)" alone counted 0 bytes of them). The reader keeps those runs
as spans ("xla/..."), the analysis names the allocations made in them "XLA computation", and the report says why
they are in no layer."""

from __future__ import annotations

import numpy as np

from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import xplane

JIT_CELL = """%%tfmem --as rep
@tf.function(jit_compile=True)
def step(x):
    return tf.reduce_sum(tf.nn.relu(x @ w) @ tf.transpose(w))

for _ in range(10):
    step(x)
"""


def test_a_jit_compiled_tf_function_cell_gets_the_xla_note_and_its_bytes(shell):
    import tensorflow as tf

    shell.user_ns.update(tf=tf, w=tf.Variable(tf.random.normal((256, 1024))), x=tf.random.normal((512, 256)))
    assert shell.run_cell(JIT_CELL).success
    report = shell.user_ns["rep"]
    assert report.model is None  # no Keras model: the flag the old rule read does not exist
    info = report.trace
    # each call's run is an event of its own, but not every one is traced: the tracer rotates its segments while
    # XLA compiles (the process grows), and what runs between two segments is not recorded
    assert 1 <= info.xla_runs <= 10, info
    # x @ w is 512x1024 floats (2 MiB): XLA's buffers, named by the launching function or by nothing
    assert info.xla_at_peak_bytes >= 2 * 2**20
    xla = [g for g in info.at_peak if g.op == "XLA computation"]
    assert xla and sum(g.bytes for g in xla) == info.xla_at_peak_bytes
    assert all(g.layer is None and g.phase == "other" for g in xla)
    note = next(n for n in report.notes if "XLA" in n)
    runs = f"{info.xla_runs} XLA run{'s' if info.xla_runs > 1 else ''} traced"
    assert f"Code in this trace ran as XLA computations ({runs})" in note
    assert "tf.function(jit_compile=False)" in note
    assert f"{format_bytes(info.xla_at_peak_bytes)} at the peak is in no layer" in note


def test_the_same_function_without_xla_has_no_note(shell):
    import tensorflow as tf

    shell.user_ns.update(tf=tf, w=tf.Variable(tf.random.normal((64, 128))), x=tf.random.normal((32, 64)))
    assert shell.run_cell(JIT_CELL.replace("jit_compile=True", "jit_compile=False")).success
    report = shell.user_ns["rep"]
    assert report.trace.xla_runs == 0 and report.trace.xla_at_peak_bytes == 0
    assert not any("XLA" in n for n in report.notes)


def test_both_decoders_read_a_real_xla_trace_alike():
    """A real jit_compile trace, through the vectorized decoder and the per-stat reference one: the same events, and
    the same XLA runs as spans, each around the allocations XLA made."""
    import tensorflow as tf

    import tfmem_magic
    from tfmem_magic.analyze import analysis

    w = tf.Variable(tf.random.normal((128, 512)))

    @tf.function(jit_compile=True)
    def step(x):
        return tf.reduce_sum(tf.nn.relu(x @ w))

    x = tf.random.normal((256, 128))
    step(x)
    with tfmem_magic.profile(label="jit", keep_xspaces=True) as p:
        for _ in range(5):
            step(x)
    blobs = [data for data, _ in p.xspaces]
    traces = []
    for reference in (False, True):
        cols, spans = xplane._Columns(), []
        for data in blobs:
            xplane.read_xspace(data, 0, cols, spans, reference=reference)
        traces.append(xplane.finish(cols, spans))
    fast, slow = traces
    for name in ("t_ps", "is_alloc", "live", "chunk", "addr", "limit"):
        assert np.array_equal(getattr(fast.events, name), getattr(slow.events, name)), name
    runs = [(s.name, s.start_ps, s.end_ps, s.thread) for s in fast.spans if s.name.startswith(xplane.XLA_SPAN)]
    assert runs == [(s.name, s.start_ps, s.end_ps, s.thread) for s in slow.spans if s.name.startswith(xplane.XLA_SPAN)]
    assert runs and {name for name, *_ in runs} == {"xla/CpuExecutable::ExecuteAsyncOnStream"}
    # the HLO module that ran, named by its ops' hlo_module stat: the function the allocations are tagged with
    (module,) = fast.xla_modules
    assert fast.xla_modules == slow.xla_modules and "XlaMustCompile_true" in module
    assert xplane.xla_function(module) == step.get_concrete_function(x).name.decode()
    info = analysis.summarize(fast, analysis.TraceContext())
    assert info.xla_runs == len(runs) <= 5 and info.xla_at_peak_bytes >= 256 * 512 * 4
