import json
import os
import subprocess
import sys

import pytest
from fresh import fresh_env

HEAVY = ("IPython", "ipywidgets", "tensorflow", "keras", "matplotlib")


def loaded_after(code: str, setup: str = "") -> list[str]:
    """The HEAVY packages (top-level names) that `code` imports in a fresh interpreter, beyond what `setup` did."""
    script = (
        f"import sys\n{setup}\nbefore = set(sys.modules)\n{code}\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} & set(%r)))" % (HEAVY,)
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip())  # a list literal printed by the child


def test_core_import_pulls_no_ipython_widgets_or_tensorflow():
    assert (
        set(
            loaded_after(
                "import tfmem_magic, tfmem_magic.pipeline, tfmem_magic.show.render, tfmem_magic.adapters.arguments"
            )
        )
        & {"IPython", "ipywidgets", "tensorflow", "keras"}
        == set()
    )


def test_the_tensorboard_writer_and_the_command_line_pull_nothing_heavy_at_import():
    # TensorBoard's summary API (and so TensorFlow) is imported only when a logdir is written
    assert loaded_after("import tfmem_magic.show.tensorboard") == []
    assert loaded_after("import tfmem_magic.adapters.cli") == []


# Keras 3 tries `import IPython` itself (keras/src/saving/file_editor.py, in a try/except ImportError), so the child
# refuses IPython and ipywidgets and records every attempt with the stack that made it: any attempt with tfmem_magic's
# code on the stack fails the test (the script imports Keras first, so Keras' own attempt has none of ours).
RECORD_NOTEBOOK_IMPORTS = """
import importlib.abc, json, sys, traceback
NOTEBOOK = ("IPython", "ipywidgets")
attempts = []

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NOTEBOOK:
            ours = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
            attempts.append({"name": name, "ours": ours})
            raise ModuleNotFoundError(f"refused for the test: {name}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.slow
def test_a_monitored_fit_and_a_tensorboard_logdir_import_no_notebook_package(tmp_path):
    """At run time, not only at import: a MemoryMonitor fit (every batch, a traced first step, saved), an evaluate,
    and to_tensorboard of a traced block, in a fresh interpreter, leave IPython and ipywidgets out of sys.modules,
    and no tfmem_magic code asked for them."""
    import tfmem_magic

    pytest.importorskip("keras")
    pytest.importorskip("tensorboard")
    package = os.path.dirname(tfmem_magic.__file__) + os.sep
    script = (
        f"PACKAGE = {package!r}\n"
        + RECORD_NOTEBOOK_IMPORTS
        + f"""
import numpy as np, keras
import tfmem_magic
from tfmem_magic.keras import MemoryMonitor
x, y = np.random.rand(128, 16).astype("float32"), np.random.randint(0, 10, 128)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(10)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
monitor = MemoryMonitor(every="batch", trace_steps=1, save={str(tmp_path / "out")!r})
model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor])
model.evaluate(x, y, verbose=0, callbacks=[monitor])
with tfmem_magic.profile(label="block", keep_xspaces=True) as p:
    model.predict(x, verbose=0)
written = tfmem_magic.to_tensorboard(p.report, {str(tmp_path / "logs")!r}, p.xspaces)
assert written.events and written.xplanes and monitor.report is not None
print(json.dumps({{"loaded": sorted(m for m in sys.modules if m.split(".")[0] in NOTEBOOK), "attempts": attempts}}))
"""
    )
    env = fresh_env()
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # the refusing finder was in the way (Keras 3 itself asks for IPython at import: keras/src/saving/file_editor.py),
    # and none of the attempts it refused came from tfmem_magic's code
    assert any(a["name"].split(".")[0] == "IPython" and not a["ours"] for a in seen["attempts"]), seen["attempts"]
    assert [a for a in seen["attempts"] if a["ours"]] == [], seen["attempts"]


def test_the_pytest_plugin_pulls_nothing_heavy_until_asked():
    # installed as a pytest11 entry point, it is imported by every pytest run in the environment
    assert loaded_after("import tfmem_magic.adapters.pytest_plugin") == []


def test_the_keras_callback_adds_no_notebook_packages_to_what_keras_imports():
    # Keras 3 imports IPython itself (keras/src/saving/file_editor.py): the callback must add nothing to that
    assert (
        set(loaded_after("import tfmem_magic.keras", setup="import keras")) & {"IPython", "ipywidgets", "matplotlib"}
        == set()
    )


def test_version_is_single_sourced():
    from importlib.metadata import version

    import tfmem_magic

    assert tfmem_magic.__version__ == version("tfmem_magic")
