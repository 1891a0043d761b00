"""The report's JSON Schema: the file the package ships is the one the dataclasses make, it accepts a full report,
and it refuses what a reader in another language would choke on. (Every report the suite publishes is validated
against it by an autouse fixture in tests/conftest.py.)"""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator

from tfmem_magic.core.report import (
    CallRecord,
    DeviceMemory,
    Finding,
    HeldInfo,
    Holder,
    LiveGroup,
    ModelInfo,
    Report,
    TraceInfo,
)
from tfmem_magic.core.schema import SCHEMA_FILE, report_schema, shipped_schema


def full_report() -> Report:
    r = Report(
        label="x",
        tf={"CPU:0": DeviceMemory(1, 2, 3, samples=[[0.0, 2.0]])},
        trace=TraceInfo(events=3, at_peak=[LiveGroup(op="MatMul", bytes=4)], held_at_end=[LiveGroup(bytes=1)]),
        model=ModelInfo(name="m", params=1, optimizers=["d_optimizer: Adam"]),
        findings=[Finding("leak-growth", "t", "warn", "e", 5, ["clear-session"], ["models"])],
        held=HeldInfo(left_bytes=-4, holders=[Holder("models", "list", 9, models=["m"], paths=["models[0]"])]),
        calls=[CallRecord("fit", "m", 0.1, 0.2, None, 7, 8, 9)],
    )
    return Report.from_dict(json.loads(r.to_json()))


def test_the_shipped_schema_is_the_one_the_dataclasses_make():
    """Changed a report dataclass? Run `python -m tfmem_magic.core.schema > tfmem_magic/report.schema.json`."""
    assert shipped_schema() == report_schema(), f"{SCHEMA_FILE} is out of date"


def test_a_full_report_is_valid_and_wrong_types_or_unknown_keys_are_not():
    validator = Draft202012Validator(shipped_schema())
    data = full_report().to_dict()
    assert list(validator.iter_errors(data)) == []
    wrong = json.loads(json.dumps(data))
    wrong["tf"]["CPU:0"]["peak_bytes"] = 2.5  # bytes are integers
    wrong["held"]["holders"][0]["extra"] = 1  # a key the schema does not list
    wrong["status"] = None
    paths = sorted("/".join(map(str, e.path)) for e in validator.iter_errors(wrong))
    assert paths == ["held", "status", "tf/CPU:0/peak_bytes"], paths  # (held: none of its anyOf matches)
