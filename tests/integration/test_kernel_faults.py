"""Faults in a real Jupyter kernel: a real SIGINT (a timer interrupting the kernel) while tfmem arms, mid-`fit`,
while it stops the profiler and while it parses the trace; a full and a read-only temp folder; the profiler taken by
someone else; a library patching `Model.fit` inside the cell; a sampler callback that raises.

After each: the user's state is intact, nothing of tfmem is left (thread, file descriptor, environment variable,
temp folder, profiler session, allocator-stats slot), and the next cell gets a complete report in the mode it asked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
MARK = "FAULT-RESULT "
STARTED = "STARTED"  # printed by the code a test interrupts, when it begins
# A KeyboardInterrupt that lands inside Keras' per-batch log conversion (pythonify_logs, a bare `except:`) is dropped,
# and one that lands while IPython formats the traceback cuts the error output short (docs/interrupts.md); under
# %%tfmem neither loses the press any more (measure/interrupts.py). The test still presses again every AGAIN_S until
# the cell ends, as a user does, and the fit is long enough (~100 s uninterrupted) to outlast every press
AGAIN_S = 4.0
PRESSES = 15
FIT_LONG = f"print({STARTED!r}, flush=True)\nmodel.fit(x, y, epochs=1000, batch_size=32, verbose=0)"

SETUP = """
%load_ext tfmem_magic
import json, os, tempfile, threading, numpy as np, keras, tensorflow as tf
import tfmem_magic
from tfmem_magic.measure import tracer as _tracer
from tfmem_magic.analyze import build as _build
from tfmem_magic.measure.sampling import AllocatorStats
keras.utils.set_random_seed(0)
x = np.random.rand(2048, 64).astype("float32"); y = np.random.randint(0, 10, 2048)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, epochs=1, verbose=0)

def _state():
    fds = len(os.listdir("/proc/self/fd"))
    mine = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"tfmem-trace-{os.getpid()}-")]
    from tensorflow.python.profiler import profiler_v2
    return {"depth": AllocatorStats.nesting_depth(), "fds": fds, "env": dict(os.environ),
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("tfmem")),
            "temp": mine, "user_profiler": profiler_v2._profiler is not None,
            "weights_ok": bool(all(np.isfinite(w).all() for w in model.get_weights())),
            "fit_is_keras": keras.Model.fit.__qualname__}
