"""The pytest plugin, run for real: pytest in a fresh process (pytester) on small test files that allocate known
tensors and fit a small Keras model, with the plugin loaded the way users get it (the `pytest11` entry point)."""

from __future__ import annotations

import re
from importlib.metadata import entry_points

import pytest

from tfmem_magic.core.report import Report

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow
MiB = 2**20


@pytest.fixture
def clean_env(monkeypatch):
    """A user's environment: nothing set for TensorFlow's allocator (this suite's conftest sets BFC for itself)."""
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB", "TF_ENABLE_ONEDNN_OPTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")


def test_the_plugin_is_registered_for_pytest():
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("tfmem") == "tfmem_magic.adapters.pytest_plugin"


LIMITS = '''
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
'''


def test_limits_pass_fail_and_say_what_to_act_on(pytester, clean_env):
    pytester.makepyfile(test_limits=LIMITS)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2 and outcomes.get("failed") == 4, out
    # the plugin set TensorFlow's allocator up (BFC) before the first op: every allocation is counted
    assert "oneDNN CPU allocator tracks only" not in out
    over = re.search(r"tfmem_limit: TensorFlow's peak on CPU:0 was ([\d.]+) MiB over the test body's baseline, "
                     r"over its 16 MiB limit", out)
    assert over and 60 <= float(over.group(1)) <= 70, out  # 32 MiB for x and 32 MiB for x * 2, both live
    assert "Largest tensors live at the peak:" in out and "32 MiB" in out
    fit = out[out.index("test_fit_over"):]
    assert re.search(r"over its 8 MiB limit", fit) and "wide" in fit  # the layer that holds the most is named
    rss = re.search(r"tfmem_limit: the process's RSS peak was ([\d.]+) MiB", out)
    assert rss and 280 <= float(rss.group(1)) <= 400, out
    assert "the test's own failure" in out  # the test's own exception, not a limit message
    # dict.fromkeys: pytest repeats each failure's whole message in its short summary when it runs on CI
    paths = list(dict.fromkeys(re.findall(r"report: (\S+\.json)", out)))
    assert len(paths) == 3
    report = Report.load(paths[0])
    assert report.label.endswith("test_over") and report.tf_peak_bytes > 16 * MiB


LEAKS = '''
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
'''


def test_a_leak_across_runs_fails_and_a_clean_body_passes(pytester, clean_env):
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest_subprocess("-q", "-W", "ignore::DeprecationWarning", timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 4, "failed": 1}, out
    grew = re.search(r"tfmem_no_leak: TensorFlow's live bytes grew by at least ([\d.]+) MiB per run", out)
    assert grew and 3.9 <= float(grew.group(1)) <= 4.5, out
    assert "test_keeps_a_tensor_per_call" in out and "after each of the 3 runs" in out


@pytest.mark.parametrize("marker, expected", [
    ('tfmem_limit("lots")', "tfmem_limit('lots')"),
    ('tfmem_limit("1MiB", "2MiB")', "takes one size"),
    ('tfmem_limit("1MiB", device="gpu")', "name a TensorFlow device such as 'GPU:0'"),
    ('tfmem_limit("1MiB", rss="yes")', "rss is True or False"),
    ('tfmem_no_leak("1MiB", runs=1)', "at least 2"),
    ('tfmem_no_leak("1MiB", repeat=3)', "unknown argument(s) repeat"),
])
def test_bad_marker_arguments_fail_at_collection(pytester, clean_env, marker, expected):
    pytester.makepyfile(test_bad=f"import pytest\n\n@pytest.mark.{marker}\ndef test_a():\n    pass\n")
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "test_bad.py::test_a:" in err and expected in err, err


TABLE = '''
import os
import pytest
import tensorflow as tf

@pytest.mark.parametrize("mib", [8, 32, 64])
def test_allocates(mib):
    x = tf.ones((mib * 2**20 // 4,))
    assert float(tf.reduce_sum(x)) > 0

def test_plain():
    assert os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "1"  # --tfmem set the allocator up before collection
'''


def test_the_table_of_the_largest_under_xdist_with_saved_reports(pytester, clean_env, tmp_path):
    pytester.makepyfile(test_table=TABLE)
    saved = tmp_path / "reports"
    result = pytester.runpytest_subprocess("-q", "-n", "2", "--tfmem", "--tfmem-top", "2", "--tfmem-save",
                                           str(saved), timeout=300)
    out = result.stdout.str()
    assert result.parseoutcomes().get("passed") == 4, out
    table = out[out.index("tfmem: the 2 tests with the highest TensorFlow peak"):].splitlines()
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
    pytester.makepyfile(test_no_tf='''
import pytest

@pytest.mark.tfmem_limit("1MiB")
def test_plain():
    assert sum(range(10)) == 45   # TensorFlow is imported (to trace), but no op runs: its allocator never exists
''')
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()


def test_markers_on_a_unittest_method_are_refused(pytester, clean_env):
    pytester.makepyfile(test_ut='''
import unittest
import pytest

class T(unittest.TestCase):
    @pytest.mark.tfmem_limit("1MiB")
    def test_a(self):
        pass
''')
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "unittest.TestCase method" in result.stderr.str()


def test_without_markers_or_options_the_plugin_changes_nothing(pytester, clean_env):
    pytester.makepyfile(test_plain='''
import os

def test_env():
    assert "TF_CPU_ALLOCATOR_USE_BFC" not in os.environ
''')
    result = pytester.runpytest_subprocess("-q", timeout=120)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()
    assert "tfmem" not in result.stdout.str()


def test_trace_mode_for_every_test_saves_the_breakdown(pytester, clean_env, tmp_path):
    pytester.makepyfile(test_traced='''
import numpy as np
import keras

def test_fit():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, name="dense_t")])
    model.compile("sgd", "mse")
    model.fit(np.ones((128, 64), "float32"), np.ones((128, 256), "float32"), batch_size=32, verbose=0)
''')
    saved = tmp_path / "reports"
    result = pytester.runpytest_subprocess("-q", "--tfmem-trace", "--tfmem-save", str(saved), timeout=300)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()
    report = Report.load(next(saved.glob("*.json")))
    assert report.mode == "trace" and "dense_t" in {g.layer for g in report.trace.by_layer}
    assert "tfmem: the 1 test with the highest TensorFlow peak" in result.stdout.str()
