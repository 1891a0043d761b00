"""The analysis on hand-built event streams, where every expected number is known in advance."""

import numpy as np
import pytest

from tfmem_magic.analyze import analysis
from tfmem_magic.measure.xplane import MemoryEvents, Span, Trace


def make_trace(rows, spans=(), strings=(), threads=("python",)) -> Trace:
    """rows: (t in µs, alloc?, chunk, requested, addr, op_index, thread_index); live bytes start from `base`."""
    base = 1000  # bytes live before the trace
    live, cur = [], base
    for _, is_alloc, chunk, *_ in rows:
        cur += chunk if is_alloc else -chunk
        live.append(cur)
    col = lambda i, dt=np.int64: np.array([r[i] for r in rows], dtype=dt)  # noqa: E731
    ev = MemoryEvents(
        t_ps=col(0) * 10**6,
        is_alloc=col(1, bool),
        live=np.array(live, dtype=np.int64),
        requested=col(3),
        chunk=col(2),
        addr=col(4),
        dtype=np.ones(len(rows), dtype=np.int64),
        op=col(5, np.int32),
        region=np.full(len(rows), -1, np.int32),
        shape=np.full(len(rows), -1, np.int32),
        thread=col(6, np.int32),
        strings=list(strings),
        threads=list(threads),
        allocator="bfc",
    )
    return Trace(ev, list(spans))


STRINGS = [
    "StatefulPartitionedCall/mlp_1/dense_1/MatMul",
    "StatefulPartitionedCall/gradient_tape/mlp_1/dense_1/MatMul/MatMul_1",
    "StatefulPartitionedCall/adam/Mul_3",
    "MatMul",
    "IteratorGetNext",
]


def test_peak_live_set_and_preexisting():
    rows = [
        (10, True, 256, 200, 0xA, 0, 0),  # forward activation, freed at t=40
        (20, True, 512, 500, 0xB, 1, 0),  # backward, live at the peak
        (30, True, 1024, 1000, 0xC, 2, 0),  # optimizer, live at the peak  <- peak (1000+256+512+1024)
        (40, False, 256, 200, 0xA, -1, 0),
        (50, False, 100, 100, 0xD, -1, 0),  # frees something allocated before the trace
        (60, False, 1024, 1000, 0xC, -1, 0),
    ]
    info = analysis.summarize(make_trace(rows, strings=STRINGS), analysis.TraceContext(layer_names={"mlp", "dense"}))
    assert info.preexisting_bytes == 1000
    assert info.peak_live_bytes == 1000 + 256 + 512 + 1024
    assert info.peak_time_s == pytest.approx(30e-6)
    assert info.allocated_at_peak_bytes == 256 + 512 + 1024
    assert info.requested_at_peak_bytes == 200 + 500 + 1000
    assert info.peak_requested_bytes == 1700
    phases = {g.phase: g.bytes for g in info.by_phase}
    assert phases == {"forward": 256, "backward": 512, "optimizer": 1024, "pre-existing": 1000}
    layers = {g.layer: g.bytes for g in info.by_layer}
    assert layers == {"dense": 256 + 512, "(no layer)": 1024}
    assert info.at_peak[0].op == "Mul" and info.at_peak[0].phase == "optimizer"


def test_what_the_cell_left_live_at_its_end_is_grouped_as_the_peak_is():
    rows = [
        (10, True, 256, 200, 0xA, 0, 0),  # forward activation, freed
        (20, True, 512, 500, 0xB, 2, 0),  # optimizer slot: never freed in the cell
        (30, True, 1024, 1000, 0xC, 0, 0),  # a layer's output a name keeps
        (40, False, 256, 200, 0xA, -1, 0),
        (50, False, 100, 100, 0xD, -1, 0),  # a pre-existing tensor freed: not the cell's
    ]
    info = analysis.summarize(make_trace(rows, strings=STRINGS), analysis.TraceContext(layer_names={"mlp", "dense"}))
    assert info.held_at_end_bytes == 512 + 1024
    assert {(g.layer, g.phase, g.bytes) for g in info.held_at_end} == {
        ("dense", "forward", 1024),
        (None, "optimizer", 512),
    }


