"""GPU traces without a GPU: a public multi-worker training trace recorded on V100s, and a hand-made XSpace shaped as
TensorFlow's BFC allocator writes it. The report's device comes from the allocator's name, its peak is that
allocator's, its budget that allocator's limit, and the host allocators are listed, never mixed in."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

import tfmem_magic
from tfmem_magic.adapters import cli
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.measure import xplane

# tensorflow/profiler (now openxla/xprof), Apache-2.0, demo/plugins/profile/GPU-multi-worker/ at commit d6853e0c
# (removed from the tree in 2025), gzipped: a BERT span labeler trained with 8 replicas on V100s. Its memory events
# (GPU_1_bfc, GPU_4_bfc, GPU_6_bfc, gpu_host_bfc) sit on /host:CPU; /device:GPU:0 has no lines. tests/data/NOTICE.
PUBLIC = Path(__file__).parent.parent / "data" / "gpu_multi_worker_bert.xplane.pb.gz"
GiB = 2**30


def allocator_events(name: str) -> list[dict]:
    """The trace's memory events of one allocator, read with TensorFlow's own protobuf (not our decoder)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(gzip.decompress(PUBLIC.read_bytes()))
    host = next(p for p in space.planes if p.name == "/host:CPU")
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    kinds = {k: v.name for k, v in host.event_metadata.items()}
    out = []
    for line in host.lines:
        for event in line.events:
            if kinds.get(event.metadata_id) not in ("MemoryAllocation", "MemoryDeallocation"):
                continue
            stats = {stat_names[s.metadata_id]: getattr(s, s.WhichOneof("value")) for s in event.stats}
            if stats.get("allocator_name") == name:
                out.append(stats)
    return out


def test_a_public_multi_gpu_trace_is_about_its_busiest_gpu():
    report = tfmem_magic.analyze_xplane(PUBLIC)
    events = allocator_events("GPU_6_bfc")
    assert report.main_device is report.tf["GPU:6"] and list(report.tf) == ["GPU:6"]  # not assumed to be GPU:0
    assert report.env.devices == ["GPU:1", "GPU:4", "GPU:6"]
    assert report.trace.allocator == "GPU_6_bfc"
    assert report.main_device.peak_bytes == max(e["bytes_allocated"] for e in events)
    limit = max(e["bytes_allocated"] + e["bytes_available"] for e in events)
    assert report.device_budget == ("GPU:6", limit) and 14 * GiB < limit < 15 * GiB  # a 16 GB V100, for TF
    # the largest tensors at the peak are that allocator's own
    shapes = {e.get("shape") for e in events}
    assert report.trace.at_peak and all(g.shape in shapes for g in report.trace.at_peak if g.shape)
    listed = {a.name: a for a in report.trace.allocators}
    assert set(listed) == {"GPU_6_bfc", "GPU_4_bfc", "GPU_1_bfc", "gpu_host_bfc"}
    assert listed["gpu_host_bfc"].device is None and listed["gpu_host_bfc"].events == 536
    host = listed["gpu_host_bfc"].timeline  # the host's own series, on the main timeline's clock
    assert 2 <= len(host) <= 301 and max(b for _, b in host) == listed["gpu_host_bfc"].peak_bytes
    assert report.trace.timeline[0][0] <= host[-1][0] and listed["GPU_6_bfc"].timeline == []
    text = tfmem_magic.render_text(report)
    assert "fits GPU:6 with" in text and "GPU:6: 14.4 GiB" in text and "\nRSS " not in text


def test_a_device_can_be_asked_for_and_a_missing_one_is_named():
    report = tfmem_magic.analyze_xplane(PUBLIC, device="GPU:4")
    assert list(report.tf) == ["GPU:4"] and report.trace.allocator == "GPU_4_bfc"
    with pytest.raises(TfmemUsageError, match=r"device='GPU:0'.*GPU:1, GPU:4, GPU:6"):
        tfmem_magic.analyze_xplane(PUBLIC, device="GPU:0")


def test_tfmem_show_reads_a_folder_of_traces(tmp_path, capsys):
    run = tmp_path / "plugins" / "profile" / "2020_12_23"
    run.mkdir(parents=True)
    (run / "worker.xplane.pb").write_bytes(gzip.decompress(PUBLIC.read_bytes()))
    assert cli.main(["show", str(tmp_path), "--html", str(tmp_path / "page.html")]) == 0
    out = capsys.readouterr().out
    assert "worker.xplane.pb" in out and "Verdict   fits GPU:6" in out
    assert "GPU_6_bfc" in (tmp_path / "page.html").read_text()
    with pytest.raises(SystemExit):
        cli.main(["show", str(tmp_path / "empty")])


