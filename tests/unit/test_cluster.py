"""The cluster view from hand-built worker reports, and the worker addresses a capture accepts."""

from __future__ import annotations

import pytest

from tfmem_magic.analyze.cluster import WorkerRow, cluster_view, from_directory
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import DeviceMemory, EnvInfo, LiveGroup, Report, TraceInfo
from tfmem_magic.measure.remote import parse_workers
from tfmem_magic.show.cluster_render import cluster_html, cluster_text

MiB = 2**20


def worker(label: str, grown: int, top_layer: str = "wide") -> Report:
    trace = TraceInfo(
        events=100,
        peak_live_bytes=(10 + grown) * MiB,
        peak_time_s=0.5,
        at_peak=[
            LiveGroup(op="MatMul", layer=top_layer, phase="forward", bytes=grown * MiB),
            LiveGroup(op=None, layer=None, phase="pre-existing", bytes=10 * MiB),
        ],
    )
    return Report(label=label, tf={"CPU:0": DeviceMemory(10 * MiB, (10 + grown) * MiB, 10 * MiB)}, trace=trace)


def test_the_worst_worker_and_an_imbalance_are_named():
    view = cluster_view(
        [
            WorkerRow("w0:6009", worker("w0", 40)),
            WorkerRow("w1:6009", worker("w1", 42)),
            WorkerRow("w2:6009", worker("w2", 120, "chief_only")),
            WorkerRow("w3:6009", None, "unreachable: no profiler server answered there"),
        ]
    )
    assert view.worst.worker == "w2:6009"
    imbalance = next(f for f in view.findings if f.startswith("Imbalance"))
    assert (
        "w2:6009 peaked at 130 MiB, 2.5x the median worker (52 MiB): 120 MiB made while it was traced, 10 MiB "
        "held before"
        in imbalance
        and "chief_only" in imbalance
    )
    assert any(f.startswith("w3:6009: no report (unreachable") for f in view.findings)
    text = cluster_text(view)
    assert "w2:6009 (worst)" in text and "chief_only · MatMul (forward)" in text
    assert "<td style='padding:2px 8px'>w2:6009 (worst)</td>" in cluster_html(view)


def test_even_workers_are_not_an_imbalance():
    view = cluster_view([WorkerRow("a:1", worker("a", 40)), WorkerRow("b:1", worker("b", 45))])
    assert not any(f.startswith("Imbalance") for f in view.findings)


def test_a_folder_of_saved_worker_reports(tmp_path):
    worker("w0", 40).save(tmp_path / "worker0.json")
    worker("w1", 90).save(tmp_path / "worker1.json")
    (tmp_path / "tfmem-epochs.json").write_text('[{"epoch": 0}]')  # another file the callback writes: skipped
    view = from_directory(tmp_path)
    assert [r.worker for r in view.rows] == ["worker0", "worker1"] and view.worst.worker == "worker1"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TfmemUsageError, match="holds no worker reports"):
        from_directory(empty)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:6009", ["127.0.0.1:6009"]),
        ("grpc://w0:6009, w1:6010", ["w0:6009", "w1:6010"]),
    ],
)
def test_worker_addresses(text, expected):
    assert parse_workers(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "name the workers"),
        ("w0", "not a worker address"),
        ("w0:99999", "not a worker address"),
        ("w0:1,w0:1", "named twice"),
    ],
)
def test_bad_worker_addresses_say_what_to_write(text, message):
    with pytest.raises(TfmemUsageError, match=message):
        parse_workers(text)


def test_the_cluster_panel_shows_the_worst_worker_first_and_switches():
    from tfmem_magic.show.panel import cluster_panel

    view = cluster_view(
        [
            WorkerRow("w0:1", worker("w0", 40)),
            WorkerRow("w1:1", worker("w1", 90)),
            WorkerRow("w2:1", None, "unreachable"),
        ]
    )
    panel = cluster_panel(view)
    table, choice, shown = panel.children
    assert "w1:1 (worst)" in table.value
    assert [label for label, _ in choice.options] == ["w1:1 (CPU:0)", "w0:1 (CPU:0)"]
    first = shown.children[0]
    choice.value = 1
    assert shown.children[0] is not first and "w0" in shown.children[0].children[0].value


