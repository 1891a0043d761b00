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
GiB, MiB = 2**30, 2**20
# what TensorFlow's BFC allocator writes on each MemoryAllocation / MemoryDeallocation event, in its order
# (BFCAllocator::AddTraceMe, xla/tsl/framework/bfc_allocator.cc; tensorflow/core/common_runtime/bfc_allocator.cc
# before the move). bytes_available is memory_limit_ - bytes_reserved - bytes_in_use there; fragmentation a double.
BFC_STATS = (
    "allocator_name",
    "bytes_reserved",
    "bytes_allocated",
    "bytes_available",
    "fragmentation",
    "peak_bytes_in_use",
    "requested_bytes",
    "allocation_bytes",
    "addr",
    "tf_op",
    "id",
    "region_type",
    "data_type",
    "shape",
)


def allocator_timeline(name: str) -> list[tuple[int, bool, dict]]:
    """The trace's memory events of one allocator as (time ps, is an allocation, stats), in time order, read with
    TensorFlow's own protobuf (not our decoder)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(gzip.decompress(PUBLIC.read_bytes()))
    host = next(p for p in space.planes if p.name == "/host:CPU")
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    kinds = {k: v.name for k, v in host.event_metadata.items()}
    out = []
    for line in host.lines:
        for event in line.events:
            kind = kinds.get(event.metadata_id)
            if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                continue
            stats = {stat_names[s.metadata_id]: getattr(s, s.WhichOneof("value")) for s in event.stats}
            if stats.get("allocator_name") == name:
                out.append((line.timestamp_ns * 1000 + event.offset_ps, kind == "MemoryAllocation", stats))
    return sorted(out, key=lambda e: e[0])  # stable: events of one time keep the trace's order, as our reader's


def allocator_events(name: str) -> list[dict]:
    return [stats for _, _, stats in allocator_timeline(name)]


def test_a_public_multi_gpu_trace_is_about_its_busiest_gpu():
    report = tfmem_magic.analyze_xplane(PUBLIC)
    # no by-line view from a saved trace, and the report says why (the ops' Python stacks stay in their process)
    assert report.trace is not None and not report.trace.by_line
    assert any(n.startswith("No by-line view") and "Python stacks" in n for n in report.notes), report.notes
    events = allocator_events("GPU_6_bfc")
    assert report.main_device is report.tf["GPU:6"]  # not assumed to be GPU:0
    # every GPU's allocator is in `tf`, the main one first: GPU:4's peak is within 0.03% of GPU:6's (issue 29)
    assert list(report.tf) == ["GPU:6", "GPU:4", "GPU:1"]
    gpu4 = allocator_events("GPU_4_bfc")
    assert report.tf["GPU:4"].peak_bytes == max(e["bytes_allocated"] for e in gpu4) == 6_208_853_760
    assert report.env.devices == ["GPU:1", "GPU:4", "GPU:6"]
    assert report.trace.allocator == "GPU_6_bfc"
    assert report.main_device.peak_bytes == max(e["bytes_allocated"] for e in events)
    # the allocator's peak since its process started, as its events state it: the trace holds it (a steady step)
    assert report.main_device.lifetime_peak_bytes == max(e["peak_bytes_in_use"] for e in events) == 6_210_111_488
    assert any("The trace holds GPU:6's peak since its process started" in n for n in report.notes)
    limit = max(e["bytes_allocated"] + e["bytes_available"] + e["bytes_reserved"] for e in events)
    assert report.device_budget == ("GPU:6", limit) and 14 * GiB < limit < 15 * GiB  # a 16 GB V100, for TF
    # the largest tensors at the peak are that allocator's own (checked against an independent live set below)
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
    # the allocation sequence replays through tfmem's BFC simulator to the byte (GPU defaults: one region of the
    # whole limit, garbage collection), the ground the step replay stands on (analyze/bfc.py)
    replayed = [n for n in report.notes if n.startswith("tfmem's simulation of TensorFlow's BFC allocator")]
    assert len(replayed) == 1 and "one region of the whole limit" in replayed[0]
    assert "969 memory events of GPU_6_bfc" in replayed[0] and "after every event" in replayed[0]


def test_the_live_set_at_the_public_traces_peak_is_that_allocators_recomputed_independently():
    """GPU_6_bfc's tensors live at its peak, recomputed from TensorFlow's own protobuf reader with a plain walk (an
    allocation is live from its event until the next event at its address), against our decoder's and the report's:
    the same addresses and sizes, the same bytes and counts, the same largest groups. The replicas allocate tensors
    of identical shapes, so shapes alone would not tell GPU_6's from GPU_4's."""
    import numpy as np

    from tfmem_magic.analyze import analysis

    timeline = allocator_timeline("GPU_6_bfc")
    peak = max(range(len(timeline)), key=lambda i: (timeline[i][2]["bytes_allocated"], -i))  # the first highest
    live: dict[int, dict] = {}
    for _, is_alloc, stats in timeline[: peak + 1]:
        if is_alloc:
            live[stats["addr"]] = stats  # a second allocation at an address: the first was freed unseen
        else:
            live.pop(stats["addr"], None)  # a free of a tensor allocated before the trace: none of the cell's
    assert all(addr > 0 for addr in live) and len(live) > 100
    expected = {(addr, stats["allocation_bytes"]) for addr, stats in live.items()}

    # our decoder and free matching, on the same trace: the same tensors, by address and size
    trace = xplane.read_segments([(gzip.decompress(PUBLIC.read_bytes()), 0)], device="GPU:6")
    ev = trace.events
    freed_at, _ = analysis.match_frees(ev)
    at = int(np.argmax(ev.live))
    ours = np.nonzero(ev.is_alloc & (np.arange(len(ev)) <= at) & (freed_at > at))[0]
    assert {(int(ev.addr[i]), int(ev.chunk[i])) for i in ours} == expected

    # the report's figures of that live set
    report = tfmem_magic.analyze_xplane(PUBLIC)
    info = report.trace
    assert info.peak_live_bytes == timeline[peak][2]["bytes_allocated"]
    assert info.peak_time_s == pytest.approx(timeline[peak][0] / 1e12, abs=1e-6)  # on the trace's own clock
    assert info.allocated_at_peak_bytes == sum(s["allocation_bytes"] for s in live.values())
    assert info.requested_at_peak_bytes == sum(s["requested_bytes"] for s in live.values())
    own = [g for g in info.by_phase if g.phase not in ("pre-existing", "untraced")]
    assert sum(g.count for g in own) == len(live)
    # its largest groups of tensors, grouped as the report groups them (by the names its tf_op gives), with their
    # sizes and counts: the largest is the largest of the independent live set
    groups: dict[tuple, list[int]] = {}
    for stats in live.values():
        named = (
            analysis.attribute_path(stats["tf_op"], analysis.TraceContext())
            if stats.get("tf_op")
            else analysis.Attribution("(untagged)", None, "other")
        )
        dtype = xplane.DATA_TYPES.get(stats.get("data_type", 0))
        acc = groups.setdefault((named.op, named.layer, named.phase, dtype, stats.get("shape") or None), [0, 0])
        acc[0] += stats["allocation_bytes"]
        acc[1] += 1
    shown = [g for g in info.at_peak if g.phase not in ("pre-existing", "untraced")]
    assert len(shown) >= 10
    for g in shown:
        assert groups[(g.op, g.layer, g.phase, g.dtype, g.shape)] == [g.bytes, g.count], g
    assert shown[0].bytes == max(b for b, _ in groups.values())
    largest = sorted(live.values(), key=lambda s: -s["allocation_bytes"])[:5]
    assert {s.get("shape") for s in largest} <= {g.shape for g in shown}


def test_a_device_can_be_asked_for_and_a_missing_one_is_named():
    report = tfmem_magic.analyze_xplane(PUBLIC, device="GPU:4")
    assert list(report.tf) == ["GPU:4"] and report.trace.allocator == "GPU_4_bfc"
    with pytest.raises(TfmemUsageError, match=r"device='GPU:0'.*GPU:1, GPU:4, GPU:6"):
        tfmem_magic.analyze_xplane(PUBLIC, device="GPU:0")


def test_the_public_gpu_trace_predicts_other_batches_from_its_own_replayed_sequence():
    """Issue 29's what-if from a saved GPU trace: the trace's own 969 events replay to the byte, its batch (4 per
    replica: the leading dimension of most shaped bytes) is read from the shapes, and the batch-shaped allocations
    scaled and replayed through the simulator with the GPU's settings give the peak at other batches, anchored on
    the trace's. Checked against bounds from the trace itself: doubling the batch adds at least what the
    batch-shaped tensors live at the peak hold, and at most every batch-shaped allocation's size."""
    from tfmem_magic.advise.bands import ANALYTIC_BAND
    from tfmem_magic.analyze import analysis, bfc, step_replay

    report = tfmem_magic.analyze_xplane(PUBLIC)
    basis = report.whatif_basis
    assert basis is not None and basis.replay.source == "trace" and basis.replay.passed and basis.knobs.batch_size == 4
    assert basis.replay.own_error == 0.0 and basis.replay.events == 969
    assert any("reads this trace's batch as 4" in n for n in report.notes)
    note = next(n for n in report.notes if n.startswith("Predicted from a GPU trace (GPU:6, GPU_6_bfc)"))
    assert "largest batch whose upper estimate fits" in note

    now = tfmem_magic.predict(report)
    assert now.peak_bytes == report.tf_peak_bytes and now.basis == "replay" and now.error_band == ANALYTIC_BAND
    # the budget is the GPU's: its allocator's limit less what it held at the trace's start
    assert now.budget_bytes == report.env.device_limit_bytes["GPU:6"] - report.tf["GPU:6"].baseline_bytes
    peaks = {b: tfmem_magic.predict(report, batch_size=b).peak_bytes for b in (1, 2, 4, 8, 16)}
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8] < peaks[16]

    events = xplane.read_segments([(gzip.decompress(PUBLIC.read_bytes()), 0)], None).events
    own = bfc.self_check(events)
    at_peak = bfc.replay_prepared(own.prepared)
    shaped = [
        i
        for i in range(len(events))
        if events.is_alloc[i] and analysis.batch_dimension(events.string(int(events.shape[i])), 4)
    ]
    live_shaped = sum(
        a.requested
        for a in at_peak.live_at_peak
        if a.index >= 0 and analysis.batch_dimension(events.string(int(events.shape[a.index])), 4)
    )
    assert live_shaped > 0.3 * report.tf_peak_bytes  # activations are most of a BERT step's peak
    added = peaks[8] - peaks[4]
    assert 0.95 * live_shaped <= added <= 1.01 * sum(int(events.requested[i]) for i in shaped)

    largest = tfmem_magic.largest_batch(report)
    assert largest is not None and tfmem_magic.predict(report, batch_size=largest).fits
    assert not tfmem_magic.predict(report, batch_size=largest + 8).fits
    with pytest.raises(TfmemUsageError, match="predicts the batch only"):
        tfmem_magic.predict(report, policy="mixed_float16")
    # a batch given is taken as is (no note that it was read), and a bad one is a usage error
    given = tfmem_magic.analyze_xplane(PUBLIC, batch_size=4)
    assert given.whatif_basis.knobs.batch_size == 4 and not any("reads this trace's batch" in n for n in given.notes)
    assert step_replay.trace_batch(events)[0] == 4
    with pytest.raises(TfmemUsageError, match="batch_size=0"):
        tfmem_magic.analyze_xplane(PUBLIC, batch_size=0)
    # below 3 the batch cannot be told from weights' dimensions: no what-if, and the note says why
    tiny = tfmem_magic.analyze_xplane(PUBLIC, batch_size=2)
    assert tiny.whatif_basis is None and any("below 3" in n for n in tiny.notes)
    # a trace has no model to calibrate: a usage error, not a silent no-op
    with pytest.raises(TfmemUsageError, match="no model to calibrate"):
        tfmem_magic.predict(report, batch_size=8, calibrate=True)


