"""What the benchmarks share: each measured point runs in a fresh Python process, because TensorFlow's allocator is
chosen at the first op and keeps its regions (and Keras its models' variables) for the life of the process, so a
point measured after another in one process measures both. (A benchmark run as `python benchmarks/NAME.py` has this
folder on sys.path; tests that load a benchmark from its file put it there too.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def fresh_env(**extra: str) -> dict[str, str]:
    """This process's environment without its allocator and oneDNN settings (each child's own `prepare()` chooses
    them, as a new kernel does) and with TensorFlow's INFO and WARNING logs off; `extra` is added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CPU", "TF_ENABLE_ONEDNN"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra)
    return env


def run_fresh(code: str, what: str, timeout: float = 900) -> str:
    """Run `code` in a fresh interpreter and return what it printed; a failure raises with `what` and its stderr."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=fresh_env(), timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def run_fresh_json(code: str, what: str, timeout: float = 900) -> dict:
    """`run_fresh` for code that prints one JSON line last (its result), which is returned."""
    return json.loads(run_fresh(code, what, timeout).strip().splitlines()[-1])


# Child code (a worker template's text; no braces, so it can sit inside a str.format template as it is): the next
# trace tfmem reads is kept whole in `kept["trace"]` (its events, in order), which a report does not keep.
KEEP_TRACE = """
from tfmem_magic.measure import xplane
import tfmem_magic.analyze.build as build
kept = dict()
read = xplane.read_segments

def keep(*args, **kwargs):
    kept["trace"] = trace = read(*args, **kwargs)
    return trace

build.xplane.read_segments = keep
"""
