"""The lab extension's TypeScript logic (insert request parsing, where the fix cell goes, the report renderer) is
tested with jest; this runs that suite as part of the one test command, and checks the built extension is
installed where JupyterLab looks for it. The renderer's report types are generated from the shipped JSON Schema
(labextension/src/report.ts, `npm run types`): a test fails while they are stale. It formats no number itself: the
bundle's `view` block carries the Python views' words (show/render.py lab_view), checked here against the schema
the renderer's types are made of, and rendered by the TypeScript on bundles Python made."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tfmem_magic.core.report import (
    MIME_TYPE,
    BeforeAfter,
    DeviceMemory,
    EnvInfo,
    ErrorInfo,
    Finding,
    Fix,
    HeldInfo,
    Holder,
    LineGroup,
    LineTensor,
    LiveGroup,
    ModelInfo,
    Report,
    RssInfo,
    TraceInfo,
)
from tfmem_magic.core.schema import shipped_schema
from tfmem_magic.show.render import mime_bundle

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "labextension"
MiB, GiB = 2**20, 2**30
needs_npm = pytest.mark.skipif(
    shutil.which("npm") is None, reason="node/npm not installed (the extension cannot be built)"
)


def npm_installed() -> None:
    if not (EXT / "node_modules").exists():
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund"], cwd=EXT, check=True, capture_output=True, timeout=600
        )


def jest(*args: str, env: dict[str, str] | None = None) -> str:
    """Run jest (all suites, or those named) and return its summary line ("Tests: ...") once it passed."""
    npm_installed()
    run = subprocess.run(
        ["npx", "jest", "--ci", *args],
        cwd=EXT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Tests:" in run.stderr, run.stderr[-3000:]
    summary = run.stderr.split("Tests:")[1].splitlines()[0]
    assert "failed" not in summary, run.stderr[-3000:]
    return summary


@needs_npm
def test_jest_suite_passes():
    jest()


@needs_npm
def test_generated_report_types_are_current():
    """After a change to tfmem_magic/report.schema.json (or labextension/schema/view.schema.json), regenerate the
    renderer's types: `cd labextension && npm run types` (scripts/types.mjs) rewrites src/report.ts."""
    npm_installed()
    run = subprocess.run(["node", "scripts/types.mjs", "--check"], cwd=EXT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def reports() -> dict[str, Report]:
    """Reports that use every part of the view block: a traced fit re-run after a fix, with a model on two replicas,
    findings, a fix and names holding memory; a quick cell on a GPU with its own limit and sampled bytes; a cell
    that raised before TensorFlow ran. User strings hold HTML."""
    fit = Report(
        label="fit <b>",
        status="ok",
        mode="trace",
        wall_s=1.5,
        number=3,
        env=EnvInfo(
            allocator="bfc_cpu_allocator_for_gpu",
            allocator_complete=True,
            budget_bytes=24 * GiB,
            ram_total_bytes=32 * GiB,
            devices=["CPU:0"],
        ),
        rss=RssInfo(500 * MiB, 700 * MiB, 650 * MiB, "hwm", [[0, 500 * MiB], [0.7, 700 * MiB], [1.5, 650 * MiB]]),
        tf={"CPU:0": DeviceMemory(0, 64 * MiB, 2 * MiB)},
        trace=TraceInfo(
            events=10,
            peak_live_bytes=64 * MiB,
            peak_time_s=0.5,
            timeline=[[0, 0], [0.5, 64 * MiB], [1.2, 2 * MiB]],
            by_phase=[LiveGroup(phase="forward", bytes=40 * MiB), LiveGroup(phase=None, bytes=24 * MiB)],
            by_layer=[LiveGroup(layer="dense<script>", bytes=30 * MiB)],
            by_line=[
                LineGroup(
                    label="In [2] line 5",
                    code="return x @ w  # <script>",
                    bytes=30 * MiB,
                    forward_bytes=20 * MiB,
                    backward_bytes=10 * MiB,
                    count=2,
                    layer="wide",
                    made_by="In [3] line 1",
                    made_by_code="model = Sequential([Wide(), <Dense>])",
                    tensors=[LineTensor(20 * MiB, "[256,20480]", "float32", "MatMul", "forward")],
                ),
                LineGroup(label="eager ops", kind="eager", bytes=MiB),
            ],
            by_line_named_bytes=30 * MiB,
            by_line_note="30 MiB of the 64 MiB traced at the peak named by a line of code; not by a line: eager ops",
            held_at_end_bytes=2 * MiB,
            held_at_end_by_line=[
                LineGroup(label="In [3] line 1", code="model = Sequential([Wide(), <Dense>])", bytes=MiB, count=2),
                LineGroup(label="eager ops", kind="eager", bytes=MiB),
            ],
        ),
        model=ModelInfo(
            name="mlp<x>", params=288906, param_bytes=288906 * 4, optimizer="Adam", batch_size=256, replicas=2
        ),
        findings=[Finding("large-batch", "The batch", "warn", "a < b")],
        fixes=[Fix("shrink-batch", "Shrink", "why", "model.fit(x, batch_size=8)", predicted_peak_bytes=40 * MiB)],
        before=BeforeAfter(
            number=1,
            label="fit",
            status="ok",
            tf_peak_bytes=128 * MiB,
            rss_peak_bytes=800 * MiB,
            wall_s=2.0,
            fix_id="shrink-batch",
            predicted_peak_bytes=60 * MiB,
            error_band=0.15,
            held=True,
        ),
        held=HeldInfo(left_bytes=2 * MiB, holders=[Holder("models", "list", 2 * MiB, models=["a", "b<c>"])]),
    )
    gpu = Report(
        label="gpu",
        mode="quick",
        wall_s=0.25,
        number=4,
        env=EnvInfo(
            allocator="GPU_0_bfc",
            budget_bytes=24 * GiB,
            ram_total_bytes=32 * GiB,
            budget_source="cgroup",
            device_limit_bytes={"GPU:0": 14 * GiB},
            devices=["CPU:0", "GPU:0"],
        ),
        rss=RssInfo(2 * GiB, 3 * GiB, 3 * GiB, "sampled", [[0, 2 * GiB], [0.25, 3 * GiB]]),
        tf={"CPU:0": DeviceMemory(0, MiB, 0), "GPU:0": DeviceMemory(GiB, 4 * GiB, GiB, [[0, GiB], [0.2, 4 * GiB]])},
    )
    error = Report(label="", status="error", error=ErrorInfo("ValueError", "bad <input>"), wall_s=0.01, number=5)
    return {"traced fit after a fix": fit, "quick cell on a GPU": gpu, "cell that raised": error}


def bundles() -> dict[str, dict]:
    return {name: mime_bundle(report, timeline=b"") for name, report in reports().items()}  # b"": no PNG


def test_view_blocks_match_the_schema_the_renderer_types_are_made_of():
    """Python's view block (show/render.py lab_view) and labextension/schema/view.schema.json say the same: a key
    added on one side only fails here. The report beside it matches the shipped report schema."""
    from jsonschema import Draft202012Validator

    views = Draft202012Validator(json.loads((EXT / "schema" / "view.schema.json").read_text()))
    report_schema = Draft202012Validator(shipped_schema())
    for name, bundle in bundles().items():
        data = bundle[MIME_TYPE]
        wrong = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in views.iter_errors(data["view"])]
        wrong += [
            f"report {'/'.join(map(str, e.path))}: {e.message}"
            for e in report_schema.iter_errors({k: v for k, v in data.items() if k != "view"})
        ]
        assert not wrong, f"{name}: " + "; ".join(wrong)
        assert data["view"]["summary"], name  # the renderer shows the text form of a bundle without it
    fit = bundles()["traced fit after a fix"][MIME_TYPE]["view"]
    assert {"model", "before_after", "peak", "timeline", "held"} <= set(fit)
    assert [row["label"] for row in fit["peak"]["by_line"]] == ["In [2] line 5"] and fit["peak"]["by_line_note"]
    assert [row["label"] for row in fit["held"]["by_line"]] == ["In [3] line 1"] and fit["held"]["by_line_note"]
    assert [s["kind"] for s in fit["timeline"]] == ["trace", "rss"]
    gpu = bundles()["quick cell on a GPU"][MIME_TYPE]["view"]
    assert [(s["kind"], s.get("device")) for s in gpu["timeline"]] == [("device", "GPU:0"), ("rss", None)]


