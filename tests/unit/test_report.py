import json

import pytest

from tfmem_magic.core.report import (
    SCHEMA,
    DeviceMemory,
    EnvInfo,
    Finding,
    LiveGroup,
    ModelInfo,
    Report,
    RssInfo,
    TraceInfo,
)


def sample_report() -> Report:
    return Report(
        label="cell",
        status="ok",
        mode="trace",
        wall_s=1.5,
        env=EnvInfo(allocator="bfc", budget_bytes=10),
        rss=RssInfo(1, 3, 2, "hwm", [[0.0, 1], [0.1, 3]]),
        tf={"CPU:0": DeviceMemory(100, 400, 150)},
        trace=TraceInfo(
            events=3,
            peak_live_bytes=400,
            at_peak=[LiveGroup(op="MatMul", layer="d", phase="forward", bytes=300, requested_bytes=256, count=1)],
        ),
        model=ModelInfo(name="m", params=5),
        findings=[Finding("oom", "t", "critical", "e", 5)],
    )


def test_round_trip_through_json():
    report = sample_report()
    data = json.loads(report.to_json())
    assert data["schema"] == SCHEMA and list(data)[0] == "schema"
    again = Report.from_json(report.to_json())
    assert again == report
    assert isinstance(again.trace.at_peak[0], LiveGroup) and isinstance(again.tf["CPU:0"], DeviceMemory)


def test_contract_keys_present():
    data = sample_report().to_dict()
    for key in (
        "schema",
        "label",
        "status",
        "error",
        "mode",
        "wall_s",
        "env",
        "rss",
        "tf",
        "trace",
        "model",
        "findings",
        "fixes",
        "prediction",
    ):
        assert key in data
    for key in (
        "tensorflow",
        "keras",
        "python",
        "platform",
        "allocator",
        "allocator_complete",
        "devices",
        "ram_total_bytes",
        "budget_bytes",
        "budget_source",
        "mixed_precision_policy",
    ):
        assert key in data["env"]
    for key in (
        "events",
        "peak_live_bytes",
        "peak_requested_bytes",
        "peak_time_s",
        "timeline",
        "preexisting_bytes",
        "at_peak",
        "by_layer",
        "by_op",
    ):
        assert key in data["trace"]


def test_tf_peak_is_over_the_baseline():
    assert sample_report().tf_peak_bytes == 300


def test_wrong_schema_is_refused():
    with pytest.raises(ValueError, match="tfmem.report/1"):
        Report.from_dict({"schema": "other/9"})


def test_save_and_load(tmp_path):
    path = sample_report().save(tmp_path / "r.json")
    assert Report.load(path) == sample_report()


def test_one_decision_of_the_main_device():
    """The device the report is about: the first GPU where there is one (where a user trains), else CPU:0."""
    from tfmem_magic.core.report import main_device_name

    assert main_device_name(["CPU:0", "GPU:1", "GPU:0"]) == "GPU:0"
    assert main_device_name(["CPU:0"]) == "CPU:0"
    assert main_device_name(["TPU:0"]) == "TPU:0"
    assert main_device_name([]) is None
    report = Report(tf={"CPU:0": DeviceMemory(0, 10, 0), "GPU:0": DeviceMemory(0, 99, 0)})
    assert report.main_device.peak_bytes == 99
