"""The vectorized xplane decoder against the one-stat-at-a-time reference, on real and hand-made traces."""

from __future__ import annotations

import numpy as np

from tfmem_magic.measure import xplane
from tfmem_magic.measure.instrument import Instrumentation
from tfmem_magic.measure.tracer import Tracer


def decode_both(data: bytes):
    """The trace as the vectorized decoder reads it, and as the per-stat reference decoder does."""
    return [xplane.finish(*xplane.read_xspace(data, 0, reference=reference)) for reference in (False, True)]


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
    for name in ("t_ps", "is_alloc", "live", "requested", "chunk", "addr", "dtype", "thread", "limit"):
        assert np.array_equal(getattr(fast.events, name), getattr(slow.events, name)), name
    for name in ("op", "region", "shape"):
        assert [fast.events.string(i) for i in getattr(fast.events, name)] == [
            slow.events.string(i) for i in getattr(slow.events, name)
        ], name
    assert [(s.name, s.start_ps, s.end_ps) for s in fast.spans] == [(s.name, s.start_ps, s.end_ps) for s in slow.spans]


def test_inline_string_stats_fall_back_to_the_reference_decoder():
    """Another TF version could store tf_op as str_value: the fast path must hand over, not misread."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=1, name="/host:CPU")
    plane.event_metadata[1].id, plane.event_metadata[1].name = 1, "MemoryAllocation"
    plane.event_metadata[2].id, plane.event_metadata[2].name = 2, "tfmem:layer/dense"
    for sid, name in enumerate(
        ("bytes_allocated", "requested_bytes", "allocation_bytes", "addr", "tf_op", "allocator_name", "bfc"), start=1
    ):
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


def memory_plane(space, name: str = "/host:CPU", line_name: str = "python", strings=("MatMul",)):
    """A host plane declaring the allocator's events and stats; tf_op values are refs to `strings`."""
    plane = space.planes.add(id=len(space.planes), name=name)
    for mid, event in ((1, "MemoryAllocation"), (2, "MemoryDeallocation"), (3, "tfmem:layer/dense")):
        plane.event_metadata[mid].id, plane.event_metadata[mid].name = mid, event
    for sid, stat in enumerate(
        ("bytes_allocated", "requested_bytes", "allocation_bytes", "addr", "tf_op", "data_type", *strings), start=1
    ):
        plane.stat_metadata[sid].id, plane.stat_metadata[sid].name = sid, stat
    return plane, plane.lines.add(id=7, name=line_name, timestamp_ns=5)


def add_event(line, alloc: bool, offset_ps: int, live: int, addr: int | None, op_ref: int = 7):
    event = line.events.add(metadata_id=1 if alloc else 2, offset_ps=offset_ps)
    for sid, value in ((1, live), (2, 200), (3, 256), (6, 1)):
        event.stats.add(metadata_id=sid, int64_value=value)
    if addr is not None:
        event.stats.add(metadata_id=4, uint64_value=addr)
    event.stats.add(metadata_id=5, ref_value=op_ref)


def assert_same_events(a, b):
    for name in ("t_ps", "is_alloc", "live", "requested", "chunk", "addr", "dtype", "thread", "limit"):
        assert np.array_equal(getattr(a.events, name), getattr(b.events, name)), name
    for name in ("op", "region", "shape"):
        assert [a.events.string(i) for i in getattr(a.events, name)] == [
            b.events.string(i) for i in getattr(b.events, name)
        ], name
    assert [a.events.threads[k] for k in a.events.thread] == [b.events.threads[k] for k in b.events.thread]
    assert [(s.name, s.start_ps, s.end_ps, s.thread) for s in a.spans] == [
        (s.name, s.start_ps, s.end_ps, s.thread) for s in b.spans
    ]


