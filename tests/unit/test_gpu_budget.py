"""On a GPU the report talks about the GPU: its device, its budget (the allocator's limit), its verdict; after an
out-of-memory error the batch only ever shrinks. Hand-built reports: no GPU needed."""

from __future__ import annotations

import pytest
from test_fixes import ctx, report  # noqa: I001  (tests/unit is on sys.path for its own helpers)

from tfmem_magic.advise import diagnose, fixes
from tfmem_magic.advise.prediction import budget_for_tf
from tfmem_magic.analyze.modelinfo import _optimizer_name
from tfmem_magic.core.report import DeviceMemory, main_device_name
from tfmem_magic.measure.environment import local_device_name
from tfmem_magic.measure.xplane import allocator_device
from tfmem_magic.show.view import summary_items, verdict, verdict_level

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize(
    ("name", "device"),
    [
        ("GPU_0_bfc", "GPU:0"),
        ("GPU_12_bfc", "GPU:12"),
        ("bfc_cpu_allocator_for_gpu", "CPU:0"),
        ("mklcpu", "CPU:0"),
        ("gpu_host_bfc", None),
        ("cuda_host_bfc", None),
        ("xla_vendor_allocator", None),
    ],
)
def test_an_allocators_device_comes_from_its_name(name, device):
    assert allocator_device(name) == device


@pytest.mark.parametrize(
    ("name", "local"),
    [
        ("/device:CPU:0", "CPU:0"),
        ("/job:worker/replica:0/task:1/device:GPU:3", "GPU:3"),
        ("CPU:0", "CPU:0"),
    ],
)
def test_a_distributed_workers_device_names_are_its_local_ones(name, local):
    assert local_device_name(name) == local  # MultiWorkerMirroredStrategy names devices with the task


def test_the_main_device_is_a_gpu_the_busiest_of_several():
    assert main_device_name(["CPU:0", "GPU:2", "GPU:10"]) == "GPU:2"  # names only (the sampler): the first GPU
    figures = {"CPU:0": DeviceMemory(0, 9 * GiB), "GPU:0": DeviceMemory(0, 1 * GiB), "GPU:1": DeviceMemory(0, 3 * GiB)}
    assert main_device_name(figures) == "GPU:1"
    assert main_device_name(["CPU:0"]) == "CPU:0" and main_device_name([]) is None


def gpu_report(peak: int, limit: int | None, status: str = "ok", baseline: int = 1 * GiB):
    rep = report(devices=("CPU:0", "GPU:0"), status=status)
    rep.tf = {"CPU:0": DeviceMemory(0, 50 * MiB, 10 * MiB), "GPU:0": DeviceMemory(baseline, peak, baseline)}
    rep.env.budget_bytes = 24 * GiB  # a large host: not the GPU's budget
    if limit:
        rep.env.device_limit_bytes = {"GPU:0": limit}
    return rep


def test_the_budget_is_the_gpus_own_limit():
    rep = gpu_report(peak=13 * GiB, limit=14 * GiB)
    assert rep.device_budget == ("GPU:0", 14 * GiB)
    assert budget_for_tf(rep) == 13 * GiB  # the limit minus what the GPU held before the cell
    assert verdict(rep) == "used 93% of GPU:0's 14 GiB"
    found = {f.id: f for f in diagnose.findings(rep)}
    assert found["near-budget"].title == "TensorFlow used 93% of GPU:0's memory"
    assert ("GPU:0 left", "1 GiB", "of 14 GiB (TensorFlow's allocator limit on GPU:0)") in summary_items(rep)
    assert verdict_level(gpu_report(peak=15 * GiB, limit=14 * GiB)) == "bad"


def test_a_gpu_whose_limit_is_unknown_has_no_budget_rather_than_the_hosts():
    rep = gpu_report(peak=13 * GiB, limit=None)
    assert rep.device_budget is None and budget_for_tf(rep) is None
    assert "shrink-batch" not in {f.id for f in fixes.build(rep, ctx())}  # no budget to size a batch against


def test_after_an_oom_the_batch_only_shrinks():
    # a GPU OOM whose budget the model thinks is ample: the old rule proposed a larger batch here
    rep = gpu_report(peak=2 * GiB, limit=14 * GiB, status="oom")
    found = {f.id: f for f in fixes.build(rep, ctx())}
    fix = found["shrink-batch"]
    assert fix.title == "Shrink the batch to 128" and "half the batch" in fix.why
    assert "batch_size=128" in fix.code


def test_a_loss_scale_optimizer_is_named_by_the_optimizer_it_wraps():
    class Adam:
        pass

    class LossScaleOptimizer:
        inner_optimizer = Adam()

    assert _optimizer_name(LossScaleOptimizer()) == "Adam" and _optimizer_name(Adam()) == "Adam"
    assert _optimizer_name(None) is None


def test_the_gpu_cap_is_sized_from_the_measured_peak():
    rep = gpu_report(peak=int(5.1 * GiB), limit=14 * GiB, status="oom")
    fix = fixes.gpu_memory_limit(rep, ctx())
    assert "memory_limit=6656" in fix.code  # 5.1 GiB x 1.25 = 6528 MiB, up to a multiple of 512
    assert "gpus[0]" in fix.code and "6656 MiB" in fix.why


def test_near_its_limit_the_gpu_cap_stays_below_what_the_gpu_has():
    rep = gpu_report(peak=13 * GiB, limit=int(14.4 * GiB), status="oom")
    fix = fixes.gpu_memory_limit(rep, ctx())
    assert "memory_limit=12800" in fix.code  # 90% of 14.4 GiB (13271 MiB) down to 512s; not 16896


