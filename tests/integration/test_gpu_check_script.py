"""benchmarks/gpu_check.py is run by hand when a GPU is lent for a few minutes: it must not be broken when that
happens. Here (no GPU) the whole script says so and exits 0, and its scenarios' own code runs on the CPU: their GPU
checks fail, but every number they print is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_without_a_gpu_the_check_says_so_and_exits_0():
    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sees no GPU" in done.stdout


def scenario(name: str) -> dict:
    done = run("--scenario", name)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_what_if_scenario_measures_three_batches_on_a_cpu():
    out = scenario("whatif")
    assert [row["batch"] for row in out["rows"]] == [64, 128, 256]
    for row in out["rows"]:
        assert row["measured_mib"] > 1 and row["predicted_mib"] > 1, row
    # the script's verdict is its rows' (errors are rounded to 3 digits in the rows)
    assert out["ok"] == all(abs(row["error"]) <= 0.3005 for row in out["rows"]), out


def test_the_xla_scenario_runs_both_jit_settings_and_names_the_device():
    out = scenario("xla")
    assert out["main"] == "CPU:0" and out["ok"] is False  # its checks are a GPU's
    assert out["noted"]["True"] is True  # jit_compile=True gets the XLA note on any device
    assert set(out["noted"]) == {"True", "auto"}


def test_the_trace_scenario_reads_back_what_tensorflows_profiler_recorded():
    """The what-if from a saved trace (issue 29): on a CPU the recording is the CPU's allocator, which began before
    the trace (its self-check may then fail and say why); the measured rows are there either way."""
    out = scenario("trace")
    assert out["main"] == "CPU:0" and out["events"] > 0
    assert [row["batch"] for row in out["rows"]] == [64, 128] and all(r["measured_mib"] > 1 for r in out["rows"])
    replay = out["replay"]
    assert replay["passed"] or replay["why_not"], replay
    assert out["ok"] == (replay["passed"] and all(abs(r["error"]) <= 0.3005 for r in out["rows"])), out


def test_the_scenarios_of_a_gpus_own_memory_run_on_a_cpu():
    """The scenarios for what only a GPU shows (workspaces, the first step, the pre-flight while the kernel
    holds the GPU, the peaks a worker serves instead of traces) run their code here; their GPU checks fail."""
    workspace = scenario("workspace")
    assert set(workspace["runs"]) == {"default", "capped"} and all("peak" in r for r in workspace["runs"].values())
    assert workspace["workspaces"] == [] and workspace["ok"] is False  # no cuDNN on a CPU
    first = scenario("firststep")
    assert first["main"] == "CPU:0" and set(first["rows"]) == {"128", "256"} and first["ok"] is False
    assert all(r["first"] > 1 and r["steady"] > 1 for r in first["rows"].values())
    preflight = scenario("preflight")
    assert preflight["alive"] and preflight["verdict"] == "refused" and preflight["status"] == "refused"
    assert preflight["on_gpu"] is False and preflight["ok"] is False
    peaks = scenario("peaks")
    assert peaks["device"] == "CPU:0" and peaks["tf_peak_bytes"] > peaks["tf_start_bytes"] and peaks["ok"] is False
    fromcpu = scenario("fromcpu")  # a CPU report modelled for a GPU (docs/gpu.md, "From a CPU run to a GPU")
    assert fromcpu["modelled"] > fromcpu["workspace"] > 0 and fromcpu["steady"] > 0 and fromcpu["ok"] is False
