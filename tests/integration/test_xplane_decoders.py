"""The vectorized xplane decoder against the one-stat-at-a-time reference, on real and hand-made traces."""

from __future__ import annotations

import numpy as np

from tfmem_magic.measure import xplane
from tfmem_magic.measure.instrument import Instrumentation
from tfmem_magic.measure.tracer import Tracer


def decode_both(data: bytes):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(data)
    raw = xplane._lazy_space_class()()
    raw.ParseFromString(data)
    out = []
    for fast in (True, False):
        cols, spans = xplane._Columns(), []
        for plane, raw_plane in zip(space.planes, raw.planes, strict=True):
            if plane.name.startswith("/host:"):
                if fast:
                    xplane._read_plane_fast(plane, raw_plane, 0, cols, spans)
                else:
                    xplane._read_plane_slow(plane, 0, cols, spans)
        out.append(xplane.finish(cols, spans))
    return out


def test_fast_decoder_equals_reference_on_a_real_trace():
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="d1"), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    x = np.random.rand(256, 8).astype("float32")
    tracer = Tracer(0.0, max_seconds=0)
    tracer.start()
    instrumentation = Instrumentation(tracer, trace_steps=1000)  # layer and phase spans, as in a cell
    instrumentation.install()
    try:
        model(tf.constant(x))
        model.fit(x, x[:, :1], batch_size=32, epochs=1, verbose=0)
    finally:
        instrumentation.uninstall()
    (data, _), *_ = tracer.finish()
    fast, slow = decode_both(data)
    assert len(fast.events) > 100 and any(s.name.startswith("layer/") for s in fast.spans)
    for name in ("t_ps", "is_alloc", "live", "requested", "chunk", "addr", "dtype", "thread"):
        assert np.array_equal(getattr(fast.events, name), getattr(slow.events, name)), name
    for name in ("op", "region", "shape"):
        assert ([fast.events.string(i) for i in getattr(fast.events, name)]
                == [slow.events.string(i) for i in getattr(slow.events, name)]), name
    assert [(s.name, s.start_ps, s.end_ps) for s in fast.spans] == [(s.name, s.start_ps, s.end_ps) for s in slow.spans]


def test_inline_string_stats_fall_back_to_the_reference_decoder():
    """Another TF version could store tf_op as str_value: the fast path must hand over, not misread."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=1, name="/host:CPU")
    plane.event_metadata[1].id, plane.event_metadata[1].name = 1, "MemoryAllocation"
    plane.event_metadata[2].id, plane.event_metadata[2].name = 2, "tfmem:layer/dense"
    for sid, name in enumerate(("bytes_allocated", "requested_bytes", "allocation_bytes", "addr", "tf_op",
                                "allocator_name", "bfc"), start=1):
        plane.stat_metadata[sid].id, plane.stat_metadata[sid].name = sid, name
    line = plane.lines.add(id=7, name="python", timestamp_ns=5)
    span = line.events.add(metadata_id=2, offset_ps=100, duration_ps=1000)
    del span
    event = line.events.add(metadata_id=1, offset_ps=500)
    for sid, value in ((1, 4096), (2, 4000), (3, 4096), (4, 0xABC)):
        event.stats.add(metadata_id=sid, int64_value=value)
    event.stats.add(metadata_id=5, str_value="model_1/dense_1/MatMul")
    event.stats.add(metadata_id=6, ref_value=7)
    trace = xplane.read_segments([(space.SerializeToString(), 0)])
    ev = trace.events
    assert len(ev) == 1 and ev.string(int(ev.op[0])) == "model_1/dense_1/MatMul"
    assert (int(ev.live[0]), int(ev.requested[0]), int(ev.addr[0]), int(ev.t_ps[0])) == (4096, 4000, 0xABC, 5500)
    assert ev.allocator == "bfc"
    assert [(s.name, s.start_ps, s.end_ps) for s in trace.spans] == [("layer/dense", 5100, 6100)]