def test_only_an_oom_halves_a_batch_the_model_thinks_fits():
    rep = gpu_report(peak=2 * GiB, limit=14 * GiB, status="error")  # a cell that raised something else
    assert "shrink-batch" not in {f.id for f in fixes.build(rep, ctx())}


def test_the_busiest_gpu_is_the_one_that_grew_not_the_one_holding_old_memory():
    figures = {"GPU:0": DeviceMemory(10 * GiB, 10 * GiB), "GPU:1": DeviceMemory(1 * GiB, 3 * GiB)}
    assert main_device_name(figures) == "GPU:1"


def test_a_gpu_oom_message_gives_its_request():
    from tfmem_magic.measure.guard import parse_oom

    message = (
        "OOM when allocating tensor with shape[32,512,56,56] and type half on "
        "/job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc\n"
        "\t [[{{node model/conv2d/Conv2D}}]]"
    )
    assert parse_oom(message) == {
        "shape": "[32,512,56,56]",
        "dtype": "float16",
        "bytes": 32 * 512 * 56 * 56 * 2,
        "device": "GPU:1",
        "allocator": "GPU_1_bfc",
        "op": "model/conv2d/Conv2D",
    }


def test_an_allocators_series_is_downsampled_with_its_peak_kept():
    import numpy as np

    from tfmem_magic.measure.xplane import _points

    t = np.arange(1000, dtype=np.int64)[::-1] * 10**9  # out of order, as several lines' events are
    live = np.arange(1000, dtype=np.int64) % 97 * 1000
    live[423] = 10**9
    points = _points(t, live, most=50)
    assert len(points) <= 51 and [p[0] for p in points] == sorted(p[0] for p in points)
    assert max(p[1] for p in points) == 10**9 and [0.576, 10**9] in points  # t of event 423: (999 - 423) ms


def test_in_quick_mode_a_gpu_reports_verdict_says_which_memory_it_is_about():
    rep = gpu_report(peak=13 * GiB, limit=None)  # quick mode: TensorFlow told no GPU limit
    rep.rss.peak_bytes = 2 * GiB
    assert verdict(rep) == (
        "process memory fits with 22 GiB to spare (available RAM); GPU:0's limit was not recorded (a trace records it)"
    )
    rep.status = "error"
    assert verdict(rep).startswith("raised an error; process memory fits with")
    assert verdict(gpu_report(peak=13 * GiB, limit=14 * GiB)) == "used 93% of GPU:0's 14 GiB"  # traced: the GPU's


def test_on_a_gpu_the_guards_layers_say_they_watch_host_memory():
    from tfmem_magic.analyze.build import guard_layers, oom_tripped_by

    assert guard_layers(False, allocator_capped=True, batch_end_armed=True) == [
        "allocator",
        "batch-end check",
        "watchdog",
    ]
    assert guard_layers(True, allocator_capped=True, batch_end_armed=True) == [
        "allocator (CPU only)",
        "batch-end check (host memory)",
        "watchdog (host memory)",
    ]
    request = {"shape": "[32,512,56,56]", "dtype": "float16", "bytes": 1, "device": "GPU:1", "allocator": "GPU_1_bfc"}
    assert oom_tripped_by(request) == "GPU_1_bfc allocator (the GPU's own memory)"
    assert oom_tripped_by({**request, "device": "CPU:0", "allocator": "mklcpu"}) == "allocator"


def test_a_gpu_oom_is_not_blamed_on_tfmems_guard():
    from tfmem_magic.core.report import ErrorInfo, GuardInfo

    rep = gpu_report(peak=14 * GiB, limit=14 * GiB, status="oom")
    rep.error = ErrorInfo(
        type="ResourceExhaustedError",
        message="OOM",
        request={
            "shape": "[32,512,56,56]",
            "dtype": "float16",
            "bytes": 32 * 512 * 56 * 56 * 2,
            "device": "GPU:0",
            "allocator": "GPU_0_bfc",
            "op": None,
        },
    )
    rep.guard = GuardInfo(
        20 * GiB, "--limit", ["watchdog (host memory)"], None, "GPU_0_bfc allocator (the GPU's own memory)", None
    )
    text = " ".join(f.evidence for f in diagnose.findings(rep))
    assert "on GPU:0" in text and "tfmem's" not in text


def test_the_what_if_and_large_batch_judge_against_the_gpus_budget():
    from tfmem_magic.advise.prediction import predict

    rep = gpu_report(peak=13 * GiB, limit=14 * GiB)
    what = predict(rep, batch_size=512)
    assert what.budget_bytes == 13 * GiB  # the GPU's limit less what it held before: not the 24 GiB host
    assert what.fits is False  # its upper estimate (peak plus the band) is over the GPU's 13 GiB
    small = gpu_report(peak=int(1.1 * GiB), limit=14 * GiB, baseline=1 * GiB)  # 100 MiB on a 14 GiB GPU
    assert predict(small, batch_size=512).fits is True


def test_the_panels_details_show_the_gpus_budget_beside_the_hosts():
    pytest.importorskip("ipywidgets")
    from tfmem_magic.show.panel import details_tab
    from tfmem_magic.show.view import view_of

    rep = gpu_report(peak=13 * GiB, limit=14 * GiB)
    html = details_tab(rep, view_of(rep, whatifs=[])).value
    assert "<th>GPU:0 budget</th><td>14 GiB (TensorFlow&#x27;s allocator limit)</td>" in html, html[:600]
    assert "<th>Host budget</th><td>24 GiB" in html
    cpu = report()
    assert "<th>Budget</th><td>500 MiB" in details_tab(cpu, view_of(cpu, whatifs=[])).value
