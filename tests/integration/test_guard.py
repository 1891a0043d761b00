"""The memory guard: over-budget cells fail with a catchable error, the kernel and its variables survive."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import nbformat
import psutil
import pytest
from fresh import fresh_env
from nbclient import NotebookClient

from tfmem_magic import pipeline
from tfmem_magic.core.report import MIME_TYPE, Report
from tfmem_magic.measure.guard import MemoryLimitExceeded, parse_oom

MiB = 2**20

TF_OOM = (
    "{{function_node __wrapped__Fill_device_/job:localhost/replica:0/task:0/device:CPU:0}} OOM when allocating "
    "tensor with shape[10000,10000] and type float on /job:localhost/replica:0/task:0/device:CPU:0 by "
    "allocator bfc_cpu_allocator_for_gpu [Op:Fill] name: "
)


def test_parse_oom_reads_tensorflows_message():
    assert parse_oom(TF_OOM) == {
        "shape": "[10000,10000]",
        "dtype": "float32",
        "bytes": 400_000_000,
        "device": "CPU:0",
        "allocator": "bfc_cpu_allocator_for_gpu",
        "op": "Fill",
    }
    assert parse_oom("some other error") is None


def test_watchdog_stops_a_python_loop(shell):
    import keras  # noqa: F401  (a notebook that uses TF has it loaded: the limit is sized against that process)

    limit = psutil.Process().memory_info().rss + 300 * MiB
    cell = (
        f"%%tfmem --quick --interval 10 --limit {limit}\nimport numpy as np, time\nblocks = []\n"
        "for i in range(60):\n    blocks.append(np.ones(50 * 2**20, np.uint8))\n    time.sleep(0.02)\n"
    )
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, MemoryLimitExceeded)
    assert "Your variables are intact" in str(result.error_in_exec)
    report = pipeline.last_report()
    assert report.status == "oom" and report.guard.tripped_by == "watchdog"
    assert report.guard.source == "--limit" and report.guard.limit_bytes == limit
    kept = len(shell.user_ns["blocks"])
    assert 5 <= kept < 60  # stopped after ~300 MiB, long before the loop's 3 GB
    assert any(f.id == "oom" and "watchdog stopped the cell" in f.evidence for f in report.findings)
    shell.user_ns["blocks"].clear()
    assert shell.run_cell("%%tfmem --quick\nafter = 1").success  # no exception left pending for the next cell


def test_batch_end_check_stops_fit_between_steps(shell):
    import keras  # noqa: F401

    limit = psutil.Process().memory_info().rss + 200 * MiB
    cell = f"""%%tfmem --quick --interval 60000 --limit {limit}
import keras, numpy as np

class Grows(keras.callbacks.Callback):      # stands for a step whose memory keeps growing
    hoard = []
    def on_train_batch_end(self, batch, logs=None):
        self.hoard.append(np.ones(40 * 2**20, np.uint8))

