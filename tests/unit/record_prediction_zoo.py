"""Record the prediction zoo that tests/unit/test_prediction_zoo.py checks: its reports and their answers.

    TFMEM_DUMP_REPORTS=/tmp/zoo .venv/bin/python -m pytest -p no:cacheprovider tests/integration/...
    .venv/bin/python tests/unit/record_prediction_zoo.py /tmp/zoo
    .venv/bin/python tests/unit/record_prediction_zoo.py --answers   # the same reports, their answers again

The first line writes every report the tests made as JSON (tests/conftest.py). This script keeps those with a model
or a what-if basis, one per kind of cell (model, batch, basis, trace or not, pre-flight, status, precision and
optimizer), and adds the kinds of basis no such run leaves in this process: a measured basis (its replay failed, or
none ran, or after an OOM), the model's own step replayed, a call the pre-flight refused (the recorded CNN replay of
test_preflight_arithmetic.py, with a clone's probes and with the model's own step), a saved GPU trace
(tests/data/gpu_multi_worker_bert.xplane.pb.gz) and a CPU one, a GPU cell, an OOM, a cell without allocator
statistics, replicas, and the step's other moments below the batch. Each report is stored gzipped under
tests/data/prediction_zoo/, and what the advice makes of it (test_prediction_zoo.answers) in expected.json.gz.
Recording replaces every file there."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from test_fixes import report as fixes_report  # noqa: E402
from test_prediction_zoo import EXPECTED, ZOO, answers, load, names  # noqa: E402
from test_preflight_arithmetic import _refused  # noqa: E402

import tfmem_magic  # noqa: E402
from tfmem_magic.advise import prediction, preflight  # noqa: E402
from tfmem_magic.core.report import Report  # noqa: E402

PUBLIC = HERE.parent / "data" / "gpu_multi_worker_bert.xplane.pb.gz"


def usable(report: Report) -> bool:
    if report.whatif_basis is not None:
        return True
    try:
        prediction.predict(report)
    except prediction.TfmemUsageError:
        return False
    return True


def signature(report: Report) -> tuple:
    """What tells two cells apart for the prediction: reports alike in all of it are kept once."""
    basis = report.whatif_basis or prediction.analytic_basis(report)
    model = report.model
    return (
        model.name if model else None,
        repr(basis.knobs),
        basis.name,
        basis.replay.source if basis.replay else None,
        basis.slope_source,
        basis.activations_per_sample_below is not None,
        basis.measured_peak is None,
        bool(report.trace and report.trace.events),
        report.preflight.verdict if report.preflight else None,
        report.status,
    )


def dumped(folder: Path) -> dict[str, Report]:
    kept: dict[tuple, tuple[str, Report]] = {}
    for path in sorted(folder.glob("*.json")):
        report = Report.from_json(path.read_text())
        if usable(report):
            kept.setdefault(signature(report), (path.stem, report))
    out = {}
    for stem, report in kept.values():
        basis = report.whatif_basis or prediction.analytic_basis(report)
        model = report.model.name if report.model else "trace"
        out[f"{basis.name}-{model}-{basis.knobs.batch_size}-{stem[:8]}"] = report
    return out


def recorded_unit_report() -> Report:
    return Report.from_json((HERE / "recorded" / "copy_made_while_untraced.json").read_text())


def calibrated(source: Report) -> dict[str, Report]:
    """The kinds calibration makes that no dumped report holds, from a report calibrated on a clone's replay."""
    base = source.whatif_basis
    assert base is not None and base.name == "replay" and base.replay is not None and base.replay.passed
    analytic = prediction.analytic_basis(source)
    failed = replace(
        base.replay,
        passed=False,
        peaks=[],
        second_peaks=[],
        region_peaks=[],
        batches=[],
        why_not="probe 23's own sequence replayed to +4.0% of its traced peak",
    )
    bases = {
        "measured-failed-replay": replace(base, name="measured", replay=failed),
        "measured-no-replay": replace(base, name="measured", replay=None),
        "own-step-train": replace(
            analytic,
            name="replay",
            replay=replace(base.replay, source="step"),
            slope_source="GAN.train_step, replayed",
            calibration={"step": "GAN.train_step", "seconds": 9.6},
        ),
        "own-step-test": replace(
            analytic,
            name="replay",
            replay=replace(base.replay, source="step"),
            slope_source="Distiller.test_step, replayed",
            calibration={"step": "Distiller.test_step", "seconds": 4.2},
        ),
    }
    out = {}
    for name, basis in bases.items():
        report = copy.deepcopy(source)
        report.whatif_basis = basis
        report.prediction = prediction.summary(report)
        out[name] = report
    moments = copy.deepcopy(out["own-step-train"])  # a recurrent model's own step: the trace's other moments
    assert moments.whatif_basis is not None
    slope = moments.whatif_basis.activations_per_sample
    micro = moments.whatif_basis.knobs.batch_size / moments.whatif_basis.knobs.split
    moments.whatif_basis.lines_below = [[0.25 * slope, 0.1 * slope * micro]]
    out["own-step-moments-below"] = moments
    trace = copy.deepcopy(source)  # a saved trace's basis on a CPU whose process was measured: no process margin
    trace.model = None
    trace.whatif_basis = replace(base, replay=replace(base.replay, source="trace", scaled=40))
    trace.prediction = prediction.summary(trace)
    out["from-trace-cpu"] = trace
    oom = copy.deepcopy(source)
    oom.status = "oom"
    oom.whatif_basis = replace(base, name="measured", replay=None, measured_peak=None)
    oom.prediction = prediction.summary(oom)
    out["measured-after-oom"] = oom
    return out