def test_a_worker_whose_allocator_saw_part_of_its_memory_is_named_with_the_fix():
    """A trace from a process that did not switch to BFC (oneDNN's allocator traces only large requests): its
    report's finding speaks of the process that recorded it, and the cluster view names the worker."""
    from tfmem_magic.advise import diagnose

    partial, whole = worker("w0", 40), worker("w1", 42)
    partial.env = EnvInfo(allocator="mklcpu", allocator_complete=False)  # as saved_trace reads a non-BFC trace
    whole.env = EnvInfo(allocator="bfc_cpu_allocator_for_gpu", allocator_complete=True)
    found = diagnose.allocator_blind_spot(partial)
    assert found is not None and "The process that recorded this trace" in found.evidence
    assert "tfmem_magic.serve(PORT)" in found.evidence and "only process RSS" not in found.evidence
    assert diagnose.allocator_blind_spot(whole) is None
    view = cluster_view([WorkerRow("w0", partial), WorkerRow("w1", whole)])
    said = [f for f in view.findings if "partial view" in f]
    assert len(said) == 1 and said[0].startswith("w0: a partial view") and "256 KiB" in said[0]


def test_a_folders_traces_are_read_by_the_reader_given(tmp_path):
    """The pipeline hands its own reader (findings and fixes added) to the analysis layer's folder walk."""
    (tmp_path / "w0.xplane.pb").write_bytes(b"not read here")
    worker("w1", 30).save(tmp_path / "w1.json")
    read = []
    view = from_directory(tmp_path, read_trace=lambda path: read.append(path.name) or worker("w0", 60))
    assert read == ["w0.xplane.pb"] and [r.worker for r in view.rows] == ["w0", "w1"]
    assert view.worst.worker == "w0"


def test_a_worker_that_served_its_peaks_is_a_row_with_no_breakdown():
    """A MultiWorkerMirroredStrategy worker other than the chief serves its peaks, not a trace (measure/remote.py):
    its row has the allocator's and the process's peaks, the heavier worker is named from them, and a worker whose
    TensorFlow kept no statistics is shown without figures and said so."""
    from tfmem_magic.analyze.cluster import peaks_report

    served = {
        "schema": "tfmem.peaks/1",
        "role": "worker 1 of a MultiWorkerMirroredStrategy job",
        "seconds": 1.0,
        "tensorflow": "2.21.0",
        "device": "CPU:0",
        "tf_start_bytes": 40 * MiB,
        "tf_peak_bytes": 90 * MiB,
        "tf_end_bytes": 41 * MiB,
        "rss_start_bytes": 900 * MiB,
        "rss_peak_bytes": 950 * MiB,
        "rss_end_bytes": 910 * MiB,
        "rss_peak_source": "hwm",
    }
    heavy = peaks_report(served, "w1:6009")
    assert heavy.mode == "quick" and heavy.trace is None and heavy.tf_peak_bytes == 50 * MiB
    assert heavy.rss.peak_bytes == 950 * MiB and heavy.notes[0].startswith("Peaks only: this is worker 1")
    blind = peaks_report({**served, "device": None, "tf_peak_bytes": None}, "w2:6009")
    view = cluster_view(
        [WorkerRow("w0:6009", worker("w0", 20)), WorkerRow("w1:6009", heavy), WorkerRow("w2:6009", blind)]
    )
    assert view.worst.worker == "w1:6009"
    assert any(f.startswith("Imbalance: w1:6009 peaked at 90 MiB") for f in view.findings), view.findings
    assert any(f.startswith("w2:6009: no TensorFlow allocator figures") for f in view.findings), view.findings
    text = cluster_text(view)
    assert "no breakdown (no trace)" in text
    line = next(row for row in text.splitlines() if row.startswith("w2:6009"))
    assert "0 B" not in line, line
    assert "<table>" in cluster_html(view)
