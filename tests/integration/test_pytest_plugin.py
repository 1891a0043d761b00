"""The pytest plugin, run for real: pytest in a fresh process (pytester) on small test files that allocate known
tensors and fit a small Keras model, with the plugin loaded the way users get it (the `pytest11` entry point)."""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tfmem_magic.core.report import Report

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow
MiB = 2**20
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def clean_env(monkeypatch):
    """A user's environment: nothing set for TensorFlow's allocator (this suite's conftest sets BFC for itself)."""
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB", "TF_ENABLE_ONEDNN_OPTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")


def failure(out: str, test: str) -> str:
    """The section pytest prints for one failed test (its name between underscores, up to the next section)."""
    start = re.search(rf"^_+ {re.escape(test)} _+$", out, re.M)
    assert start, f"no failure section for {test}:\n{out}"
    end = re.search(r"^(_+ \S+ _+|=+ .* =+)$", out[start.end() :], re.M)
    return out[start.end() : start.end() + end.start()] if end else out[start.end() :]


def test_the_plugin_is_registered_for_pytest():
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("tfmem") == "tfmem_magic.adapters.pytest_plugin"


LIMITS = """
import numpy as np
import pytest
import tensorflow as tf
import keras

@pytest.mark.tfmem_limit("64MiB")
def test_within():
    x = tf.ones((1024, 1024))                    # 4 MiB
    assert float(tf.reduce_sum(x * 2)) == 2 * 1024 * 1024

@pytest.mark.tfmem_limit("16MiB")
def test_over():
    x = tf.ones((2048, 4096))                    # 32 MiB, and 32 more for x * 2
    assert float(tf.reduce_sum(x * 2)) > 0

@pytest.mark.tfmem_limit("8MiB")
def test_fit_over():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, activation="relu", name="wide"),
                              keras.layers.Dense(10, name="head")])
    model.compile("adam", "sparse_categorical_crossentropy")
    x = np.random.default_rng(0).random((512, 512), dtype="float32")
    model.fit(x, np.zeros(512, "int32"), batch_size=256, epochs=1, verbose=0)

@pytest.mark.tfmem_limit("100MiB", rss=True)
def test_rss_over():
    block = np.ones(300 * 2**20 // 8)            # 300 MiB of process memory, none of it TensorFlow's
    assert block.sum() > 0

@pytest.mark.tfmem_limit("1MiB")
def test_no_tensorflow():
    assert sum(range(10)) == 45

@pytest.mark.tfmem_limit("1GiB")
def test_own_failure():
    tf.ones((4, 4))
    assert False, "the test's own failure"

@pytest.mark.tfmem_limit("64MiB", device="CPU:0")
def test_device_within():
    assert float(tf.reduce_sum(tf.ones((1024, 1024)) * 2)) > 0     # 8 MiB at most

@pytest.mark.tfmem_limit("40MiB", device="CPU:0")
def test_device_over():
    assert float(tf.reduce_sum(tf.ones((2048, 4096)) * 2)) > 0     # 64 MiB

@pytest.mark.tfmem_limit("1GiB", device="GPU:0")
def test_device_absent():
    tf.ones((4, 4))                              # this machine has no GPU: nothing to judge the limit on

@tf.function
def stacked(x):
    y = tf.concat([x, x, x], axis=0)             # 96 MiB, made on this line
    return tf.reduce_sum(y * 2.0)

@pytest.mark.tfmem_limit("16MiB")
def test_function_over():
    assert float(stacked(tf.ones((2048, 4096)))) > 0
"""