def test_address_reuse_matches_each_free_to_its_own_allocation():
    rows = [
        (10, True, 100, 100, 0xA, 3, 0),
        (20, False, 100, 100, 0xA, -1, 0),
        (30, True, 300, 300, 0xA, 3, 0),  # same address again, live at the end
    ]
    freed_at, pre = analysis.match_frees(make_trace(rows, strings=STRINGS).events)
    assert list(freed_at) == [1, 3, 3]
    assert not pre.any()


def test_an_address_allocated_again_without_a_free_was_freed_during_a_pause():
    rows = [
        (10, True, 100, 100, 0xA, 3, 0),  # its free fell in a pause: the address is handed out again at t=30
        (20, True, 200, 200, 0xB, 3, 0),
        (30, True, 100, 100, 0xA, 3, 0),
        (40, False, 100, 100, 0xA, -1, 0),
    ]
    trace = make_trace(rows, strings=STRINGS)
    trace.events.live[2:] -= 100  # the allocator's own live counter saw the missing free
    freed_at, pre = analysis.match_frees(trace.events)
    assert list(freed_at) == [2, 4, 3, 4] and not pre.any()
    info = analysis.summarize(trace, analysis.TraceContext())
    assert info.peak_requested_bytes == 300  # not 400: the first 100 bytes were gone when the address came back
    assert info.requested_at_peak_bytes == 300 and info.allocated_at_peak_bytes == 300


def test_eager_allocations_use_layer_and_phase_spans():
    us = 10**6
    spans = [
        Span("layer/outer", 5 * us, 100 * us, "python"),
        Span("layer/inner", 10 * us, 20 * us, "python"),
        Span("phase/backward", 30 * us, 40 * us, "python"),
        Span("weights/inner", 50 * us, 60 * us, "python"),
    ]
    rows = [
        (12, True, 10, 10, 1, 3, 0),  # inside inner (nested in outer) -> inner, forward
        (25, True, 20, 20, 2, 3, 0),  # inner ended: its parent outer -> outer, forward
        (35, True, 40, 40, 3, 3, 0),  # backward span, inside outer
        (55, True, 80, 80, 4, 3, 0),  # weights of inner
        (55, True, 160, 160, 5, 3, 1),  # same time, another thread: no span applies
    ]
    trace = make_trace(rows, spans=spans, strings=STRINGS, threads=("python", "tf_Compute/1"))
    att = analysis.attribute_events(trace, analysis.TraceContext())
    assert [att.layer_name(i) for i in range(4)] == ["inner", "outer", "outer", "inner"]
    assert [att.phase_name(i) for i in range(5)] == ["forward", "forward", "backward", "weights", "other"]


def test_input_attribution():
    rows = [
        (10, True, 4096, 4000, 1, -1, 0),  # untagged, same size as the array given to fit -> input copy
        (20, True, 64, 64, 2, 4, 0),  # iterator op
        (30, True, 32, 32, 3, -1, 1),
    ]  # untagged on a tf.data thread
    trace = make_trace(rows, strings=STRINGS, threads=("python", "tf_data_private_threadpool/1"))
    att = analysis.attribute_events(trace, analysis.TraceContext(input_array_bytes={4000}))
    assert [att.phase_name(i) for i in range(3)] == ["input", "input", "input"]
    assert att.op_name(0).startswith("input copy")