def test_tfmem_show_predicts_from_a_trace_at_the_batch_given(tmp_path, capsys):
    assert cli.main(["show", str(PUBLIC), "--batch-size", "4", "--html", str(tmp_path / "page.html")]) == 0
    out = capsys.readouterr().out
    assert "Predicted from a GPU trace" in out and "reads this trace's batch" not in out
    page = (tmp_path / "page.html").read_text()
    assert "What if" in page and "batch 8" in page  # the static what-if table, the batch its only knob
    saved = tmp_path / "r.json"
    tfmem_magic.analyze_xplane(PUBLIC).save(saved)
    with pytest.raises(SystemExit):  # argparse's usage error
        cli.main(["show", str(saved), "--batch-size", "4"])
    assert "--batch-size are for a saved trace" in capsys.readouterr().err


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


GPU_RESERVED = 256 * MiB  # the GPU allocator's bytes_reserved: part of its limit, not of bytes_available


def gpu_space(
    gpu: bool = True, xla: str | None = None, launch_op: str = "model/dense/MatMul", xla_after: bool = False
) -> bytes:
    """A host plane as TensorFlow 2.21 writes it (strings as refs, numbers as varints, fragmentation a double), with
    every stat BFC's AddTraceMe writes (BFC_STATS), for a GPU allocator and a host allocator that has more events:
    the old rule (the busiest allocator) would have picked the host's. `gpu=False`: the host allocator's events only.
    `xla`: an event of that name around the GPU's two allocations (after them with `xla_after`, as a GPU
    executable's module event is), which are tagged `launch_op`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=0, name="/host:CPU")
    for mid, name in ((1, "MemoryAllocation"), (2, "MemoryDeallocation"), (3, xla)):
        if name:
            plane.event_metadata[mid].id, plane.event_metadata[mid].name = mid, name
    names = BFC_STATS + ("GPU_0_bfc", "gpu_host_bfc", "output", "[1024,1024]", "model/dense/MatMul", launch_op)
    sid = {name: i for i, name in enumerate(dict.fromkeys(names), start=1)}
    for name, i in sid.items():
        plane.stat_metadata[i].id, plane.stat_metadata[i].name = i, name
    line = plane.lines.add(id=1, name="tf_gpu", timestamp_ns=1000)
    live = {"GPU_0_bfc": 0, "gpu_host_bfc": 0}
    peak = dict(live)
    limit = {"GPU_0_bfc": 15 * GiB, "gpu_host_bfc": 64 * GiB}
    reserved = {"GPU_0_bfc": GPU_RESERVED, "gpu_host_bfc": 0}

    def event(t: int, allocator: str, size: int, alloc: bool, addr: int) -> None:
        live[allocator] += size if alloc else -size
        peak[allocator] = max(peak[allocator], live[allocator])
        e = line.events.add(metadata_id=1 if alloc else 2, offset_ps=t * 1000)
        ints = {
            "bytes_reserved": reserved[allocator],
            "bytes_allocated": live[allocator],
            "bytes_available": limit[allocator] - reserved[allocator] - live[allocator],
            "peak_bytes_in_use": peak[allocator],
            "requested_bytes": size if alloc else 0,
            "allocation_bytes": size,
            "addr": addr,
            "id": 7,
            "data_type": 1,
        }
        refs = {
            "allocator_name": allocator,
            "tf_op": launch_op if allocator == "GPU_0_bfc" else "model/dense/MatMul",
            "region_type": "output",
            "shape": "[1024,1024]",
        }
        for name in BFC_STATS:
            if name == "fragmentation":
                e.stats.add(metadata_id=sid[name], double_value=0.25)
            elif name in refs:
                e.stats.add(metadata_id=sid[name], ref_value=sid[refs[name]])
            else:
                e.stats.add(metadata_id=sid[name], int64_value=ints[name])

    if xla:
        line.events.add(metadata_id=3, offset_ps=5000 if xla_after else 500, duration_ps=2000)
    if gpu:
        event(1, "GPU_0_bfc", 4 * MiB, True, 0x1000)
        event(2, "GPU_0_bfc", 4 * MiB, True, 0x9000)
    for k in range(6):  # pinned host staging: many small events
        event(3 + 2 * k, "gpu_host_bfc", 4096, True, 0x50000)
        event(4 + 2 * k, "gpu_host_bfc", 4096, False, 0x50000)
    if gpu:
        event(20, "GPU_0_bfc", 4 * MiB, False, 0x9000)
    return space.SerializeToString()


def test_the_gpu_allocator_is_kept_even_when_the_host_one_is_busier():
    data = gpu_space()
    fast, slow = (xplane.finish(*xplane.read_xspace(data, 0, reference=r)) for r in (False, True))
    for trace in (fast, slow):
        assert trace.events.allocator == "GPU_0_bfc" and len(trace.events) == 3
        gpu, host = trace.allocators
        # the limit is in use + available + reserved: BFC's bytes_available leaves the reserved bytes out
        assert (gpu.device, gpu.peak_bytes, gpu.limit_bytes, gpu.start_bytes, gpu.end_bytes) == (
            "GPU:0",
            8 * 2**20,
            15 * GiB,
            0,
            4 * 2**20,
        )
        assert (host.name, host.device, host.events, host.limit_bytes) == ("gpu_host_bfc", None, 12, 64 * GiB)
    assert xplane.read_segments([(data, 0)], device="GPU:0").events.allocator == "GPU_0_bfc"
    assert all(not s.name.startswith(xplane.XLA_SPAN) for s in fast.spans)


def test_a_gpu_xspace_with_every_bfc_stat_is_a_report(tmp_path):
    """The hand-made GPU XSpace, saved and read as a user's would be (tfmem_magic.analyze_xplane): every stat TF's
    BFC allocator writes is in it, and the report is about GPU:0 with that allocator's peak, limit and tensors."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    data = gpu_space()
    space = xplane_pb2.XSpace.FromString(data)
    (plane,) = space.planes
    names = {k: v.name for k, v in plane.stat_metadata.items()}
    for event in plane.lines[0].events:
        stats = {names[s.metadata_id]: s.WhichOneof("value") for s in event.stats}
        assert tuple(stats) == BFC_STATS and stats["fragmentation"] == "double_value"
    path = tmp_path / "worker.xplane.pb"
    path.write_bytes(data)
    report = tfmem_magic.analyze_xplane(path)
    assert list(report.tf) == ["GPU:0"] and report.env.devices == ["GPU:0"]
    assert (report.main_device.baseline_bytes, report.main_device.peak_bytes, report.main_device.end_bytes) == (
        0,
        8 * MiB,
        4 * MiB,
    )
    assert report.trace.allocator == "GPU_0_bfc" and report.trace.events == 3
    # the limit counts what BFC reserved: bytes_allocated + bytes_available alone would be 256 MiB short
    assert report.device_budget == ("GPU:0", 15 * GiB) and report.env.device_limit_bytes == {"GPU:0": 15 * GiB}
    (group,) = report.trace.at_peak
    assert (group.op, group.layer, group.dtype, group.shape, group.bytes, group.count) == (
        "MatMul",
        "dense",
        "float32",
        "[1024,1024]",
        8 * MiB,
        2,
    )
    host = report.trace.allocators[1]
    assert (host.name, host.device, host.events, host.limit_bytes) == ("gpu_host_bfc", None, 12, 64 * GiB)
    assert "gpu_host_bfc (pinned host memory): peak 4 KiB in 12 events" in " ".join(report.notes)
    assert not report.trace.xla_runs and not any("XLA" in n for n in report.notes)
    assert "fits GPU:0 with" in tfmem_magic.render_text(report)