def test_limits_pass_fail_and_say_what_to_act_on(pytester, clean_env):
    pytester.makepyfile(test_limits=LIMITS)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 3 and outcomes.get("failed") == 7, out
    # the plugin set TensorFlow's allocator up (BFC) before the first op: every allocation is counted
    assert "note: TensorFlow's CPU allocator" not in out, out  # what the plugin says when it could not
    over = re.search(
        r"tfmem_limit: TensorFlow's peak on CPU:0 was ([\d.]+) MiB over the test body's baseline, "
        r"over its 16 MiB limit",
        out,
    )
    assert over and 60 <= float(over.group(1)) <= 70, out  # 32 MiB for x and 32 MiB for x * 2, both live
    # the largest tensors are named by op, dtype and shape: the two 32 MiB ones, x and x * 2
    largest = failure(out, "test_over")
    assert "Largest tensors live at the peak:" in largest
    assert re.search(r"^ +32 MiB  [A-Za-z]\w*.*  float32\[2048,4096\]", largest, re.M), largest
    assert re.search(r"^ +32 MiB  Mul\b.*float32\[2048,4096\]", largest, re.M), largest  # x * 2
    fit = out[out.index("test_fit_over") :]
    assert re.search(r"over its 8 MiB limit", fit) and "wide" in fit  # the layer that holds the most is named
    # a line of the test's code that holds memory at the peak is named with its code (the by-line view): a
    # tf.function's line, and a built-in layer's tensors by the line that made the layer
    by_line = failure(out, "test_function_over")
    # (the concat is named by its line where the trace shows it inside its function; in some runs the trace shows
    # a function's ops without it, as eager ops no callback noted: docs/lines.md)
    assert re.search(r"^By line ", by_line, re.M), by_line
    assert re.search(r"^ +[\d.]+ [KM]iB +test_limits\.py:5[348] ", by_line, re.M), by_line
    fit_lines = failure(out, "test_fit_over")
    # the lines that made the layers (the wide layer's eager weights are paired with their op by time, which can
    # miss under load: the head's backward tensors are named from the graph either way)
    assert re.search(r"^ +[\d.]+ [KM]iB +test_limits\.py:(19|20) ", fit_lines, re.M), fit_lines
    assert re.search(r"layer (wide|head): made on this line", fit_lines), fit_lines
    rss = re.search(r"tfmem_limit: the process's RSS peak was ([\d.]+) MiB", out)
    assert rss and 280 <= float(rss.group(1)) <= 400, out
    assert "the test's own failure" in out  # the test's own exception, not a limit message
    # dict.fromkeys: pytest repeats each failure's whole message in its short summary when it runs on CI
    paths = list(dict.fromkeys(re.findall(r"report: (\S+\.json)", out)))
    assert len(paths) == 5
    # where _save writes a failure's report (the README shows this path): the cache folder, the node id, a digest
    assert re.search(r"\.pytest_cache/d/tfmem/test_limits\.py_test_over-[0-9a-f]{8}\.json$", paths[0]), paths
    report = Report.load(paths[0])
    assert report.label.endswith("test_over") and report.tf_peak_bytes > 16 * MiB
    assert report.env.allocator == "bfc_cpu_allocator_for_gpu" and report.env.allocator_complete
    # device=: the limit is judged on that device's allocator, over and under it
    device_over = re.search(
        r"TensorFlow's peak on CPU:0 was ([\d.]+) MiB over the test body's baseline, over its "
        r"40 MiB limit",
        failure(out, "test_device_over"),
    )
    assert device_over and 60 <= float(device_over.group(1)) <= 70, out
    assert "test_limits.py::test_device_within" not in out  # passed: listed only if it failed
    absent = failure(out, "test_device_absent")
    assert (
        "tfmem_limit(device='GPU:0'): TensorFlow has no allocator statistics for GPU:0 in this process "
        "(its devices: CPU:0; with statistics: CPU:0)" in absent
    ), absent
    assert "@pytest.mark.skipif(not tf.config.list_physical_devices('GPU')" in absent


LEAKS = """
import pytest
import tensorflow as tf

KEPT = []

@pytest.mark.tfmem_no_leak("1MiB", runs=3)
def test_keeps_a_tensor_per_call():
    KEPT.append(tf.ones((1024, 1024)) * 2)       # 4 MiB kept by every run

@pytest.mark.tfmem_no_leak("1MiB")
def test_clean():
    assert float(tf.reduce_sum(tf.ones((1024, 1024)) * 2)) > 0

def test_builds_a_model_per_call_and_keeps_nothing():
    import keras
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024)])   # 1 MiB of weights, per call
    model(tf.ones((8, 256)))   # held by reference cycles until a full collection: the plugin collects

CALLS = []

@pytest.mark.tfmem_no_leak("1MiB", runs=4)
def test_runs_the_body_each_time():
    CALLS.append(1)

def test_the_body_ran_four_times():
    assert len(CALLS) == 4
"""