@pytest.mark.parametrize(
    "path, expected",
    [
        ("StatefulPartitionedCall/cnn_1/conv_a_1/Relu", ("Relu", "conv_a", "forward")),
        ("StatefulPartitionedCall/gradient_tape/cnn_1/conv_a_1/ReluGrad", ("ReluGrad", "conv_a", "backward")),
        ("StatefulPartitionedCall/adam/Sqrt_5", ("Sqrt", None, "optimizer")),
        ("StatefulPartitionedCall/compile_loss/sparse_categorical_crossentropy/Log", ("Log", None, "forward")),
        ("__inference_initialize_variables_802", ("initialize variables", None, "weights")),
        ("__inference_multi_step_on_iterator_879", ("function runtime", None, "other")),
        ("MakeIterator", ("MakeIterator", None, "input")),
        ("StatefulPartitionedCall/Add_1", ("Add", None, "other")),
    ],
)
def test_attribute_path(path, expected):
    att = analysis.attribute_path(path, analysis.TraceContext(layer_names={"cnn", "conv_a"}))
    assert (att.op, att.layer, att.phase) == expected


@pytest.mark.parametrize(
    "path, expected",
    [
        ("StatefulPartitionedCall/worker_1/wide_1/Relu", ("Relu", "wide", "forward")),
        ("StatefulPartitionedCall/gradient_tape/worker_1/wide_1/MatMul/MatMul_1", ("MatMul", "wide", "backward")),
        (
            "StatefulPartitionedCall/gradient_tape/worker_1/head_1/BiasAdd/BiasAddGrad",
            ("BiasAddGrad", "head", "backward"),
        ),
        ("StatefulPartitionedCall/Add_1", ("Add", None, "other")),
        # grappler's scopes are no layer: the enclosing layer, or none (a T4 trace listed ArithmeticOptimizer as one)
        (
            "StatefulPartitionedCall/sequential/conv2d/ArithmeticOptimizer/ReorderCastLikeAndValuePreserving_float_Cast",
            ("ReorderCastLikeAndValuePreserving_float_Cast", "conv2d", "forward"),
        ),
        ("StatefulPartitionedCall/ArithmeticOptimizer/AddOpsRewrite_Add", ("AddOpsRewrite_Add", None, "other")),
        ("StatefulPartitionedCall/ConstantFolding/Const_1", ("Const", None, "other")),
        ("StatefulPartitionedCall/LayoutOptimizer/Transpose", ("Transpose", None, "other")),
        ("StatefulPartitionedCall/RemapperOptimizer/FusedAdd", ("FusedAdd", None, "other")),
        (
            "StatefulPartitionedCall/gradient_tape/worker_1/head_1/DependencyOptimizer/BiasAddGrad",
            ("BiasAddGrad", "head", "backward"),
        ),
    ],
)
def test_a_trace_without_the_model_names_the_layer_not_the_forward_op(path, expected):
    """A saved or captured trace: no layer names are known, the enclosing scope is the layer, and a gradient's
    path, which names its forward op as a scope, still gives the layer (a captured worker's breakdown once listed
    'MatMul' and 'BiasAdd' as layers)."""
    att = analysis.attribute_path(path, analysis.TraceContext())
    assert (att.op, att.layer, att.phase) == expected


def test_downsample_keeps_the_peak_and_bounds_points():
    t = np.arange(100_000, dtype=float)
    y = np.sin(t / 1000) * 1000
    y[54_321] = 10**6
    points = analysis.downsample(t, y.astype(np.int64), max_points=500)
    assert len(points) <= 500
    assert max(p[1] for p in points) == 10**6
    assert [p[0] for p in points] == sorted(p[0] for p in points)


def test_empty_trace():
    info = analysis.summarize(make_trace([], strings=STRINGS), analysis.TraceContext())
    assert info.events == 0 and info.at_peak == []


def test_bytes_allocated_during_a_pause_are_untraced_not_preexisting():
    # 1000 bytes live before the trace; a pause hid a 300-byte allocation: the live counter jumps by 300
    rows = [(10, True, 100, 100, 1, 3, 0), (20, True, 50, 50, 2, 3, 0)]
    trace = make_trace(rows, strings=STRINGS)
    trace.events.live[1] += 300  # the second event comes after the untraced allocation
    info = analysis.summarize(trace, analysis.TraceContext())
    phases = {g.phase: g.bytes for g in info.by_phase}
    assert phases["pre-existing"] == 1000 and phases["untraced"] == 300 and phases["other"] == 150