def test_a_trace_of_pinned_host_memory_only_is_listed_as_the_hosts(tmp_path):
    """A trace whose only allocator is gpu_host_bfc (it serves no TF device): its figures are the host's (CPU:0),
    not keyed by the allocator's name, and a note says whose they are."""
    path = tmp_path / "host_only.xplane.pb"
    path.write_bytes(gpu_space(gpu=False))
    report = tfmem_magic.analyze_xplane(path)
    assert list(report.tf) == ["CPU:0"] and report.main_device_name == "CPU:0"
    assert report.main_device.peak_bytes == 4096 and report.trace.allocator == "gpu_host_bfc"
    assert report.env.devices == ["CPU:0"] and report.device_budget is None
    assert any("gpu_host_bfc's only (the pinned host memory" in n for n in report.notes)
    assert "CPU:0" in tfmem_magic.render_text(report)


def test_a_cuda_malloc_async_allocator_serves_its_gpu():
    """TF_GPU_ALLOCATOR=cuda_malloc_async names a GPU's allocator gpu_async_<id> (gpu_cudamallocasync_allocator.cc)."""
    assert [xplane.allocator_device(n) for n in ("gpu_async_0", "gpu_async_3", "gpu_async_host")] == [
        "GPU:0",
        "GPU:3",
        None,
    ]