def test_a_leak_across_runs_fails_and_a_clean_body_passes(pytester, clean_env):
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 4, "failed": 1}, out
    leak = failure(out, "test_keeps_a_tensor_per_call")
    grew = re.search(
        r"tfmem_no_leak: TensorFlow's live bytes grew by ([\d.]+) MiB per run on average, more than "
        r"the 1 MiB allowed\. After each of the 3 runs of the body: ",
        leak,
    )
    assert grew and 3.9 <= float(grew.group(1)) <= 4.5, out
    # the report of the failing test's last run, where _save writes it
    path = re.search(r"^report of the last run: (\S+\.json)$", leak, re.M)
    assert path and re.search(
        r"\.pytest_cache/d/tfmem/test_leaks\.py_test_keeps_a_tensor_per_call-[0-9a-f]{8}"
        r"\.json$",
        path.group(1),
    ), leak
    assert Report.load(path.group(1)).label == "test_leaks.py::test_keeps_a_tensor_per_call"


UNEVEN = """
import pytest
import tensorflow as tf

KEPT = []
CALLS = {"once": 0, "every_second": 0}

@pytest.mark.tfmem_no_leak("1MiB", runs=3)
def test_one_run_fills_a_cache():
    CALLS["once"] += 1
    if CALLS["once"] == 2:                        # 4 MiB kept by the second run only: a one-off, not a leak
        KEPT.append(tf.ones((1024, 1024)) * 2)
    assert float(tf.reduce_sum(tf.ones((256, 1024)))) > 0

@pytest.mark.tfmem_no_leak("1MiB", runs=5)
def test_every_second_run_keeps_a_tensor():
    CALLS["every_second"] += 1
    if CALLS["every_second"] % 2 == 0:            # 4 MiB kept by runs 2 and 4: 2 MiB per run on the whole
        KEPT.append(tf.ones((1024, 1024)) * 2)

@pytest.mark.tfmem_no_leak("1MiB", runs=3)
def test_every_run_keeps_a_tensor():
    KEPT.append(tf.ones((1024, 1024)) * 2)
"""


def test_a_one_off_growth_passes_and_a_growth_in_most_runs_fails(pytester, clean_env):
    pytester.makepyfile(test_uneven=UNEVEN)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 1, "failed": 2}, out
    assert "test_uneven.py::test_one_run_fills_a_cache" not in out  # it passed
    every_second = failure(out, "test_every_second_run_keeps_a_tensor")
    # growths 4, 0, 4, 0 MiB; the largest left out: (0 + 4 + 0) / 3
    grew = re.search(
        r"grew by ([\d.]+) MiB per run on average.*the largest single growth, ([\d.]+) MiB, is left "
        r"out as a one-off",
        every_second,
        re.S,
    )
    assert grew and 1.2 <= float(grew.group(1)) <= 1.6 and 3.9 <= float(grew.group(2)) <= 4.5, every_second
    assert "After each of the 5 runs of the body" in every_second
    steady = failure(out, "test_every_run_keeps_a_tensor")
    grew = re.search(r"grew by ([\d.]+) MiB per run on average", steady)
    assert grew and 3.9 <= float(grew.group(1)) <= 4.5, steady


