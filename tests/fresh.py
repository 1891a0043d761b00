"""Fresh Python processes for tests whose numbers must not depend on what earlier tests left in this process:
TensorFlow's allocator is chosen at the first op and keeps its regions (and Keras keeps trained models' variables)
for the life of the process. (pytest puts tests/ on sys.path for conftest.py, so test files import this module.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module (its programs and runners, for a test that checks a smaller case). Its
    helpers (benchmarks/_fresh.py) import as when it runs as a script; benchmarks/ is on sys.path only while it
    loads: benchmarks/panel.py would stand for the `panel` package in every later test of this process."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def fresh_env() -> dict[str, str]:
    """This process's environment without the allocator settings and limits `prepare()` (or a test) set here: a
    child process's own `prepare()` sets its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("TF_CPU", "TF_ENABLE_ONEDNN"))}


def run_python(code: str, env: dict[str, str] | None = None) -> dict:
    """Run code in a fresh interpreter (TensorFlow's allocator starts empty, as in a new kernel); it prints one JSON
    line last, which is returned. This process's allocator settings and limits are not inherited: the code's own
    `prepare()` sets them."""
    full_env = fresh_env()
    full_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# A fresh process with a real IPython shell and the extension loaded: `sh` runs cells, `pipeline` holds the reports.
FRESH_SHELL = """
import json, os, psutil, tfmem_magic
tfmem_magic.prepare()
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from tfmem_magic import pipeline
sh = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
sh.history_manager.enabled = False
sh.run_line_magic("load_ext", "tfmem_magic")
"""


def run_in_fresh_shell(body: str) -> dict:
    """Run `body` after FRESH_SHELL in a fresh process; it prints one JSON line last, which is returned. For tests
    whose numbers must not depend on what earlier tests left in this process's allocator."""
    return run_python(FRESH_SHELL + textwrap.dedent(body))