net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
net.compile("sgd", "mse")
net.fit(np.zeros((640, 8), "float32"), np.zeros((640, 4), "float32"), batch_size=32, callbacks=[Grows()], verbose=0)
"""
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, MemoryLimitExceeded)
    assert "after batch" in str(result.error_in_exec) and "of fit()" in str(result.error_in_exec)
    report = pipeline.last_report()
    assert report.status == "oom" and report.guard.tripped_by == "batch-end check"
    assert "batch-end check" in report.guard.layers
    steps = len(shell.user_ns["Grows"].hoard)
    assert 4 <= steps < 20  # 640/32 = 20 steps would have run without the guard
    shell.user_ns["Grows"].hoard.clear()


def test_the_watchdog_cannot_land_in_the_display_of_the_cells_own_error(shell, monkeypatch, capsys):
    """The cell's own error ended it (TensorFlow's allocator refusing a request, here a ValueError) as the process
    passed the limit: the watchdog fires while IPython formats that error. Its exception must not land there (IPython
    then showed "Unexpected exception formatting exception" and the cell had no error output): the guard closes
    before the display, and the report does not say the watchdog stopped the cell."""
    from tfmem_magic.measure import guard

    opened: list[guard.Guard] = []
    monkeypatch.setattr(guard.Guard, "open", lambda g, real=guard.Guard.open: (opened.append(g), real(g))[1])
    formatter = shell.InteractiveTB
    real_format = formatter.structured_traceback

    def fires_then_formats(*args, **kwargs):
        g = opened[-1]
        sampler = threading.Thread(target=g.observe, args=(g.threshold + 1,))
        sampler.start()
        sampler.join()
        sum(range(10**6))  # Python code, where a delivered exception would land
        return real_format(*args, **kwargs)

    monkeypatch.setattr(formatter, "structured_traceback", fires_then_formats)
    limit = psutil.Process().memory_info().rss + 2**30
    result = shell.run_cell(f"%%tfmem --quick --limit {limit}\nraise ValueError('the cells own error')")
    out = capsys.readouterr().out
    assert isinstance(result.error_in_exec, ValueError), out
    assert "the cells own error" in out and "Unexpected exception" not in out, out
    report = pipeline.last_report()
    assert report.status == "error" and report.guard.tripped_by is None


def test_a_nested_cells_error_does_not_end_the_guard(shell, capsys):
    """A cell whose code runs another cell that fails goes on after that cell's error is shown: the guard stays
    armed, and the watchdog still stops the loop that follows."""
    import tensorflow  # noqa: F401 - running, as in a notebook: the limit leaves room for the cell alone

    limit = psutil.Process().memory_info().rss + 300 * MiB
    cell = f"""%%tfmem --quick --limit {limit}
import numpy as np, time
get_ipython().run_cell("1 / 0")
hoard = []
for _ in range(200):
    hoard.append(np.ones(8 * 2**20, np.uint8))
    time.sleep(0.01)