LOOPS = """
import pytest
import tensorflow as tf

@pytest.mark.tfmem_no_leak("1MiB")
def test_loop_keeps_a_tensor_per_iteration(tfmem_leak_check):
    kept = []
    for _ in range(4):
        kept.append(tf.ones((1024, 1024)) * 2)   # 4 MiB kept by every iteration
        tfmem_leak_check.step()

@pytest.mark.tfmem_no_leak("1MiB")
def test_clean_loop(tfmem_leak_check):
    for _ in range(4):
        assert float(tf.reduce_sum(tf.ones((1024, 1024)) * 2)) > 0
        tfmem_leak_check.step()

@pytest.mark.tfmem_no_leak("1MiB")
def test_loop_that_fills_a_cache_once(tfmem_leak_check):
    cache = {}
    for i in range(5):
        if i == 2:
            cache["table"] = tf.ones((1024, 1024))   # 4 MiB once, kept to the end
        assert float(tf.reduce_sum(tf.ones((512, 1024)))) > 0
        tfmem_leak_check.step()

BODIES = []

@pytest.mark.tfmem_no_leak("1MiB")
def test_loop_body_runs_once(tfmem_leak_check):
    BODIES.append(1)
    for _ in range(3):
        tfmem_leak_check.step()

def test_the_body_ran_once():
    assert len(BODIES) == 1

@pytest.mark.tfmem_no_leak("1MiB")
def test_one_step_only(tfmem_leak_check):
    tf.ones((4, 4))
    tfmem_leak_check.step()
"""


def test_the_no_leak_rule_over_the_tests_own_loop(pytester, clean_env):
    pytester.makepyfile(test_loops=LOOPS)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 4, "failed": 2}, out
    leak = failure(out, "test_loop_keeps_a_tensor_per_iteration")
    grew = re.search(
        r"tfmem_no_leak: TensorFlow's live bytes grew by ([\d.]+) MiB per step on average, more than "
        r"the 1 MiB allowed\. After each of the 4 steps of the test's loop \(tfmem_leak_check\.step\(\)\)",
        leak,
    )
    assert grew and 3.9 <= float(grew.group(1)) <= 4.5, leak
    path = re.search(r"^report: (\S+\.json)$", leak, re.M)
    assert path and Report.load(path.group(1)).label == "test_loops.py::test_loop_keeps_a_tensor_per_iteration"
    assert (
        "called tfmem_leak_check.step() 1 time(s); call it once per iteration of its loop, at least twice"
        in failure(out, "test_one_step_only")
    )


def test_an_overridden_loop_fixture_is_named_not_misjudged(pytester, clean_env):
    pytester.makeconftest("import pytest\n\n@pytest.fixture\ndef tfmem_leak_check():\n    return object()\n")
    pytester.makepyfile(
        test_loop=("import pytest\n\n@pytest.mark.tfmem_no_leak('1MiB')\ndef test_a(tfmem_leak_check):\n    pass\n")
    )
    result = pytester.runpytest_subprocess("-q", timeout=120)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"failed": 1}, out
    assert "the tfmem_leak_check fixture was overridden (by a conftest?)" in out, out
    assert "time(s)" not in out  # not judged as a loop that called step() too rarely


@pytest.mark.parametrize(
    "marker, expected, fixtures",
    [
        ('tfmem_limit("lots")', "tfmem_limit('lots')", ""),
        ('tfmem_limit("1MiB", "2MiB")', "takes one size", ""),
        ('tfmem_limit("1MiB", device="gpu")', "name a TensorFlow device such as 'GPU:0'", ""),
        ('tfmem_limit("1MiB", rss="yes")', "rss is True or False", ""),
        (
            'tfmem_limit("1MiB", rss=True, device="CPU:0")',
            "rss=True limits the process's memory; device= does not apply",
            "",
        ),
        ('tfmem_no_leak("1MiB", runs=1)', "at least 2", ""),
        ('tfmem_no_leak("1MiB", repeat=3)', "unknown argument(s) repeat", ""),
        ('tfmem_no_leak("1MiB", runs=3)', "with the tfmem_leak_check fixture the body runs once", "tfmem_leak_check"),
        (
            None,
            "the tfmem_leak_check fixture judges the test's loop by its @pytest.mark.tfmem_no_leak(size) marker",
            "tfmem_leak_check",
        ),
    ],
)
def test_bad_marker_arguments_fail_at_collection(pytester, clean_env, marker, expected, fixtures):
    decorator = f"@pytest.mark.{marker}\n" if marker else ""
    pytester.makepyfile(test_bad=f"import pytest\n\n{decorator}def test_a({fixtures}):\n    pass\n")
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "test_bad.py::test_a:" in err and expected in err, err