def test_tfmem_show_reads_a_single_plain_xplane_file(tmp_path, capsys):
    path = tmp_path / "host.xplane.pb"
    path.write_bytes(gzip.decompress(PUBLIC.read_bytes()))
    assert cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host.xplane.pb" in out and "Verdict   fits GPU:6" in out and "GPU_6_bfc" in out


@pytest.mark.parametrize(
    "name, launch_op, after",
    [
        ("XlaLaunch", "cluster_1", False),  # an event named as the op type only
        ("cluster_1/xla_run:_XlaRun", "cluster_1/xla_run", False),  # auto-clustering's launch op, "<node>:<type>"
        ("StatefulPartitionedCall/cluster_0:XlaLaunch", "StatefulPartitionedCall/cluster_0", False),
        # a GPU executable's run of a jit_compile function: its buffers are allocated before its own event, tagged with
        # the function's op name
        (
            "a_inference_train_step_812__XlaMustCompile_true_config_proto_1_executor_type_2_.3:XLA GPU module",
            "__inference_train_step_812",
            True,
        ),
    ],
)
def test_xla_runs_in_a_saved_trace_get_the_note_and_their_bytes(tmp_path, name, launch_op, after):
    path = tmp_path / "xla.xplane.pb"
    path.write_bytes(gpu_space(xla=name, launch_op=launch_op, xla_after=after))
    report = tfmem_magic.analyze_xplane(path)
    info = report.trace
    assert info.xla_runs == 1 and info.xla_at_peak_bytes == 8 * MiB
    (group,) = info.at_peak
    assert (group.op, group.layer, group.phase, group.bytes) == ("XLA computation", None, "other", 8 * MiB)
    note = next(n for n in report.notes if "XLA" in n)
    assert "ran as XLA computations (1 XLA run traced)" in note and "8 MiB at the peak is in no layer" in note
    assert "jit_compile=False" in note