@needs_npm
def test_renderer_shows_the_words_python_put_in_the_bundle(tmp_path):
    """The TypeScript renderer on bundles Python made (labextension/test/bundles.test.ts): each of the view's
    numbers in words is on the page, and each timeline series finds its points in the report."""
    path = tmp_path / "bundles.json"
    path.write_text(json.dumps(bundles()))
    summary = jest("test/bundles.test.ts", env={"TFMEM_BUNDLES": str(path)})
    assert "skipped" not in summary and f"{len(reports()) + 1} passed" in summary, summary


def test_the_extension_names_only_python_that_exists():
    """The extension's comments and tests name Python modules and functions (`tfmem_magic.show.frontend.insert_cell`)
    and files (`tfmem_magic/report.schema.json`): each must exist, so that a move on the Python side shows here."""
    files = [
        p
        for pattern in ("src/*.ts", "test/*.ts", "scripts/*.mjs", "schema/*.json")
        for p in EXT.glob(pattern)
        if p.name != "report.ts"
    ]  # report.ts: generated from the schema
    assert files
    missing = []
    for path in files:
        text = path.read_text()
        for dotted in sorted(set(re.findall(r"\btfmem_magic(?:\.[A-Za-z_]\w*)+", text))):
            if not _resolves(dotted):
                missing.append(f"{path.relative_to(ROOT)}: {dotted}")
        for name in sorted(set(re.findall(r"\btfmem_magic/[\w./]*\w", text))):
            if not (ROOT / name).exists() and name != "tfmem_magic/labextension":  # the build's output
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(target, attr):
                return False
            target = getattr(target, attr)
        return True
    return False


def test_prebuilt_extension_is_installed_and_enabled():
    share = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "tfmem_magic"
    assert json.loads((share / "package.json").read_text())["name"] == "tfmem_magic"
    out = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True, timeout=120
    )
    line = next(line for line in (out.stdout + out.stderr).splitlines() if "tfmem_magic" in line)
    assert "enabled" in line and "OK" in line