def test_a_tensor_carries_the_batch_first_second_or_folded_with_a_sequences_steps():
    from tfmem_magic.analyze.analysis import batch_dimension

    assert batch_dimension("[32,64,64]", 32) and batch_dimension("[100,32,64]", 32)  # [B, ...], time-major [T, B]
    assert not batch_dimension("[64,256]", 32)
    # a Dense on [B, T, D] multiplies [B*T, D]: the batch folded with the sequence's 64 steps
    assert batch_dimension("[2048,256]", 32, {64}) and not batch_dimension("[2048,256]", 32, {100})
    assert not batch_dimension("[2048]", 32, {64})  # a vector (channels, moments) is not a folded batch
    assert not batch_dimension("[2048,8,8]", 32, {64})  # nor a higher-rank tensor: a Dense folds into a matrix
    assert not batch_dimension(None, 32, {64}) and not batch_dimension("scalar", 32, {64})


def test_the_steps_come_from_the_models_sequence_outputs_only():
    from tfmem_magic.analyze.build import step_dims
    from tfmem_magic.core.report import LayerInfo, ModelInfo, Report

    layers = [
        LayerInfo("attn", "MultiHeadAttention", 1, "(None, 64, 64)", 1),
        LayerInfo("conv", "Conv2D", 1, "(None, 62, 62, 32)", 1),  # an image: rows are not folded
        LayerInfo("tokens", "Embedding", 1, "(None, None, 64)", 1),  # open length: no steps known
        LayerInfo("head", "Dense", 1, "(None, 10)", 1),
    ]
    report = Report(model=ModelInfo(name="m", params=4, layers=layers))
    assert step_dims(report) == {64}
    assert step_dims(Report()) == set()


def test_the_moments_below_are_the_ones_a_smaller_batch_would_peak_at():
    # a recurrent step as its trace saw it: the peak (event 1) holds 900 bytes of batch tensors over 100 of others;
    # event 3, 50 bytes lower, holds only 200 of them (kernel-shaped gradients that do not shrink); event 2 neither
    running = np.array([0, 900, 500, 200, 0])
    live = np.array([100, 1000, 900, 950, 300])
    lines = analysis._moments_below(running, live, peak=1, chunks=1.0)
    # at half the batch event 3 holds 950 - 100 = 850 where the peak holds 1000 - 450 = 550: it is found, once
    assert lines == [[200, 950]]
    # a moment that shrinks as fast as the peak and stands lower is never the peak below it
    assert analysis._moments_below(np.array([0, 900, 900]), np.array([100, 1000, 990]), peak=1, chunks=1.0) == []


def test_the_busiest_moment_ends_a_tensor_whose_free_a_pause_lost_with_its_segment():
    # two steps of a recurrent layer, each in its own trace segment: step 1 allocates A (400) and B (300), peaks at
    # event 1, frees B; A's free fell in the pause after it. Step 2 allocates C (500) and D (300): its own busiest
    # moment holds 800, not 1200
    rows = [
        (10, True, 400, 400, 0xA, 0, 0),  # A: never freed in the trace
        (20, True, 300, 300, 0xB, 0, 0),  # <- the peak
        (30, False, 300, 300, 0xB, -1, 0),
        (60, True, 500, 500, 0xC, 0, 0),
        (70, True, 300, 300, 0xD, 0, 0),  # <- step 2's busiest moment
        (80, False, 500, 500, 0xC, -1, 0),
        (90, False, 300, 300, 0xD, -1, 0),
    ]
    ev = make_trace(rows, strings=STRINGS).events
    freed_at, _ = analysis.match_frees(ev)
    n, peak = len(ev), 1
    live_at_peak = np.array([True, True, False, False, False, False, False])

    def busiest(windows: list[tuple[float, float]]) -> tuple[int, int]:
        ended = analysis._segment_freed(
            ev, freed_at, live_at_peak, analysis._window_ends(ev.t_ps / 10**12, windows), peak
        )
        running = analysis._running(ev.requested, ev.is_alloc, ended)
        return int(np.argmax(running)), int(running.max())

    assert busiest([(0.0, 0.00004), (0.00005, 0.0001)]) == (4, 800)
    # counted to the trace's end, A would make step 2 hold 1200 (and a slope half again too steep)
    assert analysis._running(ev.requested, ev.is_alloc, freed_at).max() == 1200 and freed_at[0] == n
    # in a trace without pauses nothing was lost: A persists into step 2, and step 2 holds it
    assert busiest([(0.0, 0.0001)]) == (4, 1200)
    # a tensor live at the peak is live through it, even where its segment's end came before the peak's event
    early = analysis._segment_freed(ev, freed_at, live_at_peak, np.array([1, 2, 3, 7, 7, 7, 7]), peak)
    assert early[0] == peak + 1