def test_the_timeline_draws_the_other_allocators_and_the_gpus_limit():
    """The public trace's figure: GPU_6_bfc's series, the other allocators' (pinned host memory, the other GPUs) as
    thinner lines named after them, and GPU:6's limit as a dashed line at 14.4 GiB."""
    from tfmem_magic.show import figures

    report = tfmem_magic.analyze_xplane(PUBLIC)
    fig = figures.timeline_figure(report)
    (ax,) = fig.axes  # no process memory in a saved trace: no RSS row
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    limit_label = f"GPU:6 limit {tfmem_magic.format_bytes(report.device_budget[1])}"
    assert set(lines) == {"GPU_6_bfc", "gpu_host_bfc", "GPU_4_bfc", "GPU_1_bfc", limit_label}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "GPU_6_bfc" and sorted(legend) == sorted(lines)
    main, host = lines["GPU_6_bfc"], lines["gpu_host_bfc"]
    assert host.get_linewidth() < main.get_linewidth()
    listed = {a.name: a for a in report.trace.allocators}
    assert max(host.get_ydata()) * GiB == pytest.approx(listed["gpu_host_bfc"].peak_bytes)  # plotted in GiB
    assert max(main.get_ydata()) * GiB == pytest.approx(report.main_device.peak_bytes)
    assert lines[limit_label].get_linestyle() == "--"
    assert lines[limit_label].get_ydata()[0] * GiB == pytest.approx(report.device_budget[1])
    assert figures.timeline_png(report).startswith(b"\x89PNG")


@pytest.mark.slow
def test_mixed_float16_keeps_the_what_if_and_its_fixes(shell):
    """The GPU's precision, on CPU (slow there, not wrong): LossScaleOptimizer wraps Adam, and the what-if counts
    Adam's slots instead of failing on the wrapper's name."""
    import keras
    import numpy as np

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(256, activation="relu", name="hidden"),
                keras.layers.Dense(10, dtype="float32", name="out"),
            ]
        )
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

    columns = {
        "t_ps": np.array([5, 5, 5]),
        "live": np.array([10, 20, 30]),
        "chunk": np.array([10, 10, 10]),
        "is_alloc": np.array([True, True, True]),
        "limit": np.array([0, 0, 0]),
        "lifetime_peak": np.array([0, 0, 0]),
    }
    ((_, series),) = xplane._summaries(np.array([0, 0, 0]), columns, ["GPU_0_bfc"])
    assert (series.start_bytes, series.end_bytes, series.peak_bytes, series.limit_bytes) == (0, 30, 30, None)
    assert series.lifetime_peak_bytes is None  # the events state none


@pytest.mark.slow
def test_an_xla_compiled_fit_says_why_its_breakdown_has_no_layers():
    """jit_compile (Keras 3's default with a GPU: "auto") runs the step as one XLA computation, whose buffers carry
    no op names; on CPU the same holds, so it is tested here."""
    import keras
    import numpy as np

    x, y = np.random.rand(256, 128).astype("float32"), np.random.randint(0, 10, 256)
    reports = {}
    for jit in (True, False):
        model = keras.Sequential(
            [
                keras.Input((128,)),
                keras.layers.Dense(512, activation="relu", name="wide"),
                keras.layers.Dense(10, name="head"),
            ],
            name=f"xla_{jit}",
        )
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        # built and compiled before the measured fit: its peak is a step's, not the moment the variables are made
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
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
    assert compiled.trace.xla_runs and not plain.trace.xla_runs
    assert share(plain, {"other"}) < 0.5, plain.trace.by_phase  # its buffers are named (forward, optimizer, ...)


