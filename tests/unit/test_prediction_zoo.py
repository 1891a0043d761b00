"""The prediction zoo: reports of every basis kind (tests/data/prediction_zoo/: analytic with and without a trace,
measured, a clone's replay, a model's own step replayed, a refused call's pre-flight replay, a saved GPU trace) and
what the advice made of each over a grid of knobs, recorded by tests/unit/record_prediction_zoo.py. Each answer
must come back identical in its JSON form: a change to how predictions are organised changes no prediction, no
band, no note. A change that means to change them records the zoo again and says so."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import pytest

from tfmem_magic.advise import bases, calibration, diagnose_model, prediction, preflight
from tfmem_magic.core.report import Report
from tfmem_magic.core.types import ParsedJSON
from tfmem_magic.show import render, view

ZOO = Path(__file__).parents[1] / "data" / "prediction_zoo"
EXPECTED = ZOO / "expected.json.gz"
MAX_BATCH = 1 << 20


def load(name: str) -> Report:
    return Report.from_json(gzip.decompress((ZOO / f"{name}.json.gz").read_bytes()).decode())


def names() -> list[str]:
    return sorted(p.name[: -len(".json.gz")] for p in ZOO.glob("*.json.gz") if p != EXPECTED)


def knob_grid(report: Report) -> list[dict[str, Any]]:
    """The knobs each report is asked at: batches on both sides of the cell's, every other knob alone and combined,
    budgets given, and knobs `predict` refuses (their message is the answer)."""
    basis = report.whatif_basis
    batch = basis.knobs.batch_size if basis is not None else (report.model.batch_size if report.model else 1) or 1
    peak = (basis.measured_peak if basis is not None else None) or report.tf_peak_bytes or 1 << 20
    batches = {1, 2, batch // 4, batch // 2, batch - 1, batch, batch + 1, 2 * batch, 3 * batch, 4 * batch, 16 * batch}
    grid: list[dict[str, Any]] = [{}]
    grid += [{"batch_size": b} for b in sorted(b for b in batches if 1 <= b <= MAX_BATCH)]
    grid += [{"batch_size": 1000 * batch}, {"batch_size": 0}, {"batch_size": MAX_BATCH + 1}]
    grid += [{"tf_budget": 2 * peak}, {"tf_budget": 2 * peak, "batch_size": 4 * batch}, {"tf_budget": 1 << 20}]
    grid += [{"tf_budget": 1 << 40}, {"tf_budget": peak, "batch_size": max(1, batch // 2)}]
    if report.model is None:  # a saved trace's: the batch is its only knob, the others are refused
        return grid + [{"policy": "mixed_float16"}, {"optimizer": "sgd"}, {"replicas": 2}, {"input_scale": 2.0}]
    for policy in ("float32", "mixed_bfloat16", "mixed_float16", "float64", "int8"):
        grid += [{"policy": policy}, {"policy": policy, "batch_size": 2 * batch}]
        grid += [{"policy": policy, "batch_size": max(1, batch // 2)}]
    for optimizer in ("sgd", "SGD+momentum", "adam", "rmsprop", "lion", "foo"):
        grid += [{"optimizer": optimizer}, {"optimizer": optimizer, "batch_size": 2 * batch}]
    grid += [{"accumulation_steps": 2}, {"accumulation_steps": 2, "batch_size": 2 * batch}]
    grid += [{"accumulation_steps": 4, "batch_size": 4 * batch}, {"accumulation_steps": batch + 1}]
    grid += [{"input_scale": s} for s in (2.0, 0.5, 1.5, 0.01)]
    grid += [{"input_scale": 2.0, "batch_size": 2 * batch}, {"input_scale": 0.5, "batch_size": max(1, batch // 2)}]
    grid += [{"replicas": 2}, {"replicas": 2, "batch_size": 2 * batch}, {"replicas": 3, "batch_size": 3 * batch}]
    grid += [
        {"replicas": 1},
        {"replicas": batch + 1},
        {"replicas": 2, "accumulation_steps": 2, "batch_size": 4 * batch},
    ]
    grid += [{"policy": "mixed_bfloat16", "optimizer": "sgd", "input_scale": 2.0, "batch_size": 2 * batch}]
    grid += [{"policy": "mixed_bfloat16", "optimizer": "sgd", "batch_size": max(1, batch // 2), "tf_budget": peak}]
    return grid


def plain(value: object) -> ParsedJSON:
    """A value as its JSON form reads back: dataclasses as dicts, tuples as lists."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    return json.loads(json.dumps(value))