def test_a_missing_addr_is_unknown_to_both_decoders_and_pairs_with_nothing(monkeypatch):
    """The fast decoder read a missing `addr` as 0 and the reference one as -1, and `match_frees` paired frees and
    allocations on 0. Both now read -1 (unknown); neither -1 nor a null address pairs with anything."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from tfmem_magic.analyze import analysis

    monkeypatch.setattr(xplane, "CHUNK_EVENTS", 3)  # several chunks per line
    space = xplane_pb2.XSpace()
    _, line = memory_plane(space)
    line.events.add(metadata_id=3, offset_ps=50, duration_ps=1000)  # a span, among the memory events
    add_event(line, True, 100, 256, None)  # no addr
    add_event(line, False, 200, 0, None)  # a free without addr: not that allocation's
    add_event(line, True, 300, 256, 0xABC00)
    add_event(line, False, 400, 0, 0xABC00)
    add_event(line, True, 500, 256, 0)  # a null address, written as such
    add_event(line, False, 600, 0, 0)
    add_event(line, True, 700, 256, 0xFFFF_8000_0000_1000)  # a uint64 address: kept in int64 by both
    fast, slow = decode_both(space.SerializeToString())
    assert_same_events(fast, slow)
    assert list(fast.events.addr) == [-1, -1, 0xABC00, 0xABC00, 0, 0, 0x7FFF_8000_0000_1000]
    freed_at, preexisting_free = analysis.match_frees(fast.events)
    n = len(fast.events)
    assert list(freed_at) == [n, n, 3, n, n, n, n]
    assert list(preexisting_free) == [False, True, False, False, False, True, False]


def test_decoded_segments_read_as_the_raw_blobs(monkeypatch):
    """A tracer's `Decoded` (other string and thread tables than the blob read after it) merges into the same
    trace as the raw blobs."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    monkeypatch.setattr(xplane, "CHUNK_EVENTS", 2)
    blobs = []
    for k, (strings, thread) in enumerate(((("MatMul", "Relu"), "python"), (("Relu", "Conv2D"), "tf_Compute/1"))):
        space = xplane_pb2.XSpace()
        plane, line = memory_plane(space, line_name=thread, strings=strings)
        memory_plane(space, name="/device:GPU:0")  # not a host plane: skipped
        line.events.add(metadata_id=3, offset_ps=10, duration_ps=500)
        for i in range(5):
            add_event(line, i % 2 == 0, 100 * i + 20, 256 * i, 0x1000 * (i // 2 + 1), op_ref=7 + i % 2)
        blobs.append((space.SerializeToString(), 10**6 * k))
    decoded = xplane.Decoded()
    decoded.add(*blobs[0])
    assert decoded.events == 5 and decoded.xplane_bytes == len(blobs[0][0]) and decoded.nbytes > 0
    merged = xplane.read_segments([(decoded, 0), blobs[1]])
    raw = xplane.read_segments(blobs)
    assert_same_events(merged, raw)
    assert len(raw.events) == 10 and decoded.events == 5  # the Decoded is left as it was
    assert [raw.events.string(i) for i in raw.events.op] == ["MatMul", "Relu"] * 2 + ["MatMul"] + [
        "Relu",
        "Conv2D",
    ] * 2 + ["Relu"]
    assert [s.start_ps for s in raw.spans] == [5010, 10**6 + 5010]


def test_the_allocators_limit_and_xlas_runs_read_alike_by_both_decoders():
    """bytes_available (BFC: its limit - bytes_reserved - bytes in use) and bytes_reserved add up to the limit on
    each event; an event without bytes_available records none (0), one whose bytes_available is 0 (a full
    allocator; proto3 leaves the value out) still does. An XLA launch event becomes a span ("xla/<name>")."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane, line = memory_plane(space)
    for sid, stat in ((20, "bytes_available"), (21, "bytes_reserved")):
        plane.stat_metadata[sid].id, plane.stat_metadata[sid].name = sid, stat
    plane.event_metadata[4].id, plane.event_metadata[4].name = 4, "cluster_3/xla_run:_XlaRun"
    line.events.add(metadata_id=4, offset_ps=50, duration_ps=400)
    add_event(line, True, 100, 256, 0x1000)  # no bytes_available: no limit recorded
    add_event(line, True, 200, 512, 0x2000)
    line.events[-1].stats.add(metadata_id=20, int64_value=1000)
    line.events[-1].stats.add(metadata_id=21, int64_value=64)
    add_event(line, True, 300, 768, 0x3000)
    line.events[-1].stats.add(metadata_id=20)  # bytes_available present, 0
    line.events[-1].stats.add(metadata_id=21, int64_value=64)
    fast, slow = decode_both(space.SerializeToString())
    assert_same_events(fast, slow)
    assert list(fast.events.limit) == [0, 512 + 1000 + 64, 768 + 0 + 64]
    assert [(s.name, s.start_ps, s.end_ps) for s in fast.spans] == [("xla/cluster_3/xla_run:_XlaRun", 5050, 5450)]
