"""Reports written for TensorBoard, read back the way TensorBoard reads them: its event reader for the scalars and
the text, and xprof's converter (what the Profile tab runs) for the trace's memory profile."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fresh import fresh_env

import tfmem_magic
from tfmem_magic.adapters import cli
from tfmem_magic.analyze import saved_trace

pytest.importorskip("tensorboard")
pytestmark = pytest.mark.slow
MiB = 2**20
ROOT = Path(__file__).parent.parent.parent
# a multi-worker BERT training trace recorded on V100s (tests/data/NOTICE)
PUBLIC = ROOT / "tests" / "data" / "gpu_multi_worker_bert.xplane.pb.gz"


def fit_small(batch: int = 64) -> None:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(1024, activation="relu", name="wide"),
            keras.layers.Dense(10, name="head"),
        ],
        name="tb_mlp",
    )
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
    for path in written.xplanes:  # one "host" per traced segment (under load a later one can hold no allocation)
        data, _ = xprof.xspace_to_tool_data([str(path)], "memory_profile", {})
        allocators = json.loads(data)["memoryProfilePerAllocator"]
        if not allocators:
            continue
        assert report.trace.allocator in allocators, list(allocators)
        peaks.append(int(allocators[report.trace.allocator]["profileSummary"]["peakStats"]["peakBytesInUse"]))
    # xprof reads the same allocator events: its peak is the trace's, to the byte
    assert max(peaks) == report.trace.peak_live_bytes


def test_the_magic_writes_the_logdir_and_says_where(shell, tmp_path):
    shell.run_cell("import numpy as np, keras")
    result = shell.run_cell(
        f"%%tfmem --tensorboard {tmp_path / 'logs'} --label 'magic run'\nkeras.ops.sum(keras.ops.ones((512, 512)) * 2)"
    )
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


def test_a_saved_trace_shown_with_tensorboard_goes_along_for_the_profile_tab(tmp_path, capsys):
    """`tfmem show X.xplane.pb.gz --tensorboard LOGDIR` writes the trace it read, ungzipped, where the Profile tab
    looks (named after the file, the host it came from), and xprof reads the same GPU peak from it."""
    original = tfmem_magic.analyze_xplane(PUBLIC)
    assert cli.main(["show", str(PUBLIC), "--tensorboard", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "trace for the Profile tab: 1 XSpace file(s)" in out and "was not kept" not in out
    (run,) = (tmp_path / "logs").iterdir()
    (written,) = run.glob("plugins/profile/*/*.xplane.pb")
    assert written.name == "gpu_multi_worker_bert.xplane.pb"
    assert written.read_bytes() == gzip.decompress(PUBLIC.read_bytes())
    scalars, texts = scalars_and_text(run)
    assert max(v for _, v in scalars["tfmem/traced_live_MiB"]) == pytest.approx(
        original.trace.peak_live_bytes / MiB, rel=1e-6
    )
    assert "GPU:6" in texts["tfmem/report"]
    xprof = pytest.importorskip("xprof.convert.raw_to_tool_data")
    data, _ = xprof.xspace_to_tool_data([str(written)], "memory_profile", {})
    summary = json.loads(data)["memoryProfilePerAllocator"]["GPU_6_bfc"]["profileSummary"]
    assert int(summary["peakStats"]["peakBytesInUse"]) == original.main_device.peak_bytes


def test_a_logdir_tfmem_wrote_reads_back_with_the_same_peak(tmp_path, capsys):
    """The reverse direction on our own output: `tfmem show LOGDIR/<run>/plugins/profile/<session>` of a logdir that
    `tfmem show --tensorboard` wrote gives the report of the trace it started from."""
    original = tfmem_magic.analyze_xplane(PUBLIC)
    assert cli.main(["show", str(PUBLIC), "--tensorboard", str(tmp_path / "logs")]) == 0
    (session,) = (tmp_path / "logs").glob("*/plugins/profile/*")
    capsys.readouterr()
    assert cli.main(["show", str(session)]) == 0
    out = capsys.readouterr().out
    assert "gpu_multi_worker_bert.xplane.pb" in out and "fits GPU:6" in out
    (file,) = session.glob("*.xplane.pb")
    again = tfmem_magic.analyze_xplane(file)  # what `tfmem show` printed, as an object
    assert again.main_device_name == original.main_device_name == "GPU:6"
    assert (
        again.tf_peak_bytes == original.tf_peak_bytes
        and again.main_device.peak_bytes == original.main_device.peak_bytes
    )
    assert again.trace.peak_live_bytes == original.trace.peak_live_bytes
    assert [(g.op, g.bytes) for g in again.trace.at_peak] == [(g.op, g.bytes) for g in original.trace.at_peak]


def test_our_own_cpu_trace_reads_back_from_the_logdir_with_the_traced_peak(traced, capsys):
    """A traced fit written with to_tensorboard, read back with `tfmem show` from its Profile folder: its segments'
    peak is the report's traced peak, to the byte."""
    report, xspaces, written = traced
    (session,) = written.run_dir.glob("plugins/profile/*")
    assert cli.main(["show", str(session)]) == 0
    out = capsys.readouterr().out
    # one report per segment, as printed; a segment that recorded no allocation (under load) is named as skipped
    back = []
    for path in written.xplanes:
        assert path.name in out
        try:
            back.append(tfmem_magic.analyze_xplane(path))
        except saved_trace.NoMemoryEvents:
            assert f"{path.name}: no memory events" in out
    assert back
    assert {r.trace.allocator for r in back} == {report.trace.allocator}
    assert max(r.trace.peak_live_bytes for r in back) == report.trace.peak_live_bytes
    assert max(r.main_device.peak_bytes for r in back) == report.trace.peak_live_bytes


def test_to_tensorboard_is_a_function_over_the_report_not_a_method(traced, tmp_path):
    """docs/tensorboard.md says why: the Report is the core's plain data (no method of it may reach the show layer)
    and it keeps no raw trace. Given only the report, the trace is not written and the note says how to pass it."""
    report, _, _ = traced
    assert not hasattr(report, "to_tensorboard")
    written = tfmem_magic.to_tensorboard(report, tmp_path)
    assert written.events and written.xplanes == []
    assert "to_tensorboard(p.report, LOGDIR, p.xspaces)" in written.note


def readme_section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    end = re.search(r"\n#{1,3} ", text[start + len(heading) + 2 :])
    return text[start : start + len(heading) + 2 + (end.start() if end else len(text))]


@pytest.mark.parametrize("heading", ["### TensorBoard", "### In scripts and long training: the Keras callback"])
def test_the_readme_examples_run_as_pasted(heading, tmp_path):
    """Every plain Python block of the README's section runs as pasted, in a fresh interpreter (notebook cells, the
    ones starting with `%%`, are the magic's: the magic's own tests run them)."""
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", readme_section(heading), re.S) if not b.lstrip().startswith("%")
    ]
    assert blocks, heading
    # as a user's script starts: none of this process's allocator settings (conftest's prepare())
    env = fresh_env()
    for block in blocks:
        out = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        assert out.returncode == 0, f"{heading}:\n{block}\n{out.stderr[-3000:]}"
        assert "MemoryMonitor:" not in out.stderr, out.stderr[-3000:]  # e.g. "statistics are incomplete"
    assert list(tmp_path.glob("logs/**/events.out.tfevents*"))  # both examples write a TensorBoard logdir