def refused() -> dict[str, Report]:
    """A call refused on the pre-flight's replay (a clone's probes), and the same refused on the model's own step."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        _, report = _refused(mp)
    report.whatif_basis = preflight.refused_basis(report, prediction.analytic_basis(report))
    report.prediction = prediction.summary(report)
    out["preflight-refused-clone"] = report
    own = copy.deepcopy(report)
    assert own.preflight is not None and own.preflight.replay is not None
    own.preflight.own_step = "GAN.train_step"
    own.preflight.replay = replace(own.preflight.replay, source="step")
    own.whatif_basis = preflight.refused_basis(own, prediction.analytic_basis(own))
    own.prediction = prediction.summary(own)
    out["preflight-refused-own-step"] = own
    unmeasured = copy.deepcopy(report)  # the process was not measured: the report's budget, not the pre-flight's
    unmeasured.rss = replace(unmeasured.rss, peak_bytes=0)
    out["preflight-refused-no-rss"] = unmeasured
    gpu = copy.deepcopy(report)  # on a GPU: its budget is the device's
    gpu.tf = {"GPU:0": gpu.tf["CPU:0"]}
    gpu.env.devices = ["GPU:0"]
    out["preflight-refused-gpu"] = gpu
    return out


def made() -> dict[str, Report]:
    """Cells no test run leaves: a GPU's, an OOM, one whose TF allocator was not measured."""
    out = {}
    unmeasured = fixes_report()
    unmeasured.tf = {}  # no allocator statistics: no peak to anchor on
    for name, report in (
        ("analytic-gpu", fixes_report(devices=("GPU:0",))),
        ("analytic-oom", fixes_report(status="oom")),
        ("analytic-bf16", fixes_report(policy="mixed_bfloat16", batch=64)),
        ("analytic-unmeasured", unmeasured),
    ):
        report.whatif_basis = prediction.analytic_basis(report)
        report.prediction = prediction.summary(report)
        out[name] = report
    return out


def with_replicas(source: Report) -> Report:
    report = copy.deepcopy(source)
    assert report.model is not None
    report.model.replicas = 2
    report.whatif_basis = prediction.analytic_basis(report)
    report.prediction = prediction.summary(report)
    return report


def with_moments_below(source: Report) -> Report:
    """The analytic basis with another moment of the step whose line is higher below the batch, and a slope that is
    the cell's whole peak (a trace that stopped before it)."""
    report = copy.deepcopy(source)
    basis = prediction.analytic_basis(report)
    micro = basis.knobs.batch_size / basis.knobs.split
    gap = 0.1 * basis.activations_per_sample * micro
    report.whatif_basis = replace(
        basis,
        lines_below=[[0.25 * basis.activations_per_sample, gap]],
        slope_source=prediction.UPPER_BOUND_SOURCE,
    )
    report.prediction = prediction.summary(report)
    return report


def main(folder: Path) -> None:
    zoo = dumped(folder)
    replays = [r for r in zoo.values() if r.whatif_basis is not None and r.whatif_basis.name == "replay"]
    analytic = [r for n, r in sorted(zoo.items()) if n.startswith("analytic-") and r.model and r.model.batch_size]
    zoo.update(calibrated(replays[0]))
    zoo.update(refused())
    zoo.update(made())
    zoo["analytic-replicas"] = with_replicas(analytic[0])
    zoo["analytic-moments-below"] = with_moments_below(analytic[-1])
    zoo["analytic-recorded-unit"] = recorded_unit_report()
    zoo["from-trace-gpu"] = tfmem_magic.analyze_xplane(PUBLIC)
    ZOO.mkdir(parents=True, exist_ok=True)
    for old in ZOO.glob("*.json.gz"):
        old.unlink()
    for name, report in sorted(zoo.items()):
        (ZOO / f"{name}.json.gz").write_bytes(gzip.compress(report.to_json().encode(), mtime=0))
    record_answers(sorted(zoo))


def record_answers(names: list[str]) -> None:
    """What the advice makes of each stored report, into expected.json.gz (a change that means to change answers
    records them again on the same reports)."""
    expected = {name: answers(load(name)) for name in names}
    text = json.dumps(expected, sort_keys=True, indent=1)
    EXPECTED.write_bytes(gzip.compress(text.encode(), mtime=0))
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    size = sum(p.stat().st_size for p in ZOO.glob("*.json.gz"))
    print(f"{len(names)} reports, {sum(len(a) for a in expected.values())} answers ({digest}), {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    if sys.argv[1:] == ["--answers"]:
        record_answers(names())
    else:
        main(Path(sys.argv[1]))