def gpu_space() -> bytes:
    """A host plane as TensorFlow 2.21 writes it (strings as refs, numbers as varints), with a GPU allocator and
    a host allocator that has more events: the old rule (the busiest allocator) would have picked the host's."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=0, name="/host:CPU")
    for mid, name in ((1, "MemoryAllocation"), (2, "MemoryDeallocation")):
        plane.event_metadata[mid].id, plane.event_metadata[mid].name = mid, name
    names = ("bytes_allocated", "bytes_available", "requested_bytes", "allocation_bytes", "addr", "tf_op",
             "allocator_name", "shape", "data_type", "GPU_0_bfc", "gpu_host_bfc", "model/dense/MatMul", "[1024,1024]")
    sid = {name: i for i, name in enumerate(names, start=1)}
    for name, i in sid.items():
        plane.stat_metadata[i].id, plane.stat_metadata[i].name = i, name
    line = plane.lines.add(id=1, name="tf_gpu", timestamp_ns=1000)
    live = {"GPU_0_bfc": 0, "gpu_host_bfc": 0}
    limit = {"GPU_0_bfc": 15 * GiB, "gpu_host_bfc": 64 * GiB}

    def event(t: int, allocator: str, size: int, alloc: bool, addr: int) -> None:
        live[allocator] += size if alloc else -size
        e = line.events.add(metadata_id=1 if alloc else 2, offset_ps=t * 1000)
        for name, value in (("bytes_allocated", live[allocator]), ("bytes_available", limit[allocator] -
                            live[allocator]), ("requested_bytes", size), ("allocation_bytes", size), ("addr", addr),
                            ("data_type", 1)):
            e.stats.add(metadata_id=sid[name], int64_value=value)
        for name, ref in (("allocator_name", allocator), ("tf_op", "model/dense/MatMul"), ("shape", "[1024,1024]")):
            e.stats.add(metadata_id=sid[name], ref_value=sid[ref])

    event(1, "GPU_0_bfc", 4 * 2**20, True, 0x1000)
    event(2, "GPU_0_bfc", 4 * 2**20, True, 0x9000)
    for k in range(6):  # pinned host staging: many small events
        event(3 + 2 * k, "gpu_host_bfc", 4096, True, 0x50000)
        event(4 + 2 * k, "gpu_host_bfc", 4096, False, 0x50000)
    event(20, "GPU_0_bfc", 4 * 2**20, False, 0x9000)
    return space.SerializeToString()


def test_the_gpu_allocator_is_kept_even_when_the_host_one_is_busier():
    data = gpu_space()
    fast, slow = (xplane.finish(*xplane.read_xspace(data, 0, reference=r)) for r in (False, True))
    for trace in (fast, slow):
        assert trace.events.allocator == "GPU_0_bfc" and len(trace.events) == 3
        gpu, host = trace.allocators
        assert (gpu.device, gpu.peak_bytes, gpu.limit_bytes, gpu.start_bytes, gpu.end_bytes) == \
            ("GPU:0", 8 * 2**20, 15 * GiB, 0, 4 * 2**20)
        assert (host.name, host.device, host.events, host.limit_bytes) == ("gpu_host_bfc", None, 12, 64 * GiB)
    assert xplane.read_segments([(data, 0)], device="GPU:0").events.allocator == "GPU_0_bfc"


@pytest.mark.slow
def test_mixed_float16_keeps_the_what_if_and_its_fixes(shell):
    """The GPU's precision, on CPU (slow there, not wrong): LossScaleOptimizer wraps Adam, and the what-if counts
    Adam's slots instead of failing on the wrapper's name."""
    import keras
    import numpy as np

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu", name="hidden"),
                                  keras.layers.Dense(10, dtype="float32", name="out")])
        model.compile("adam", "sparse_categorical_crossentropy")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    shell.user_ns.update(model=model, x=np.random.rand(64, 64).astype("float32"), y=np.random.randint(0, 10, 64))
    assert shell.run_cell("%%tfmem --as rep\nmodel.fit(x, y, batch_size=32, epochs=1, verbose=0)").success
    report = shell.user_ns["rep"]
    assert report.model.optimizer == "Adam" and report.model.optimizer_slots == 2
    assert report.model.dtype_policy == "mixed_float16"
    bigger = tfmem_magic.predict(report, batch_size=128)
    assert bigger.peak_bytes > tfmem_magic.predict(report, batch_size=32).peak_bytes
    assert tfmem_magic.predict(report, optimizer="sgd").peak_bytes < tfmem_magic.predict(report).peak_bytes
    from tfmem_magic.advise import fixes

    lighter = fixes.lighter_optimizer(report, fixes.FixContext(model_name="model", number=report.number))
    assert lighter is not None and lighter.predicted_peak_bytes < report.tf_peak_bytes


def test_a_trace_only_tensorflows_reader_can_read_says_what_to_install(monkeypatch):
    """The public trace stores its strings inline (TensorFlow 2.4): our own decoder hands it to TensorFlow's
    protobuf classes, which a machine without TensorFlow lacks. The error says so, not 'no memory events'."""
    import sys

    import tensorflow.tsl.profiler.protobuf as protobuf_package

    monkeypatch.delattr(protobuf_package, "xplane_pb2", raising=False)
    monkeypatch.setitem(sys.modules, "tensorflow.tsl.profiler.protobuf.xplane_pb2", None)  # import raises
    with pytest.raises(TfmemUsageError, match="needs TensorFlow's protobuf classes: install tensorflow"):
        tfmem_magic.analyze_xplane(PUBLIC)


def test_an_allocators_last_figure_is_its_last_event_when_times_tie():
    import numpy as np

    columns = {"t_ps": np.array([5, 5, 5]), "live": np.array([10, 20, 30]), "chunk": np.array([10, 10, 10]),
               "is_alloc": np.array([True, True, True]), "available": np.array([0, 0, 0])}
    (_, series), = xplane._summaries(np.array([0, 0, 0]), columns, ["GPU_0_bfc"])
    assert (series.start_bytes, series.end_bytes, series.peak_bytes, series.limit_bytes) == (0, 30, 30, None)


@pytest.mark.slow
def test_an_xla_compiled_fit_says_why_its_breakdown_has_no_layers():
    """jit_compile (Keras 3's default with a GPU: "auto") runs the step as one XLA computation, whose buffers carry
    no op names; on CPU the same holds, so it is tested here."""
    import keras
    import numpy as np

    x, y = np.random.rand(256, 128).astype("float32"), np.random.randint(0, 10, 256)
    reports = {}
    for jit in (True, False):
        model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, activation="relu", name="wide"),
                                  keras.layers.Dense(10, name="head")], name=f"xla_{jit}")
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        with tfmem_magic.profile(label=f"jit={jit}") as p:
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        reports[jit] = p.report
    compiled, plain = reports[True], reports[False]
    assert compiled.model.jit_compile and not plain.model.jit_compile
    note = next(n for n in compiled.notes if "XLA" in n)
    assert "xla_True's steps ran as XLA computations" in note and "jit_compile=False" in note

    def share(report, phases) -> float:  # of the cell's own bytes at the peak
        own = {g.phase: g.bytes for g in report.trace.by_phase if g.phase != "pre-existing"}
        return sum(own.get(p, 0) for p in phases) / max(1, sum(own.values()))

    # what the note explains: the XLA computation's buffers are nameless ("other"); the plain fit's are named
    assert not {g.layer for g in compiled.trace.by_layer} - {"(no layer)"}
    assert share(compiled, {"other"}) >= 0.5, compiled.trace.by_phase
    assert not any("XLA" in n for n in plain.notes)
    assert share(plain, {"forward", "backward", "optimizer"}) >= 0.5, plain.trace.by_phase


def test_calibration_on_a_gpu_grows_into_what_the_kernel_left_and_says_so_when_nothing_is(monkeypatch):
    """The probe process runs with memory growth (it takes what its steps use, next to the kernel's reservation);
    when the kernel reserved the whole GPU, the probe's OOM becomes a message naming the memory-growth fix."""
    import keras

    from tfmem_magic.advise import calibrate

    monkeypatch.delenv(calibrate.GPU_GROWTH_ENV, raising=False)
    assert calibrate.probe_environment()[calibrate.GPU_GROWTH_ENV] == "true"
    monkeypatch.setenv(calibrate.GPU_GROWTH_ENV, "false")  # the user's choice is kept
    assert calibrate.probe_environment()[calibrate.GPU_GROWTH_ENV] == "false"
    oom = ("tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
           "shape[64,1024] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc")
    monkeypatch.setattr(calibrate, "_run_probe", lambda payload, stage: (1, [], oom))
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile("sgd", "mse")
    with pytest.raises(TfmemUsageError, match="memory growth is off|unless memory growth is on"):
        calibrate.probe_peaks(model, [8, 16], True, None)