"""
STATE = f"print({MARK!r} + json.dumps(_state()))"
NEXT = "%%tfmem --as nxt\nmodel.fit(x, y, epochs=1, batch_size=64, verbose=0)\n"
NEXT_REPORT = (
    f"print({MARK!r} + json.dumps({{'mode': nxt.mode, 'status': nxt.status, 'events': nxt.trace.events "
    "if nxt.trace else 0, 'notes': nxt.notes, 'model': nxt.model is not None}))"
)


class Kernel:
    """A real ipykernel running this interpreter, driven over ZMQ like a notebook front end."""

    def __init__(self, cwd: Path) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.kernel_spec.argv[0] = sys.executable
        self.km.start_kernel(cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(
        self, code: str, interrupt_after: float | None = None, timeout: float = 300, presses: int = PRESSES
    ) -> dict:
        """Execute a cell; returns its stdout, error name and the parsed MARK line (if printed). With
        `interrupt_after`, a real SIGINT is sent that many seconds after the cell prints STARTED (a signal sent
        before the kernel runs the cell would be ignored, so the clock starts from the cell's own word), and again
        every AGAIN_S while the cell goes on, `presses` in all."""
        done = threading.Event()
        pressed = []

        def interrupt() -> None:  # as a user does: press stop, and again if the cell goes on (see AGAIN_S)
            if not done.wait(interrupt_after):
                for _ in range(presses):
                    self.km.interrupt_kernel()
                    pressed.append(time.time())
                    if done.wait(AGAIN_S):
                        break

        timer = threading.Thread(target=interrupt, daemon=True) if interrupt_after else None
        msg_id = self.kc.execute(code)
        out, error = [], None
        deadline = time.time() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1.0, deadline - time.time()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
                if timer is not None and not timer.ident and STARTED in content["text"]:
                    timer.start()  # once: a retried step prints STARTED again
            elif kind == "error":
                error = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        done.set()
        text = "".join(out)
        marked = [line[len(MARK) :] for line in text.splitlines() if line.startswith(MARK)]
        return {
            "stdout": text,
            "error": error,
            "data": json.loads(marked[-1]) if marked else None,
            "presses": len(pressed),
        }

    def state(self) -> dict:
        return self.run(STATE)["data"]

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("kernel"))
    setup = k.run(SETUP)
    assert setup["error"] is None, setup["stdout"]
    # one profiled cell first: TensorFlow's profiler opens its files and threads once per process
    assert k.run(NEXT)["error"] is None
    k.baseline = k.state()
    yield k
    k.close()


def assert_clean_and_next_cell_complete(kernel: Kernel) -> None:
    now = kernel.state()
    base = kernel.baseline
    assert now["depth"] == 0 and now["threads"] == [] and now["temp"] == [] and not now["user_profiler"]
    assert now["env"] == base["env"]
    assert now["fds"] <= base["fds"] + 2  # a lazily opened library file at most, never one per fault
    assert now["weights_ok"] and now["fit_is_keras"] == base["fit_is_keras"]
    assert kernel.run(NEXT)["error"] is None
    nxt = kernel.run(NEXT_REPORT)["data"]
    assert nxt["mode"] == "trace" and nxt["status"] == "ok" and nxt["events"] > 0 and nxt["model"]
    assert not any("Nested" in n or "could not" in n or "Interrupted" in n for n in nxt["notes"]), nxt["notes"]


def slowed(target: str, seconds: float) -> str:
    """Code that makes `target` (module.attr or Class.method) sleep before doing its work, and a name to undo it."""
    owner, name = target.rsplit(".", 1)
    return (
        f"_saved = {target}\n"
        f"def _slow(*a, **k):\n    import time; print({STARTED!r}, flush=True); time.sleep({seconds})\n"
        "    return _saved(*a, **k)\n"
        f"{owner}.{name} = _slow\n"
    )


def undo(target: str) -> str:
    return f"{target} = _saved\n"


def test_sigint_while_tfmem_arms(kernel):
    kernel.run(slowed("_tracer.Tracer.start", 3))
    try:
        cell = kernel.run("%%tfmem\nran = True", interrupt_after=0.5)
    finally:
        kernel.run(undo("_tracer.Tracer.start"))
    assert cell["error"] == "KeyboardInterrupt"  # the user's Ctrl-C stopped the cell before its code ran
    assert kernel.run(f"print({MARK!r} + json.dumps('ran' in globals()))")["data"] is False
    assert_clean_and_next_cell_complete(kernel)


def test_sigint_mid_fit_keeps_the_model_and_reports_interrupted(kernel):
    cell = kernel.run("%%tfmem --as r\n" + FIT_LONG, interrupt_after=3.0)
    assert cell["error"] == "KeyboardInterrupt"
    r = kernel.run(f"print({MARK!r} + json.dumps([r.status, r.mode, r.trace.events if r.trace else 0]))")["data"]
    assert r[0] == "interrupted" and r[1] == "trace" and r[2] > 0
    assert_clean_and_next_cell_complete(kernel)


@pytest.mark.parametrize("where", ["_tracer.Tracer.finish", "_build.trace_info"])
def test_sigint_while_tfmem_stops_or_parses_the_trace(kernel, where):
    kernel.run(slowed(where, 2))
    try:
        cell = kernel.run("%%tfmem --as r\nmodel.fit(x, y, epochs=1, verbose=0)\nran = 1", interrupt_after=0.5)
    finally:
        kernel.run(undo(where))
    assert cell["error"] is None  # the user's code had finished: only tfmem's own work is cut short
    notes = kernel.run(f"print({MARK!r} + json.dumps([r.status, r.notes, ran]))")["data"]
    assert notes[0] == "ok" and notes[2] == 1 and any("Interrupted" in n for n in notes[1]), notes
    assert_clean_and_next_cell_complete(kernel)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("readonly", [False, True], ids=["full", "read-only"])
def test_a_full_or_read_only_temp_folder(kernel, tiny_tmpfs, readonly):
    if readonly:
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    kernel.run(f"_saved_tmp = tempfile.tempdir; tempfile.tempdir = {str(tiny_tmpfs)!r}")
    try:
        cell = kernel.run("%%tfmem --as r\nmodel.fit(x, y, epochs=1, verbose=0)\nran = 2")
        r = kernel.run(
            f"print({MARK!r} + json.dumps([r.status, r.mode, r.notes, r.trace.note if r.trace else None, ran]))"
        )["data"]
    finally:
        kernel.run("tempfile.tempdir = _saved_tmp")
    assert cell["error"] is None and r[0] == "ok" and r[4] == 2
    said = " ".join(r[2]) + (r[3] or "")
    if readonly:  # no trace folder can be made: measured in quick mode, and said
        assert r[1] == "quick" and "could not start" in said
    else:  # the folder is made but the export does not fit: the trace ends, and says why
        assert "export failed" in said, said
    assert list(tiny_tmpfs.iterdir()) == []  # nothing left in the full folder either
    assert_clean_and_next_cell_complete(kernel)


def test_a_profiler_session_someone_else_started(kernel, tmp_path):
    kernel.run(f"tf.profiler.experimental.start({str(tmp_path)!r})")
    try:
        kernel.run("%%tfmem --as r\nz = tf.ones((64, 64))")
        r = kernel.run(f"print({MARK!r} + json.dumps([r.mode, r.notes]))")["data"]
    finally:
        kernel.run("tf.profiler.experimental.stop()")
    assert r[0] == "quick" and any("profiler session you started" in n for n in r[1])
    # a session that bypasses tf.profiler's registry: our start fails, the cell is measured in quick mode
    kernel.run(
        "from tensorflow.python.profiler.internal import _pywrap_profiler\n"
        f"_other = _pywrap_profiler.ProfilerSession(); _other.start({str(tmp_path / 'raw')!r}, {{}})"
    )
    try:
        kernel.run("%%tfmem --as r\nz = tf.ones((64, 64))")
        r = kernel.run(f"print({MARK!r} + json.dumps([r.mode, r.notes]))")["data"]
    finally:
        kernel.run("_other.export_to_tb(); del _other")
    assert r[0] == "quick" and any("could not start" in n for n in r[1]), r
    assert_clean_and_next_cell_complete(kernel)


def test_a_library_patching_fit_inside_the_cell_keeps_its_patch(kernel):
    cell = kernel.run(
        "%%tfmem\n_keras_fit = keras.Model.fit\n"
        "def logged_fit(self, *a, **k):\n    return _keras_fit(self, *a, **k)\n"
        "keras.Model.fit = logged_fit\nmodel.fit(x, y, epochs=1, verbose=0)"
    )
    assert cell["error"] is None
    kept = kernel.run(f"print({MARK!r} + json.dumps(keras.Model.fit is logged_fit))")["data"]
    kernel.run("keras.Model.fit = _keras_fit")
    assert kept is True
    assert_clean_and_next_cell_complete(kernel)


def test_a_sampler_callback_that_raises(kernel):
    kernel.run(
        "_saved = _tracer.Tracer.observe\n"
        "def _broken(self, *a):\n    raise RuntimeError('observer broke')\n"
        "_tracer.Tracer.observe = _broken"
    )
    try:
        cell = kernel.run("%%tfmem --as r --interval 10\nmodel.fit(x, y, epochs=3, verbose=0)")
        r = kernel.run(f"print({MARK!r} + json.dumps([r.status, r.notes, len(r.rss.samples)]))")["data"]
    finally:
        kernel.run("_tracer.Tracer.observe = _saved")
    assert cell["error"] is None and r[0] == "ok"
    assert any("callback failed" in n and "observer broke" in n for n in r[1]), r[1]
    assert r[2] > 3  # sampling went on after the callback failed
    assert_clean_and_next_cell_complete(kernel)


# stands for Keras' own `pythonify_logs` (keras/src/utils/python_utils.py), which converts each batch's logs inside a
# bare `try: ... except: pass`: a press that lands there is dropped and fit goes on (docs/interrupts.md)
SWALLOWER = f"""
import time
class Swallower(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            try:
                print({STARTED!r}, flush=True)
                time.sleep(3)
            except:  # noqa: E722
                pass
"""
# one epoch, and one press for the plain fit: with three epochs and a press every AGAIN_S, the later presses had to land
# in the later epochs' sleeps, and on a loaded machine one landed between them and stopped the plain fit
FIT_SWALLOWED = "model.fit(x, y, epochs=1, batch_size=32, verbose=0, callbacks=[Swallower()])\nprint('FIT-RAN-TO-END')"
# an exception whose display takes seconds (a deep library traceback on a busy machine): a second press lands
# while IPython formats it, and IPython then prints a bare "KeyboardInterrupt" and sends no error output
SLOW_TO_SHOW = f"""
class SlowToShow(Exception):
    shown = 0
    def __str__(self):
        SlowToShow.shown += 1
        if SlowToShow.shown == 1:
            time.sleep(3)
        return "slow to show"
print({STARTED!r}, flush=True)
raise SlowToShow()
"""


def test_a_stop_that_keras_swallows_inside_fit_still_ends_the_cell_failed(kernel):
    kernel.run(SWALLOWER)
    plain = kernel.run(FIT_SWALLOWED, interrupt_after=0.5, presses=1)  # what Keras does on its own: the press is lost
    assert plain["error"] is None and "FIT-RAN-TO-END" in plain["stdout"] and plain["presses"] == 1
    cell = kernel.run("%%tfmem --as r\n" + FIT_SWALLOWED, interrupt_after=0.5)
    assert cell["error"] == "KeyboardInterrupt" and "FIT-RAN-TO-END" not in cell["stdout"], cell
    notes = kernel.run(f"print({MARK!r} + json.dumps([r.status, r.notes]))")["data"]
    # the first press did it, at the next batch end (batch 4: a lost first press would have been raised by the
    # second, AGAIN_S later, batches on). Not the count of presses: the harness presses again when the cell has
    # not ended AGAIN_S after the first, and on a loaded CI machine the report of the stopped fit can take that
    # long to make and show (it did once: 2 presses, the cell stopped at batch 4 all the same)
    assert notes[0] == "interrupted" and any("raised it again after batch 4 of fit()" in n for n in notes[1]), notes
    assert_clean_and_next_cell_complete(kernel)


def test_a_second_stop_while_the_traceback_is_shown_keeps_the_error(kernel):
    plain = kernel.run(SLOW_TO_SHOW, interrupt_after=1.0)  # IPython alone: the error output is lost
    assert plain["error"] is None and "KeyboardInterrupt" in plain["stdout"]
    kernel.run("SlowToShow.shown = 0")
    cell = kernel.run("%%tfmem --quick --as r\n" + SLOW_TO_SHOW, interrupt_after=1.0)
    assert cell["error"] == "SlowToShow" and "KeyboardInterrupt" not in cell["stdout"], cell
    notes = kernel.run(f"print({MARK!r} + json.dumps(r.notes))")["data"]
    assert any("arrived while the cell's traceback was shown" in n for n in notes), notes
    assert_clean_and_next_cell_complete(kernel)


def test_a_stop_the_users_code_catches_is_left_alone(kernel):
    code = (
        f"try:\n    print({STARTED!r}, flush=True)\n    time.sleep(3)\nexcept KeyboardInterrupt:\n"
        "    print('stopped early')\nprint('went on')"
    )
    cell = kernel.run("%%tfmem --quick --as r\n" + code, interrupt_after=0.5)
    assert cell["error"] is None and "went on" in cell["stdout"]
    notes = kernel.run(f"print({MARK!r} + json.dumps(r.notes))")["data"]
    assert any("your code caught the KeyboardInterrupt" in n for n in notes), notes
    assert_clean_and_next_cell_complete(kernel)


def test_a_stop_a_library_swallows_in_a_custom_loop_ends_at_the_next_step(kernel):
    """A GradientTape loop that calls a library which drops the interrupt (Keras' own pythonify_logs, fed a value
    that takes a while to convert): raised again after the next optimizer step."""
    code = f"""
from keras.src.utils.python_utils import pythonify_logs
class SlowToConvert:
    def __float__(self):
        print({STARTED!r}, flush=True)
        time.sleep(3)
        return 0.0
opt = keras.optimizers.Adam()
for step in range(40):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x[:64]) ** 2)
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    if step == 2:
        pythonify_logs({{"slow": SlowToConvert()}})