"""
    result = shell.run_cell(cell)
    out = capsys.readouterr().out
    try:
        assert "ZeroDivisionError" in out, out
        assert isinstance(result.error_in_exec, MemoryLimitExceeded), out
        report = pipeline.last_report()
        assert report.status == "oom" and report.guard.tripped_by == "watchdog"
        assert len(shell.user_ns["hoard"]) < 100
    finally:
        shell.user_ns.pop("hoard", None)


@pytest.mark.slow
def test_kernel_survives_tensorflow_ooms_with_the_allocator_limit(tmp_path):
    cells = [
        "%load_ext tfmem_magic",
        "%tfmem limit 2GB",  # before TensorFlow's first op: its allocator is capped too
        "import tensorflow as tf, numpy as np, keras\nkeep = tf.ones((256, 256))\nbefore = 42",
        "%%tfmem\nbig = tf.zeros((30000, 30000))",
        (
            "%%tfmem\nwide = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(8192), "
            "keras.layers.Dense(10)])\n"
            "wide.compile('adam', 'mse')\n"
            "wide.fit(np.zeros((65536, 1024), 'float32'), np.zeros((65536, 10), 'float32'), "
            "batch_size=65536, verbose=0)"
        ),
        "%%tfmem\nxs = []\nfor i in range(2000):\n    xs.append(tf.ones((1024, 1024)) + i)",
        "print('alive', before, keep.shape, len(xs) > 100)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable
    client.execute()
    assert "TensorFlow's allocator is capped" in nb.cells[1].outputs[0].text
    reports = {}
    for index in (3, 4, 5):
        outputs = nb.cells[index].outputs
        errors = [o.ename for o in outputs if o.output_type == "error"]
        shown = [o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs]
        # one error: the user's traceback
        assert errors in (["ResourceExhaustedError"], ["MemoryLimitExceeded"]), f"cell {index}:\n" + "\n".join(shown)
        report = next(Report.from_dict(o.data[MIME_TYPE]) for o in outputs if MIME_TYPE in o.get("data", {}))
        assert report.status == "oom" and report.guard.source == "%tfmem limit"
        assert report.guard.allocator_limit_bytes and "allocator" in report.guard.layers
        assert any(f.id == "oom" and "variables are intact" in f.evidence for f in report.findings)
        if errors == ["ResourceExhaustedError"]:  # TF's allocator refused the request: the report names it
            assert report.guard.tripped_by == "allocator" and report.error.request is not None
        else:  # the process (TF runtime included) reached the limit first: the watchdog or batch-end check
            assert report.guard.tripped_by in ("watchdog", "batch-end check")
            assert report.guard.tripped_rss_bytes > report.guard.limit_bytes
        reports[index] = report
    # one tensor larger than the allocator's cap: refused before any memory is touched
    assert reports[3].guard.tripped_by == "allocator"
    assert reports[3].error.request["shape"] == "[30000,30000]"
    assert reports[3].error.request["bytes"] == 30000 * 30000 * 4
    # the line that asked, as the notebook shows the cell (a kernel's cells are files of ipykernel's own naming)
    site = reports[3].error.site
    assert site is not None and site.label == "In [4] line 2" and site.code == "big = tf.zeros((30000, 30000))", site
    if reports[4].error.request:
        assert "65536" in reports[4].error.request["shape"]  # the fit's batch did not fit
    if reports[5].error.request:
        assert reports[5].error.request["shape"] == "[1024,1024]"  # the loop's next tensor did not fit
    assert nb.cells[6].outputs[0].text.strip() == "alive 42 (256, 256) True"


@pytest.mark.slow
def test_watchdog_firing_during_an_allocator_refusal_gives_the_guards_error(tmp_path):
    """TF's capped allocator waits up to 10 s before it refuses a request. When the process passes its limit in that
    window (here: another thread grows it), the watchdog's exception lands while TF builds its own error, which
    pybind11 reports as a RuntimeError. The user must see MemoryLimitExceeded instead: in a script and in a cell."""
    script = tmp_path / "tangle.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, threading, time
        os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = "256"
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
        import numpy as np, psutil, tfmem_magic
        tfmem_magic.prepare()
        import tensorflow as tf
        from IPython.core.interactiveshell import InteractiveShell
        tf.ones(4)
        hoard = []
        def grow():  # another thread: the watchdog's exception goes to the cell's thread
            time.sleep(1.5)
            hoard.append(np.ones(400 * 2**20 // 8))
        out = {}
        def limit():
            return psutil.Process().memory_info().rss + 200 * 2**20
        try:
            with tfmem_magic.profile(mode="quick", limit_bytes=limit()) as p:
                threading.Thread(target=grow).start()
                tf.zeros((10000, 10000))
        except BaseException as exc:
            out["script"] = [type(exc).__name__, str(exc)[:200], p.report.status, p.report.guard.tripped_by]
        hoard.clear()
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "tfmem_magic")
        shell.user_ns.update(threading=threading, grow=grow, tf=tf)
        result = shell.run_cell("%%tfmem --quick --limit " + str(limit() // 2**20) + "MiB\\n"
                                "threading.Thread(target=grow).start()\\ntf.zeros((10000, 10000))")
        report = tfmem_magic.last_report()
        exc = result.error_in_exec
        out["cell"] = [type(exc).__name__, str(exc)[:200], report.status, report.guard.tripped_by,
                       report.error.type, shell.showtraceback.__func__.__qualname__]
        print(json.dumps(out))
    """)
    )
    env = fresh_env()
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    name, message, status, tripped = out["script"]
    assert (name, status, tripped) == ("MemoryLimitExceeded", "oom", "watchdog"), out
    assert "allocator was refusing" in message and "MISMATCH" not in message
    name, message, status, tripped, report_type, method = out["cell"]
    assert (name, status, tripped, report_type) == ("MemoryLimitExceeded", "oom", "watchdog", "MemoryLimitExceeded")
    assert "allocator was refusing" in message
    assert method == "InteractiveShell.showtraceback"  # the shell's own method is back