def test_a_moment_holding_bytes_the_trace_never_saw_is_not_taken_for_a_line():
    rows = [
        (10, True, 300, 300, 0xA, 0, 0),
        (20, True, 600, 600, 0xB, 0, 0),  # <- the peak: 1000 + 900
        (30, False, 300, 300, 0xA, -1, 0),
        (40, True, 50, 50, 0xC, 0, 0),
    ]
    ev = make_trace(rows, strings=STRINGS).events
    ev.live[3] += 100  # 100 bytes allocated while the trace was paused are in the allocator's total there
    assert int(np.argmax(ev.live)) == 1  # still below the peak
    freed_at, preexisting_free = analysis.match_frees(ev)
    accounted = analysis._accounted(ev, freed_at, preexisting_free, 1000, peak=1)
    assert accounted.tolist() == [True, True, True, False]  # 100 unseen bytes: over 5% of the cell's own 900
    # A and B carry the batch, C does not: the unseen bytes would look like bytes that do not shrink, and at a
    # sixteenth of the batch event 3 (1750 - 600 x 15/16) would stand over the peak (1900 - 900 x 15/16)
    running = np.array([300, 900, 600, 600])
    assert analysis._moments_below(running, ev.live, peak=1, chunks=1.0) == [[600, 1750]]
    assert analysis._moments_below(running, ev.live, peak=1, chunks=1.0, accounted=accounted) == []


def test_each_event_knows_where_its_trace_segment_ends():
    t_s = np.array([0.1, 0.2, 0.5, 0.6, 0.95])
    # two segments; the last event was stamped after its segment's end was read (the profiler stops a moment later)
    ends = analysis._window_ends(t_s, [(0.0, 0.3), (0.4, 0.9)])
    assert ends.tolist() == [2, 2, 4, 4, 5]
    assert analysis._window_ends(t_s, [(0.0, 1.0)]).tolist() == [5] * 5  # one segment: the trace's end


def test_a_free_lost_in_a_pause_ends_the_tensor_where_its_segment_ends():
    rows = [
        (10, True, 100, 100, 0xA, 0, 0),  # A: its free falls in the pause after event 1
        (20, True, 200, 200, 0xB, 0, 0),  # B: freed in the next segment
        (50, False, 200, 200, 0xB, -1, 0),
        (60, True, 100, 100, 0xA, 0, 0),  # A's address allocated again: match_frees ends A here
        (70, True, 50, 50, 0xD, 0, 0),
    ]  # D: never freed in the trace
    ev = make_trace(rows, strings=STRINGS).events
    freed_at, _ = analysis.match_frees(ev)
    assert freed_at.tolist()[:2] == [3, 2] and freed_at[4] == 5
    window_ends = analysis._window_ends(ev.t_ps / 10**12, [(0.0, 0.00003), (0.00004, 0.0001)])
    assert window_ends.tolist() == [2, 2, 5, 5, 5]
    nothing_at_peak = np.zeros(5, dtype=bool)
    ended = analysis._segment_freed(ev, freed_at, nothing_at_peak, window_ends, peak=1)
    # A ends with its segment (index 2), not at the reuse of its address; B keeps its real free; D the trace's end
    assert ended.tolist()[:3] == [2, 2, 5] and ended[4] == 5
    # what is live at the peak is live through it, and ends with its segment after it
    assert analysis._segment_freed(ev, freed_at, np.array([True, False, False, False, False]), window_ends, 1)[0] == 2
    assert analysis._segment_freed(ev, freed_at, np.array([True, False, False, False, False]), window_ends, 3)[0] == 4