def test_calibration_on_a_gpu_grows_into_what_the_kernel_left_and_says_so_when_nothing_is(monkeypatch):
    """The probe process runs with memory growth (it takes what its steps use, next to the kernel's reservation);
    when the kernel reserved the whole GPU, the probe's OOM becomes a message naming the memory-growth fix."""
    import keras

    from tfmem_magic.advise import probe_runs

    monkeypatch.delenv(probe_runs.GPU_GROWTH_ENV, raising=False)
    assert probe_runs.probe_environment()[probe_runs.GPU_GROWTH_ENV] == "true"
    monkeypatch.setenv(probe_runs.GPU_GROWTH_ENV, "false")  # the user's choice is kept
    assert probe_runs.probe_environment()[probe_runs.GPU_GROWTH_ENV] == "false"
    oom = (
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
        "shape[64,1024] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc"
    )
    monkeypatch.setattr(probe_runs, "_run_probe", lambda payload, stage: (1, [], oom))
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile("sgd", "mse")
    with pytest.raises(TfmemUsageError, match="memory growth is off|unless memory growth is on"):
        probe_runs.probe_peaks(model, [8, 16], True, None)


T4_LIMIT = 14_648_653_952  # GPU_0_bfc's limit on the public Tesla T4 traces
T4_BEFORE = 20_035_584  # held before the step: the weights, Adam's slots, the iterator's batches
_SEQ, _GRAD = "StatefulPartitionedCall/sequential/", "StatefulPartitionedCall/gradient_tape/sequential/"
# A Keras CNN's training step at batch 256 as the T4 traces record it, rebuilt from their published figures (the
# traces' licence is not known, so they are not copied): (alloc?, tf_op, dtype enum, shape, region, bytes, addr).
# Its largest allocation, at the 140 MiB peak, is conv2d's cuDNN workspace of Conv2DBackpropFilter, uint8[64552960]:
# 44% of the peak.
T4_STEP = [
    (
        True,
        _SEQ + "ArithmeticOptimizer/ReorderCastLikeAndValuePreserving_float_Cast",
        1,
        "[256,32,32,3]",
        "output",
        3_145_728,
        0x1000,
    ),
    (True, _SEQ + "conv2d/Relu", 1, "[256,30,30,32]", "output", 29_491_200, 0x2000),
    (True, _SEQ + "conv2d/Conv2D", 4, "[1048576]", "temp", 1_048_576, 0x3000),  # the forward convolution's workspace
    (False, None, 0, None, None, 1_048_576, 0x3000),
    (True, _SEQ + "max_pooling2d/MaxPool", 1, "[256,15,15,32]", "output", 7_372_800, 0x4000),
    (True, _SEQ + "conv2d_1/Relu", 1, "[256,13,13,64]", "output", 11_075_584, 0x5000),
    (True, _SEQ + "dense/MatMul", 1, "[256,10]", "output", 10_240, 0x6000),
    (True, _GRAD + "dense/MatMul/MatMul_1", 1, "[256,10816]", "output", 11_075_584, 0x7000),
    (True, _GRAD + "conv2d_1/ReluGrad", 1, "[256,13,13,64]", "output", 11_075_584, 0x8000),
    (False, None, 0, None, None, 11_075_584, 0x7000),
    (False, None, 0, None, None, 11_075_584, 0x5000),
    (True, _GRAD + "conv2d_1/Conv2D/Conv2DBackpropInput", 1, "[256,15,15,32]", "output", 7_372_800, 0x9000),
    (True, _GRAD + "conv2d_1/Conv2D/Conv2DBackpropFilter", 1, "[3,3,32,64]", "output", 73_728, 0xA000),
    (False, None, 0, None, None, 11_075_584, 0x8000),
    (True, _GRAD + "max_pooling2d/MaxPool/MaxPoolGrad", 1, "[256,30,30,32]", "output", 29_491_200, 0xB000),
    (False, None, 0, None, None, 7_372_800, 0x9000),
    (False, None, 0, None, None, 7_372_800, 0x4000),
    (True, _GRAD + "conv2d/ReluGrad", 1, "[256,30,30,32]", "output", 29_491_200, 0xC000),
    (False, None, 0, None, None, 29_491_200, 0xB000),
    (True, _GRAD + "conv2d/Conv2D/Conv2DBackpropFilter", 4, "[64552960]", "temp", 64_552_960, 0xD000),  # the peak
    (False, None, 0, None, None, 64_552_960, 0xD000),
    (True, _GRAD + "conv2d/Conv2D/Conv2DBackpropFilter", 1, "[3,3,3,32]", "output", 3_584, 0xE000),
    (False, None, 0, None, None, 29_491_200, 0xC000),
    (False, None, 0, None, None, 29_491_200, 0x2000),
    (False, None, 0, None, None, 3_145_728, 0x1000),
]


