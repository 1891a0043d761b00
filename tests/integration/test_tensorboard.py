"""Reports written for TensorBoard, read back the way TensorBoard reads them: its event reader for the scalars and
the text, and xprof's converter (what the Profile tab runs) for the trace's memory profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tfmem_magic
from tfmem_magic.adapters import cli

pytest.importorskip("tensorboard")
pytestmark = pytest.mark.slow
MiB = 2**20


def fit_small(batch: int = 64) -> None:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu", name="wide"),
                              keras.layers.Dense(10, name="head")], name="tb_mlp")
    model.compile("adam", "sparse_categorical_crossentropy")
    x = np.random.default_rng(0).random((512, 256), dtype="float32")
    model.fit(x, np.zeros(512, "int32"), batch_size=batch, epochs=1, verbose=0)


def scalars_and_text(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    scalars, texts = {}, {}
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        first = events[0].tensor_proto
        if first.dtype == 7:  # DT_STRING: the text plugin
            texts[tag] = first.string_val[0].decode()
        else:
            scalars[tag] = [(e.step, float(make_ndarray(e.tensor_proto))) for e in events]
    return scalars, texts


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One traced fit with its XSpaces kept, written to a logdir."""
    import tensorflow as tf

    tf.constant(0)  # TensorFlow running before the block, as in a notebook: its live bytes are sampled
    with tfmem_magic.profile(label="tb fit", keep_xspaces=True) as p:
        fit_small()
    logdir = tmp_path_factory.mktemp("tb")
    written = tfmem_magic.to_tensorboard(p.report, logdir, p.xspaces)
    return p.report, p.xspaces, written


def test_the_timeline_and_the_text_report_read_back_as_tensorboard_reads_them(traced):
    report, _, written = traced
    assert written.run_dir.name.startswith("tb_fit-") and written.events
    scalars, texts = scalars_and_text(written.run_dir)
    live = scalars["tfmem/tf_live_MiB/CPU:0"]
    device = report.tf["CPU:0"]
    assert len(live) == len(device.samples) and live[-1][0] == int(device.samples[-1][0] * 1000)
    # sampled every 50 ms: the samples' top is at most the allocator's exact peak
    assert [v for _, v in live] == pytest.approx([b / MiB for _, b in device.samples], rel=1e-6)
    assert 0 < max(v for _, v in live) <= device.peak_bytes / MiB + 1e-3
    assert scalars["tfmem/tf_peak_MiB/CPU:0"][0][1] == pytest.approx(report.tf_peak_bytes / MiB, rel=1e-6)
    assert len(scalars["tfmem/rss_MiB"]) == len(report.rss.samples)
    traced_live = [v for _, v in scalars["tfmem/traced_live_MiB"]]
    assert max(traced_live) == pytest.approx(report.trace.peak_live_bytes / MiB, rel=1e-6)
    assert "tfmem · tb fit" in texts["tfmem/report"]


def test_the_profile_tab_opens_our_cpu_trace(traced):
    report, xspaces, written = traced
    xprof = pytest.importorskip("xprof.convert.raw_to_tool_data")
    assert len(written.xplanes) == len(xspaces) >= 1
    assert all(p.parent.parent.name == "profile" and p.name.endswith(".xplane.pb") for p in written.xplanes)
    peaks = []
    for path in written.xplanes:  # one "host" per traced segment
        data, _ = xprof.xspace_to_tool_data([str(path)], "memory_profile", {})
        allocators = json.loads(data)["memoryProfilePerAllocator"]
        assert report.trace.allocator in allocators, list(allocators)
        peaks.append(int(allocators[report.trace.allocator]["profileSummary"]["peakStats"]["peakBytesInUse"]))
    # xprof reads the same allocator events: its peak is the trace's, to the byte
    assert max(peaks) == report.trace.peak_live_bytes


def test_the_magic_writes_the_logdir_and_says_where(shell, tmp_path):
    shell.run_cell("import numpy as np, keras")
    result = shell.run_cell(f"%%tfmem --tensorboard {tmp_path / 'logs'} --label 'magic run'\n"
                            "keras.ops.sum(keras.ops.ones((512, 512)) * 2)")
    assert result.error_in_exec is None
    runs = list((tmp_path / "logs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("magic_run-")
    assert list(runs[0].glob("plugins/profile/*/*.xplane.pb")) and list(runs[0].glob("events.out.tfevents*"))


def test_a_file_for_a_logdir_is_refused_before_the_cell_runs(shell, tmp_path):
    target = tmp_path / "not_a_dir"
    target.write_text("x")
    shell.run_cell("ran = False")
    result = shell.run_cell(f"%%tfmem --tensorboard {target}\nran = True")
    error = result.error_in_exec or result.error_before_exec
    assert error is not None and "is a file: give a folder" in str(error)
    assert shell.user_ns["ran"] is False


def test_a_saved_report_gets_scalars_and_says_the_trace_is_not_kept(traced, tmp_path, capsys):
    report, _, _ = traced
    saved = report.save(tmp_path / "r.json")
    assert cli.main(["show", str(saved), "--tensorboard", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "TensorBoard:" in out and "the trace's XSpace was not kept" in out
    run = next((tmp_path / "logs").iterdir())
    scalars, _ = scalars_and_text(run)
    assert "tfmem/rss_MiB" in scalars and not list(run.glob("plugins/profile/*/*.xplane.pb"))