print('LOOP-RAN-TO-END')
"""
    cell = kernel.run("%%tfmem --quick --as r\n" + code, interrupt_after=0.5)
    assert cell["error"] == "KeyboardInterrupt" and "LOOP-RAN-TO-END" not in cell["stdout"], cell
    notes = kernel.run(f"print({MARK!r} + json.dumps(r.notes))")["data"]
    assert any("of a custom training step" in n for n in notes), notes
    assert_clean_and_next_cell_complete(kernel)


def test_stop_pressed_at_many_moments_always_ends_the_cell_failed(kernel):
    """The reproduction of issue 28 in small: one press at each of many offsets into a long fit (it lands in the
    step, in Keras' callbacks, in its log conversion...), and every time the cell ends with a KeyboardInterrupt
    error. benchmarks/stop_presses.py runs the 50-press version beside plain Keras."""
    for i in range(10):
        cell = kernel.run("%%tfmem\n" + FIT_LONG, interrupt_after=0.05 + 0.23 * i)
        assert cell["error"] == "KeyboardInterrupt", (i, cell["presses"], cell["stdout"][-2000:])
    assert_clean_and_next_cell_complete(kernel)


def test_many_faulted_cells_leave_nothing_behind(kernel):
    """The leak test over faults: interrupted and failing cells, again and again, then the kernel's state."""
    for i in range(6):
        began = time.time()
        cell = kernel.run("%%tfmem\n" + FIT_LONG, interrupt_after=0.3 + 0.4 * i)
        assert cell["error"] == "KeyboardInterrupt", (
            i,
            round(time.time() - began, 1),
            cell["presses"],
            cell["stdout"][-2000:],
        )
        assert kernel.run("%%tfmem --quick\nraise ValueError('the cell fails')")["error"] == "ValueError"
    assert_clean_and_next_cell_complete(kernel)