def bfc_space(
    rows, before: int = 0, limit: int = T4_LIMIT, since_start: int = 0, stats: tuple[str, ...] = BFC_STATS
) -> bytes:
    """One GPU allocator's memory events (GPU_0_bfc), one µs apart, with every stat BFC writes (`stats`: BFC_STATS);
    a free carries no op, dtype or shape, as TensorFlow's do not. A row is (is an allocation, op, dtype, shape, region,
    bytes, address) and, where BFC handed out a larger chunk than the bytes, that chunk. `before`: the bytes in use
    before the first event;
    `since_start`: the allocator's peak before the trace (peak_bytes_in_use starts there)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=0, name="/host:CPU")
    for mid, name in ((1, "MemoryAllocation"), (2, "MemoryDeallocation")):
        plane.event_metadata[mid].id, plane.event_metadata[mid].name = mid, name
    texts = [*stats, "GPU_0_bfc"] + [t for r in rows for t in (r[1], r[3], r[4]) if t]
    sid = {name: i for i, name in enumerate(dict.fromkeys(texts), start=1)}
    for name, i in sid.items():
        plane.stat_metadata[i].id, plane.stat_metadata[i].name = i, name
    line = plane.lines.add(id=1, name="tf_gpu", timestamp_ns=1000)
    live, peak = before, max(before, since_start)
    for k, (alloc, op, dtype, shape, region, size, addr, *handed) in enumerate(rows):
        chunk = handed[0] if handed else size  # a row's eighth figure: the chunk BFC handed out, where not its size
        live += chunk if alloc else -chunk
        peak = max(peak, live)
        e = line.events.add(metadata_id=1 if alloc else 2, offset_ps=(k + 1) * 10**6)
        ints = {
            "bytes_reserved": 0,
            "bytes_allocated": live,
            "bytes_available": limit - live,
            "peak_bytes_in_use": peak,
            "requested_bytes": size if alloc else 0,
            "allocation_bytes": chunk,
            "addr": addr,
            "id": 7,
            "data_type": dtype,
        }
        refs = {"allocator_name": "GPU_0_bfc", "tf_op": op, "region_type": region, "shape": shape}
        for name in stats:
            if name == "fragmentation":
                e.stats.add(metadata_id=sid[name], double_value=0.0)
            elif name in refs:
                if refs[name]:
                    e.stats.add(metadata_id=sid[name], ref_value=sid[refs[name]])
            elif alloc or name != "data_type":
                e.stats.add(metadata_id=sid[name], int64_value=ints[name])
    return space.SerializeToString()


def test_a_cudnn_workspace_at_a_gpu_traces_peak_is_a_workspace_with_its_finding_and_fix(tmp_path):
    """A T4 CNN step rebuilt from the public traces' figures: its largest allocation, a cuDNN workspace, is shown as
    a workspace (not a backward activation), the batch is read from the activations (not the workspace's length),
    a finding says how much of the peak workspaces are and what caps them, and the fix cell sets the cap before
    TensorFlow's first GPU convolution, in a restarted kernel. Grappler's ArithmeticOptimizer is no layer."""
    path = tmp_path / "t4.xplane.pb"
    path.write_bytes(bfc_space(T4_STEP, before=T4_BEFORE))
    report = tfmem_magic.analyze_xplane(path)  # no batch given: 256, read from the activations' shapes
    assert report.main_device_name == "GPU:0" and report.device_budget == ("GPU:0", T4_LIMIT)
    assert report.main_device.peak_bytes == 140 * MiB == report.trace.peak_live_bytes
    assert report.whatif_basis is not None and report.whatif_basis.knobs.batch_size == 256
    top = report.trace.at_peak[0]
    assert (top.op, top.layer, top.phase, top.dtype, top.shape, top.bytes) == (
        "Conv2DBackpropFilter",
        "conv2d",
        "workspace",
        "uint8",
        "[64552960]",
        64_552_960,
    )
    assert {g.phase: g.bytes for g in report.trace.by_phase}["workspace"] == 64_552_960
    assert "ArithmeticOptimizer" not in {g.layer for g in report.trace.by_layer}
    (finding,) = [f for f in report.findings if f.id == "cudnn-workspace"]
    assert finding.bytes == 64_552_960 and finding.severity == "warn" and finding.fixes == ["cudnn-workspace-limit"]
    assert "44% of the peak on GPU:0" in finding.title
    assert "conv2d · Conv2DBackpropFilter uint8[64552960] 61.6 MiB" in finding.evidence
    for words in ("fastest whose workspace fits", "TF_CUDNN_WORKSPACE_LIMIT_IN_MB", "TF_CUDNN_USE_AUTOTUNE=0"):
        assert words in finding.evidence
    (fix,) = [f for f in report.fixes if f.id == "cudnn-workspace-limit"]
    assert fix.needs_restart and fix.placement == "top" and fix.predicted_peak_bytes is None
    assert 'os.environ["TF_CUDNN_WORKSPACE_LIMIT_IN_MB"] = "30"' in fix.code  # half of 61.6 MiB
    assert "restart the kernel" in fix.code and "speed" in fix.why and "restart" in fix.why
    compile(fix.code, "fix", "exec")
    assert "workspace" in tfmem_magic.render_text(report)


def test_a_small_workspace_gets_no_finding(tmp_path):
    """Workspaces under a tenth of the peak (and under 256 MiB) are true but not worth a finding: here 1 MiB, and
    the peak moves to the activations."""
    small = [r if r[5] != 64_552_960 else (*r[:3], "[1048576]", r[4], 1_048_576, r[6]) for r in T4_STEP]
    path = tmp_path / "small.xplane.pb"
    path.write_bytes(bfc_space(small, before=T4_BEFORE))
    report = tfmem_magic.analyze_xplane(path)
    assert report.trace.peak_live_bytes < 140 * MiB
    assert "cudnn-workspace" not in {f.id for f in report.findings}
    assert "cudnn-workspace-limit" not in {f.id for f in report.fixes}


def test_a_first_step_that_peaked_above_the_trace_is_reported_and_judged(tmp_path):
    """A T4 step whose allocator had peaked at twice the step's peak before the trace (the lower of the two ratios
    the public traces show: a first step's cuDNN autotuning): the report keeps that peak beside the trace's, a note
    says which is higher and by how much, and 'fits' judges the higher one, where the step's own peak fits."""
    path = tmp_path / "t4.xplane.pb"
    from tfmem_magic.advise import prediction

    path.write_bytes(bfc_space(T4_STEP, before=T4_BEFORE, since_start=2 * 140 * MiB))
    report = tfmem_magic.analyze_xplane(path)
    mem = report.main_device
    assert (mem.peak_bytes, mem.lifetime_peak_bytes) == (140 * MiB, 280 * MiB)
    (note,) = [n for n in report.notes if "since its process started" in n]
    assert "GPU:0's peak since its process started, 280 MiB" in note and "140 MiB above this trace's" in note
    assert "(2.0x it)" in note and "autotuner" in note and "judges 'fits' and the largest batch against it" in note
    step = report.tf_peak_bytes  # over the trace's start
    room = int(1.5 * step)  # the step fits with its band, the first step does not
    judged = prediction.predict(report, tf_budget=room)
    assert judged.peak_bytes == step and judged.fits is False
    assert any("judged at" in n and "'The first step'" in n for n in judged.notes)
    plain = tmp_path / "plain.xplane.pb"
    plain.write_bytes(bfc_space(T4_STEP, before=T4_BEFORE))
    steady = tfmem_magic.analyze_xplane(plain)
    assert steady.main_device.lifetime_peak_bytes == 140 * MiB  # the trace holds it
    assert any("The trace holds GPU:0's peak since its process started" in n for n in steady.notes)
    assert prediction.predict(steady, tf_budget=room).fits is True
    assert tfmem_magic.predict(report).largest_batch < tfmem_magic.predict(steady).largest_batch


def test_a_trace_without_the_peak_since_start_says_so_with_the_autotuning_caveat(tmp_path):
    path = tmp_path / "t4.xplane.pb"
    path.write_bytes(
        bfc_space(T4_STEP, before=T4_BEFORE, stats=tuple(s for s in BFC_STATS if s != "peak_bytes_in_use"))
    )
    report = tfmem_magic.analyze_xplane(path)
    assert report.main_device.lifetime_peak_bytes is None
    (note,) = [n for n in report.notes if "peak since its process started" in n]
    assert "does not record GPU_0_bfc's peak since its process started" in note
    assert "autotuner" in note and "TF_CUDNN_WORKSPACE_LIMIT_IN_MB" in note and "Leave room" in note


def test_a_gpu_trace_that_begins_mid_run_still_gets_a_what_if_and_says_how(tmp_path):
    """The T4 step traced mid-run: before it, a free 60 MiB chunk the trace never shows lay above conv2d's output's
    first chunk, and TensorFlow put the 40 MiB output there unsplit (a 60 MiB chunk). The simulator, which cannot
    know that chunk, gives the sequence back 1% off or more; the what-if sums the trace's own chunks over the bytes
    in use at its start instead, and a note says so. It used to get no what-if."""
    base = 0x7F00_0000_0000
    output = 256 * 40960 * 4  # 40 MiB
    rows = [
        (True, _SEQ + "conv2d/Relu", 1, "[256,40960]", "output", output, base + 108 * MiB, 60 * MiB),
        (True, _SEQ + "dense/MatMul", 1, "[256,16384]", "output", 16 * MiB, base + 176 * MiB),
        (False, None, 0, None, None, 8 * MiB, base + 100 * MiB),  # made before the trace
        (True, _GRAD + "dense/MatMul/MatMul_1", 1, "[256,8192]", "output", 8 * MiB, base + 100 * MiB),
        (False, None, 0, None, None, 0, base + 108 * MiB, 60 * MiB),
        (False, None, 0, None, None, 16 * MiB, base + 176 * MiB),
        (False, None, 0, None, None, 8 * MiB, base + 100 * MiB),
    ]
    path = tmp_path / "mid.xplane.pb"
    path.write_bytes(bfc_space(rows, before=116 * MiB))
    report = tfmem_magic.analyze_xplane(path)
    assert report.main_device.peak_bytes == 192 * MiB and report.main_device.baseline_bytes == 116 * MiB
    curve = report.whatif_basis.replay
    assert curve.summed and curve.passed and curve.own_error > 0.01
    (note,) = [n for n in report.notes if n.startswith("This trace begins mid-run")]
    assert "116 MiB were in use before its first event" in note and "sums the trace's own chunks" in note
    assert tfmem_magic.predict(report).peak_bytes == 76 * MiB  # the trace's own peak over its start
    bigger = tfmem_magic.predict(report, batch_size=512)
    assert bigger.peak_bytes == (100 + 32 + 8) * MiB  # the 60 MiB chunk grown by its request's 40 MiB, and B's 16
    assert any("summed over the bytes in use at the trace's start" in n for n in bigger.notes)


def test_the_gpus_verdict_and_near_budget_judge_the_peak_since_the_process_started(tmp_path):
    """The T4 step fits the GPU easily, but its allocator had peaked at 90% of the limit before the trace: the
    verdict and the near-budget finding speak of that peak, and say it is the one since the process started."""
    from tfmem_magic.show import view

    path = tmp_path / "t4.xplane.pb"
    path.write_bytes(bfc_space(T4_STEP, before=T4_BEFORE, since_start=int(0.9 * T4_LIMIT)))
    report = tfmem_magic.analyze_xplane(path)
    assert (
        view.verdict(report) == "used 90% of GPU:0's 13.6 GiB at its peak since the process started (above the trace's)"
    )
    (near,) = [f for f in report.findings if f.id == "near-budget"]
    assert near.title == "TensorFlow used 90% of GPU:0's memory" and "since its process started" in near.evidence