TABLE = """
import os
import pytest
import tensorflow as tf

@pytest.mark.parametrize("mib", [8, 32, 64])
def test_allocates(mib):
    x = tf.ones((mib * 2**20 // 4,))
    assert float(tf.reduce_sum(x)) > 0

def test_plain():
    assert os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "1"  # --tfmem set the allocator up before collection
"""


def test_the_table_of_the_largest_under_xdist_with_saved_reports(pytester, clean_env, tmp_path):
    pytester.makepyfile(test_table=TABLE)
    saved = tmp_path / "reports"
    result = pytester.runpytest_subprocess(
        "-q", "-n", "2", "--tfmem", "--tfmem-top", "2", "--tfmem-save", str(saved), timeout=300
    )
    out = result.stdout.str()
    assert result.parseoutcomes().get("passed") == 4, out
    table = out[out.index("tfmem: the 2 tests with the highest TensorFlow peak") :].splitlines()
    rows = [line for line in table if "test_table.py" in line]
    assert len(rows) == 2 and "[64]" in rows[0] and "[32]" in rows[1], out
    assert rows[0].split()[0:2] == ["64", "MiB"]
    reports = {p.name: Report.load(p) for p in saved.glob("*.json")}
    assert len(reports) == 4
    peaks = {r.label: r.tf_peak_bytes for r in reports.values()}  # the label is the test's node id
    for mib in (8, 32, 64):
        peak = peaks[f"test_table.py::test_allocates[{mib}]"]
        assert mib * MiB <= peak <= mib * MiB + 2 * MiB, peaks
    assert all(r.mode == "quick" for r in reports.values())


def test_a_limit_on_a_body_that_never_runs_tensorflow_passes(pytester, clean_env):
    pytester.makepyfile(
        test_no_tf="""
import pytest

@pytest.mark.tfmem_limit("1MiB")
def test_plain():
    assert sum(range(10)) == 45   # TensorFlow is imported (to trace), but no op runs: its allocator never exists
"""
    )
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()


def test_markers_on_a_unittest_method_are_refused(pytester, clean_env):
    pytester.makepyfile(
        test_ut="""
import unittest
import pytest

class T(unittest.TestCase):
    @pytest.mark.tfmem_limit("1MiB")
    def test_a(self):
        pass
"""
    )
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "unittest.TestCase method" in result.stderr.str()


def test_without_markers_or_options_the_plugin_changes_nothing(pytester, clean_env):
    pytester.makepyfile(
        test_plain="""
import os

def test_env():
    assert "TF_CPU_ALLOCATOR_USE_BFC" not in os.environ
"""
    )
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()
    assert "tfmem" not in result.stdout.str()


def test_trace_mode_for_every_test_saves_the_breakdown(pytester, clean_env, tmp_path):
    pytester.makepyfile(
        test_traced="""
import numpy as np
import keras

def test_fit():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, name="dense_t")])
    model.compile("sgd", "mse")
    model.fit(np.ones((128, 64), "float32"), np.ones((128, 256), "float32"), batch_size=32, verbose=0)
"""
    )
    saved = tmp_path / "reports"
    result = pytester.runpytest_subprocess("-q", "--tfmem-trace", "--tfmem-save", str(saved), timeout=300)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()
    report = Report.load(next(saved.glob("*.json")))
    assert report.mode == "trace" and "dense_t" in {g.layer for g in report.trace.by_layer}
    assert "tfmem: the 1 test with the highest TensorFlow peak" in result.stdout.str()


FIXTURES = """
import pytest
import tensorflow as tf

@pytest.fixture
def big():
    return tf.ones((4096, 4096))                 # 64 MiB, made (and kept alive) before the body

@pytest.fixture
def warmed_up():
    assert float(tf.reduce_sum(tf.ones((4096, 4096)) * 2)) > 0   # a 128 MiB peak during set-up, then freed

@pytest.mark.tfmem_limit("8MiB")
def test_small_body_with_big_fixtures(big, warmed_up):
    assert float(tf.reduce_sum(big[:16])) == 16 * 4096   # 256 KiB in the body

@pytest.mark.tfmem_limit("8MiB")
def test_the_same_in_the_body():
    big = tf.ones((4096, 4096))
    assert float(tf.reduce_sum(big[:16])) == 16 * 4096
"""