def answer(call: Callable[..., object], *args: object, **kwargs: object) -> ParsedJSON:
    """What a call gives, or what it raised (its type and message: a refused knob's message is part of the answer)."""
    try:
        return plain(call(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - what it raised is the answer recorded
        return {"raised": type(exc).__name__, "message": str(exc)}


def answers(report: Report) -> dict[str, Any]:
    """Everything the zoo records for one report, keyed by what was asked."""
    out: dict[str, Any] = {}
    for knobs in knob_grid(report):
        out[f"predict {json.dumps(knobs, sort_keys=True)}"] = answer(prediction.predict, report, **knobs)
    peak = report.tf_peak_bytes or 1 << 20
    budgets = [None, 1 << 30, 4 << 30, 64 << 30, 1 << 20, report.rss.baseline_bytes + 2 * peak]
    for budget in budgets:
        key = f"largest_fitting_batch {budget}"
        out[key] = answer(prediction.largest_fitting_batch, report, budget)
    if report.model is not None:
        for knobs in ({"policy": "mixed_bfloat16"}, {"optimizer": "sgd"}, {"accumulation_steps": 2}):
            key = f"largest_fitting_batch None {json.dumps(knobs, sort_keys=True)}"
            out[key] = answer(prediction.largest_fitting_batch, report, None, **knobs)
    out["summary"] = answer(prediction.summary, report)
    out["basis_of"] = answer(prediction.basis_of, report)
    out["budget_for_tf"] = answer(prediction.budget_for_tf, report)
    out["outside_tf_bytes"] = answer(prediction.outside_tf_bytes, report)
    out["grown_outside_tf"] = answer(prediction.grown_outside_tf, report)
    out["is_calibrated"] = answer(prediction.is_calibrated, report)
    out["from_trace"] = answer(bases.from_trace, report.whatif_basis)
    out["preflight_anchored"] = answer(bases.anchored_on_preflight, report.whatif_basis)
    out["refused_call_start"] = answer(bases.refused_call_start, report)
    if report.model is None:
        out["trace_whatif_note"] = answer(prediction.trace_whatif_note, report)
    else:
        out["probe_batches"] = answer(lambda: calibration.probe_batches(report, prediction.basis_of(report)))
        out["refused_basis"] = answer(lambda: preflight.refused_basis(report, prediction.analytic_basis(report)))
    out["measured_basis"] = answer(calibration.measured_basis, report)
    for rule in (diagnose_model.large_batch, diagnose_model.large_model, diagnose_model.optimizer_state):
        out[rule.__name__] = answer(rule, report)
    out["whatif_rows"] = answer(lambda: [(label, w.to_dict()) for label, w in view.whatif_rows(report)])
    out["whatif_html"] = answer(render.whatif_html, report)
    return out


def expected() -> dict[str, dict[str, Any]]:
    zoo: dict[str, dict[str, Any]] = json.loads(gzip.decompress(EXPECTED.read_bytes()))  # report -> asked -> answer
    return zoo


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict[str, Any]]:
    return expected()


def test_the_zoo_covers_every_basis_kind(recorded):
    assert set(recorded) == set(names())
    kinds = {recorded[n]["summary"]["basis"] if recorded[n]["summary"] else None for n in recorded}
    assert {"analytic", "measured", "replay"} <= kinds


@pytest.mark.parametrize("name", names())
def test_each_report_is_advised_as_recorded(name, recorded):
    got, want = answers(load(name)), recorded[name]
    assert sorted(got) == sorted(want)
    for key in want:
        assert json.dumps(got[key], sort_keys=True) == json.dumps(want[key], sort_keys=True), key