def test_grapplers_scopes_are_never_a_layer_where_the_models_layers_are_known_either():
    ctx = analysis.TraceContext(layer_names={"cnn", "conv_a"})
    att = analysis.attribute_path("StatefulPartitionedCall/cnn_1/conv_a_1/ArithmeticOptimizer/AddOpsRewrite_x", ctx)
    assert (att.layer, att.phase) == ("conv_a", "forward")


def gpu_events(rows, allocator="GPU_0_bfc") -> Trace:
    """rows: (alloc?, op, dtype enum, shape, region, chunk, addr), one µs apart, as a GPU's BFC allocator writes
    them."""
    strings: list[str] = []

    def ref(text):
        if text is None:
            return -1
        if text not in strings:
            strings.append(text)
        return strings.index(text)

    live, cur = [], 0
    for alloc, *_, chunk, _ in rows:
        cur += chunk if alloc else -chunk
        live.append(cur)
    n = len(rows)
    ev = MemoryEvents(
        t_ps=np.arange(n, dtype=np.int64) * 10**6,
        is_alloc=np.array([r[0] for r in rows], dtype=bool),
        live=np.array(live, dtype=np.int64),
        requested=np.array([r[5] for r in rows], dtype=np.int64),
        chunk=np.array([r[5] for r in rows], dtype=np.int64),
        addr=np.array([r[6] for r in rows], dtype=np.int64),
        dtype=np.array([r[2] for r in rows], dtype=np.int64),
        op=np.array([ref(r[1]) for r in rows], dtype=np.int32),
        region=np.array([ref(r[4]) for r in rows], dtype=np.int32),
        shape=np.array([ref(r[3]) for r in rows], dtype=np.int32),
        thread=np.zeros(n, dtype=np.int32),
        strings=strings,
        threads=["tf_gpu"],
        allocator=allocator,
    )
    return Trace(ev)


GRAD = "StatefulPartitionedCall/gradient_tape/sequential/conv2d/Conv2D/"
WORKSPACE_ROWS = [
    (True, "StatefulPartitionedCall/sequential/conv2d/Relu", 1, "[256,30,30,32]", "output", 29_491_200, 0x100),
    (True, GRAD + "Conv2DBackpropFilter", 4, "[64552960]", "temp", 64_552_960, 0x200),  # cuDNN's workspace
    (True, "StatefulPartitionedCall/sequential/dense/MatMul", 4, "[4194304]", "temp", 4_194_304, 0x300),  # cuBLAS's
    (True, GRAD + "Conv2DBackpropFilter", 1, "[3,3,3,32]", "output", 3_584, 0x400),  # the gradient itself
    (True, "StatefulPartitionedCall/sequential/conv2d/Conv2D", 4, "[256,4]", "temp", 1_024, 0x500),  # 2-D: a tensor
    (True, "StatefulPartitionedCall/sequential/conv2d/Conv2D", 4, "[4096]", "output", 4_096, 0x600),  # an output
    (True, "StatefulPartitionedCall/sequential/conv2d/Cast", 4, "[8192]", "temp", 8_192, 0x700),  # no scratch op
    # grappler's fused kernels are named after their last node: _FusedConv2D (conv2d_1/Relu), _FusedMatMul (dense_1)
    (True, "StatefulPartitionedCall/sequential/conv2d_1/Relu", 4, "[32145408]", "temp", 32_145_408, 0x800),
    (True, "StatefulPartitionedCall/sequential/dense_1/BiasAdd", 4, "[65536]", "temp", 65_536, 0x900),
]