def test_only_the_test_body_is_measured_not_its_fixtures(pytester, clean_env):
    pytester.makepyfile(test_fixtures=FIXTURES)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 1, "failed": 1}, out
    assert "test_fixtures.py::test_small_body_with_big_fixtures" not in out  # it passed
    assert re.search(
        r"TensorFlow's peak on CPU:0 was 6\d(\.\d+)? MiB over the test body's baseline, over its 8 MiB",
        failure(out, "test_the_same_in_the_body"),
    )


IMPORT_OP = """
import pytest
import tensorflow as tf

SCALE = tf.constant(2.0)   # an op at import: TensorFlow chooses its CPU allocator before the plugin can set BFC

@pytest.mark.tfmem_limit("64MiB")
def test_within():
    assert float(tf.reduce_sum(tf.ones((1024, 1024)) * SCALE)) > 0     # 8 MiB at most

@pytest.mark.tfmem_limit("16MiB")
def test_over():
    assert float(tf.reduce_sum(tf.ones((2048, 4096)) * SCALE)) > 0     # 64 MiB
"""
LATE = (
    "a TensorFlow op ran before the plugin could switch it to BFC (when a test module or conftest.py was "
    "imported). Run pytest with TF_CPU_ALLOCATOR_USE_BFC=1 in the environment, or run no TensorFlow op at import "
    "(make tensors in fixtures or tests)."
)


def test_an_op_at_import_is_reported_with_what_to_do(pytester, clean_env):
    """oneDNN's allocator (TensorFlow's default on x86 Linux) sees allocations of 256 KiB or more: the limits are
    judged on what it sees, and the user is told what is missed, why and what to do, in the failure and at the end."""
    pytester.makepyfile(test_import_op=IMPORT_OP)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 1, "failed": 1}, out
    note = "note: TensorFlow's CPU allocator (mklcpu) tracks only allocations of 256 KiB or more: " + LATE
    over = failure(out, "test_over")
    assert "over its 16 MiB limit" in over and note in over, over
    summary = out[out.index("=== tfmem ===") :]
    assert summary.splitlines()[1] == note, summary


def test_an_op_at_import_without_allocator_statistics_fails_clearly(pytester, clean_env, monkeypatch):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")  # TensorFlow's plain CPU allocator: no statistics at all
    pytester.makepyfile(test_import_op=IMPORT_OP)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"failed": 2}, out
    message = (
        "tfmem_limit: tfmem could not measure TensorFlow's allocator in this test: TensorFlow's CPU allocator "
        "(cpu) keeps no statistics at all: " + LATE[:-1] + "; or limit the process memory instead with "
        "rss=True."
    )
    assert message in failure(out, "test_within"), out


def test_the_advice_for_an_op_at_import_works(pytester, clean_env, monkeypatch):
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "1")  # what the note says to do
    pytester.makepyfile(test_import_op=IMPORT_OP)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 1, "failed": 1}, out
    assert "note:" not in out and "=== tfmem ===" not in out, out


def pytest_example(path: Path, heading: str) -> str:
    """The first Python block under `heading` in `path` (the README's pytest section, docs/pytest.md's "Every
    marker"), as a user would paste it."""
    text = path.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


@pytest.mark.parametrize(
    "path, heading, markers, tests",
    [
        (README, "### In your tests: memory budgets with pytest", ("tfmem_limit", "tfmem_no_leak"), 2),
        (README.parent / "docs" / "pytest.md", "## Every marker", ("rss=True", "device=", "tfmem_leak_check"), 5),
    ],
    ids=["readme", "docs"],
)
def test_the_documented_examples_run_as_pasted(pytester, clean_env, path, heading, markers, tests):
    code = pytest_example(path, heading)
    assert all(m in code for m in markers)
    pytester.makepyfile(test_documented=code)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= tests and set(outcomes) <= {"passed", "warnings"}, out
    assert "note:" not in out, out  # no TensorFlow op at import: the plugin sets BFC before the first