def test_a_gpu_kernels_cudnn_or_cublas_workspace_is_its_own_phase_keeping_its_op_and_layer():
    """A 1-D uint8 temp tensor of a convolution or a matrix product on a GPU's allocator is its kernel's workspace
    (TensorFlow's DnnScratchAllocator and BlasScratchAllocator: allocate_temp(DT_UINT8, {bytes})), not a backward
    activation; a uint8 tensor of another shape, region or op is not (docs/gpu.md, "Workspaces")."""
    info = analysis.summarize(gpu_events(WORKSPACE_ROWS), analysis.TraceContext())
    phases = {g.phase: g.bytes for g in info.by_phase}
    assert phases["workspace"] == 64_552_960 + 4_194_304 + 32_145_408 + 65_536
    assert phases["backward"] == 3_584 and phases["forward"] == 29_491_200 + 1_024 + 4_096 + 8_192
    rows = {(g.op, g.layer, g.phase, g.dtype, g.shape): g.bytes for g in info.at_peak}
    assert rows[("Conv2DBackpropFilter", "conv2d", "workspace", "uint8", "[64552960]")] == 64_552_960
    assert rows[("MatMul", "dense", "workspace", "uint8", "[4194304]")] == 4_194_304
    assert rows[("BiasAdd", "dense", "workspace", "uint8", "[65536]")] == 65_536
    assert rows[("Relu", "conv2d", "workspace", "uint8", "[32145408]")] == 32_145_408
    assert {g.layer for g in info.by_layer} >= {"conv2d", "dense"}  # a workspace still counts for its layer
    # cuDNN's (under TF_CUDNN_WORKSPACE_LIMIT_IN_MB) or cuBLAS's (no cap): by the op, or a fused kernel's scope
    assert analysis.is_cudnn_workspace("Relu", "conv2d_1") and analysis.is_cudnn_workspace("Conv2DBackpropFilter", None)
    assert not analysis.is_cudnn_workspace("BiasAdd", "dense_1") and not analysis.is_cudnn_workspace("MatMul", "conv")


def test_a_cpus_allocator_has_no_cudnn_workspaces():
    """On a CPU the same events are what the path says: oneDNN's scratch buffers are no cuDNN workspace."""
    info = analysis.summarize(
        gpu_events(WORKSPACE_ROWS, allocator="bfc_cpu_allocator_for_gpu"), analysis.TraceContext()
    )
    assert "workspace" not in {g.phase for g in info.by_phase}
    assert analysis.CUBLAS_OPS.match("_FusedMatMul") and not analysis.CUBLAS_OPS.match("Conv2DBackpropInput")


def test_a_tf_keras_layers_scope_is_its_name_as_it_is_and_a_keras_3_scope_is_made_unique() -> None:
    names = {"dense", "dense_1", "dense_2"}
    keras3 = analysis.TraceContext(layer_names=names)
    tf_keras = analysis.TraceContext(layer_names=names, bare_layers=names)
    path = "StatefulPartitionedCall/sequential/dense_1/MatMul"
    # Keras 3 names the scope of the layer `dense` `dense_1` (made unique in the step's graph)
    assert analysis.attribute_path(path, keras3).layer == "dense"
    # tf_keras names it by the layer's name: `dense_1` is the second Dense
    assert analysis.attribute_path(path, tf_keras).layer == "dense_1"
    assert analysis.attribute_path("gradient_tape/sequential/dense_2/MatMul/MatMul_1", tf_keras).layer == "dense_2"
    assert analysis.attribute_path("StatefulPartitionedCall/sequential/dense/BiasAdd", tf_keras).layer == "dense"
